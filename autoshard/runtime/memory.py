"""``measure_stage_memory``: what one stage really holds in a training step's steady state, measured.

The memory model (``autoshard.costs.memory``) predicts a stage's training memory from the plan;
this runs the stage on real tensors, on one process, so the prediction can be checked. The stages
before it run once to give it a microbatch of its inputs; the stage then runs its forward once per
microbatch it keeps in flight under the schedule (a fresh copy of its inputs each time, read
through ``contiguous_grad``, its outputs with gaps in their storage copied, as ``pipeline_stage``'s
wired stages receive, read and send them; all graphs kept alive),
then backwards as the schedule runs them after ``zero_grad`` (which frees the gradients): in 1F1B's
steady state one, the next microbatch's forward and the next backward, which meets the gradients
the first made and those it sent back (the schedule holds them), with what the warm-up sent still
held where the schedule holds it; where every forward runs first (GPipe, or 1F1B keeping all the
step's microbatches) one that makes the gradients and the next ones, which meet them and what the
earlier sent back (GPipe holds all of it to its last backward, so all of them run); with
``keep_gradients`` the gradients exist from the start (``_Backwards``). Each backward starts from a
gradient of its output's shape; the optimizer state exists (after the first step). The peak is
counted by live tensor storages with PyTorch's own ``MemTracker``
(``torch.distributed._tools.mem_tracker``), which works on CPU: it sees every storage an operator
returns and when it is freed, and sorts them into weights, gradients, optimizer state,
activations, backward temporaries and what was handed in. Memory a kernel
allocates and frees inside itself (a workspace) is not seen. On CUDA the total is
``torch.cuda.max_memory_allocated`` instead (the parts still come from the tracker), rounded as
the allocator rounds each block (to 512 bytes: tiny stages measure up to 30% above their
storages). cuBLAS's workspaces (32 MiB per thread multiplying on the device on an H200: the
caller's and autograd's) are taken before the measurement, as the device's, not the stage's.

Like torch's ``PipelineStage``, the stage holds a receive buffer for every microbatch of the step
(``microbatches``; None: one per stage) of what it receives (the microbatches in flight run on
theirs) and of the gradients of what it sends (its backward starts from one); a ``PipelineStage``
allocates them once and keeps them from step to step (``tests/test_runtime_pipeline.py`` counts
them in a real pipeline). The first stage holds every microbatch of the step's batch, which
``schedule.step`` is handed whole; the last stage holds the losses of the microbatches not in
flight too: the schedule keeps each microbatch's loss until the step ends.

After the last backward, with no microbatch in flight, the stage's weight state and receive
buffers stay while the step ends: the tied-gradient sum (the buffer ``TiedGradients.sync`` makes,
made here by the same function, on the first stage of each rank, and beside it the buffer of each
weight that rank's stages alone hold, one at a time) and then the optimizer's step, the real
``torch.optim`` class stepping stand-ins of the weights (``runtime.optimizer_step``: no bit of the
weights changes), ``foreach`` as the plan's memory model says (None: torch's choice for the
device). The stage's peak is the larger of the two phases.

Schedules: ``1f1b`` keeps ``min(k - j, microbatches)`` microbatches in flight at stage ``j`` of
``k`` (its warm-up forwards plus the one before its first backward); ``gpipe`` keeps all of them;
``interleaved-1f1b`` what PyTorch's op order keeps of that stage (``MemoryModel.in_flight``). The
measurement is of one stage: under an interleaved schedule a process holds several (add them up).
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from autoshard.arguments import whole_number
from autoshard.costs.layouts import dense_order, order_undone, sent_as_copy
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.saved import without_cyclic_gc
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, suggest
from autoshard.runtime.optimizer_step import OPTIMIZER_STATE, StandIns, optimizer_state_names, stand_ins
from autoshard.runtime.replay import (
    checked_call, checked_stage, fresh_copy, model_kept, running_device, serving_plan, stage_inputs, tensors_in)
from autoshard.runtime.schedule import SCHEDULES
from autoshard.runtime.ties import shared_parameters, summing_buffers
from autoshard.runtime.wire import contiguous_grad, own_gradient
from autoshard.sharded import ShardedModel

if TYPE_CHECKING:
    from autoshard.costs.trackers import QuietMemTracker

#: The schedules whose steady state one stage on one process can stand for.
MEASURED_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")

#: The parts of a measurement, in the order reports show them.
PARTS = ("weights", "gradients", "optimizer", "activations", "received", "temporaries")


@dataclass(frozen=True)
class StageMemoryMeasurement:
    """What one stage held, in bytes. ``peak`` is the most at once, in either phase; ``parts`` splits
    the tracker's peak of the schedule's steady state into ``PARTS`` (weights with buffers; received:
    the receive buffers, of inputs and of output gradients; temporaries: what the backward allocates
    besides gradients). ``resident`` is the same split just before the backward: what the stage keeps
    between steps of the schedule. ``after_backward`` splits the most it held after its last
    backward, the tie sum's buffer and the optimizer step's temporaries in ``temporaries``.
    ``source`` says how ``peak`` was read."""

    stage: int
    schedule: str
    optimizer: str
    in_flight: int
    peak: int
    parts: Mapping[str, int]
    resident: Mapping[str, int]
    device: str
    source: str
    after_backward: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "schedule": self.schedule, "optimizer": self.optimizer,
                "in_flight": self.in_flight, "peak": self.peak, "parts": dict(self.parts),
                "resident": dict(self.resident), "after_backward": dict(self.after_backward),
                "device": self.device, "source": self.source}


def microbatches_in_flight(schedule: str, stage: int, num_stages: int, microbatches: int | None = None,
                           stages_per_rank: int | None = None) -> int:
    """Microbatches whose activations ``stage`` keeps at once under ``schedule``, as the memory model
    counts them (``MemoryModel.in_flight``); ``microbatches`` None means a full pipeline,
    ``stages_per_rank`` None the schedule's own."""
    return _measured_schedule(schedule, microbatches, stages_per_rank).in_flight(stage, num_stages)


def _measured_schedule(schedule: str, microbatches: int | None, stages_per_rank: int | None,
                       keep_gradients: bool = False, **step: object) -> MemoryModel:
    """The memory model's view of a schedule one stage's measurement can stand for (and of ``step``:
    how the optimizer steps), its arguments refused with a typed error naming the accepted ones."""
    if not isinstance(schedule, str):
        raise InvalidArgumentTypeError(f"schedule must be a name ({', '.join(MEASURED_SCHEDULES)}), got {schedule!r}")
    name = schedule.lower()
    if name not in MEASURED_SCHEDULES:
        if name in SCHEDULES:
            raise InvalidArgumentError(
                f"schedule {schedule!r} has no steady state one stage can stand for here; a one-process "
                f"measurement takes {', '.join(map(repr, MEASURED_SCHEDULES))}")
        raise InvalidArgumentError(f"unknown schedule {schedule!r}{suggest(name, MEASURED_SCHEDULES)}; "
                                   f"measured schedules: {', '.join(MEASURED_SCHEDULES)}")
    count = None if microbatches is None else whole_number(microbatches, "microbatches", at_least=1)
    return MemoryModel(microbatches=count, schedule=name, stages_per_rank=stages_per_rank,
                       keep_gradients=keep_gradients, **step)  # type: ignore[arg-type]


def _stages_per_rank(schedule: object, given: int | None, planned: MemoryModel) -> int | None:
    """``given`` (``MemoryModel`` refuses more than one under a schedule that runs one per process);
    left out, the plan's under the plan's schedule, and another schedule's own under that one."""
    name = schedule.lower() if isinstance(schedule, str) else schedule
    if given is None:
        return planned.stages_per_rank if name == planned.schedule else None
    return given


def measure_stage_memory(
    sharded: ShardedModel,
    stage: int,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    schedule: str | None = None,
    microbatches: int | None = None,
    optimizer: str | None = None,
    stages_per_rank: int | None = None,
    master_weights: bool | None = None,
    optimizer_foreach: bool | None = None,
    keep_gradients: bool | None = None,
) -> StageMemoryMeasurement:
    """Run stage ``stage`` of ``sharded`` in its steady state and return the most memory it held.

    ``example_inputs`` / ``example_kwargs`` are one microbatch of the model's inputs (pass the
    example the plan was made with to compare with ``plan_report``, whose activations were
    measured on it). The model is left as it was: its gradients, buffers and random state are
    restored afterwards. ``stages_per_rank`` is for ``interleaved-1f1b``: the stages each process runs
    (refused with another schedule, which runs one).
    ``master_weights``: the optimizer also keeps an fp32 copy of each trainable weight narrower than
    fp32, as ``MemoryModel(master_weights=True)`` counts it (in ``optimizer``).
    Inputs the plan's guards refuse run on the specialisation that serves them, as a call would choose it.
    ``optimizer_foreach``: the optimizer steps every weight at once (True) or one after another (False).
    ``keep_gradients``: the training loop keeps the gradients between steps; by default ``zero_grad``
    frees them, so where every forward of the step runs before the stage's first backward (GPipe;
    1F1B keeping all the step's microbatches) that backward starts with none, and a second one
    follows it, meeting them, one microbatch fewer and the gradients the first sent back.
    Each of ``schedule``, ``microbatches``, ``optimizer``, ``stages_per_rank``, ``master_weights``,
    ``optimizer_foreach`` and ``keep_gradients`` left None is the plan's memory model's (``shard_model``'s
    ``memory_model``, as ``plan_report`` counts it; its ``optimizer_foreach`` None is torch's choice for
    the device), so the measurement checks the prediction of the training the plan was made for.
    """
    stage = checked_stage(sharded, stage, "measure_stage_memory")
    planned = sharded.plan.memory_model
    if planned.layout():  # else a peak of pipelining alone is read against a prediction for the layout
        raise InvalidArgumentError(
            f"measure_stage_memory runs a stage under pipelining alone, but the plan's memory model counts "
            f"{planned.layout()}, which it does not run; compare it with plan_report(sharded, "
            "memory=dataclasses.replace(sharded.plan.memory_model, data_parallel=None, dp=1, mixed_precision=None, "
            "activation_checkpointing=False)), or measure the ranks parallelize builds")
    schedule = planned.schedule if schedule is None else schedule
    microbatches = planned.microbatches if microbatches is None else microbatches
    optimizer = planned.optimizer if optimizer is None else optimizer
    master_weights = planned.master_weights if master_weights is None else master_weights
    foreach = planned.optimizer_foreach if optimizer_foreach is None else optimizer_foreach
    keep_gradients = planned.keep_gradients if keep_gradients is None else keep_gradients
    example_inputs, example_kwargs = checked_call(sharded, example_inputs, example_kwargs, "measure_stage_memory")
    k = sharded.num_stages
    run = _measured_schedule(schedule, microbatches, _stages_per_rank(schedule, stages_per_rank, planned),
                             keep_gradients, master_weights=master_weights, optimizer_foreach=foreach)
    in_flight, buffered = run.in_flight(stage, k), run.step_microbatches(k)
    optimizer_state_names(optimizer)  # refuses a name it does not know
    with model_kept(sharded):
        plan = serving_plan(sharded, example_inputs, example_kwargs)
        module = plan.stages[stage]
        args, kwargs = stage_inputs(plan, stage, example_inputs, example_kwargs)
        device = running_device(module, (args, kwargs))
        step = _Step(optimizer.lower(), master_weights, foreach, *_tie_sums(plan, stage, k // run.stages_per_rank),
                     _tied(plan, stage))
        try:
            peak, parts, resident, after = _run_in_steady_state(module, device, args, kwargs, in_flight, step,
                                                                _Buffers(stage > 0, stage < k - 1, buffered),
                                                                _Backwards.of(run, stage, k))
        except NotImplementedError as exc:
            if "Sparse" not in str(exc):
                raise
            raise InvalidArgumentError(
                f"measure_stage_memory cannot measure stage {stage}: it makes sparse tensors (a sparse gradient: "
                "nn.Embedding(sparse=True)), whose storages torch's MemTracker cannot read; the memory model "
                "counts such a gradient as a dense one of its weight's size") from exc
    return StageMemoryMeasurement(
        stage, schedule.lower(), optimizer.lower(), in_flight, peak, parts, resident, str(device),
        "torch.cuda.max_memory_allocated" if device.type == "cuda" else "live tensor storages (MemTracker)",
        after)


def _tie_sums(plan: ShardedModel, stage: int, ranks: int) -> tuple[
        dict[int, tuple[torch.dtype, tuple[int, ...]]], tuple[tuple[torch.dtype, tuple[int, ...]], ...]]:
    """What ``TiedGradients.sync`` sums on the rank of ``stage`` when it is that rank's first stage
    (stage s on rank s mod ranks; nothing on another): every trainable weight held by stages on two
    ranks or more, in its flat buffers (by index, as ``summing_buffers`` takes them), then, one at a
    time in a buffer of its own, each one this rank's stages alone hold (interleaved 1F1B)."""
    if stage >= ranks:
        return {}, ()
    across, alone = {}, []
    for i, shared in enumerate(shared_parameters(plan)):
        on = {s % ranks for s in shared.stages}
        if len(on) > 1:
            across[i] = (shared.dtype, shared.shape)
        elif on == {stage}:
            alone.append((shared.dtype, shared.shape))
    return across, tuple(alone)


def _tied(plan: ShardedModel, stage: int) -> tuple[nn.Parameter, ...]:
    """The weights of ``stage`` that other stages hold too: ``TiedGradients.sync`` writes their summed
    gradient into every holder, whether the stage's backward gave it one or not."""
    module = plan.stages[stage]
    held = (module.get_parameter(name) for shared in shared_parameters(plan) for s, name in shared.holders
            if s == stage)
    return tuple({id(p): p for p in held}.values())


@dataclass(frozen=True)
class _Step:
    """How the step after the last backward runs: the optimizer's name, its master copies, whether it
    steps all weights at once (None: torch's choice), the tie sum's parts (``summing_buffers``) and the
    ties this rank alone holds (dtype and shape of each)."""

    optimizer: str
    master_weights: bool
    foreach: bool | None
    tie_sum: Mapping[int, tuple[torch.dtype, tuple[int, ...]]]
    ties_alone: tuple[tuple[torch.dtype, tuple[int, ...]], ...] = ()
    tied: tuple[nn.Parameter, ...] = ()

    def sum_ties(self, device: torch.device) -> None:
        """Make and free what ``TiedGradients.sync`` does: the flat buffers of the ties across ranks,
        held (its ``totals`` view them) while each tie of this rank alone is summed in zeros of its own."""
        flats = summing_buffers(self.tie_sum, device)
        for dtype, shape in self.ties_alone:
            torch.zeros(shape, dtype=dtype, device=device)  # freed at once, as sync's ``total`` is at the next
        for p in self.tied:  # a tie this stage's backward gave no gradient: sync writes the sum into it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        del flats

    def optimizers(self, params: list[nn.Parameter]) -> StandIns:
        """``stand_ins`` over ``params`` for this step's optimizer."""
        return stand_ins(params, self.optimizer, self.master_weights, self.foreach)


class _Untouched(nn.Module):
    """Calls ``stage`` on the microbatch it holds, so that the module ``MemTracker`` sees called
    first takes no tensors. Its module tracker hooks the gradients of every module's inputs and
    keeps each until the module's last input has one (``register_multi_grad_hook``): for a stage
    those are the received values, whose gradients it then held to the end of the backward, and
    autograd, seeing them referenced, copied the one it sends back. No pipeline runtime does
    either. The stage's modules inside are tracked as before. It reads the microbatch through
    ``contiguous_grad`` and (``sends``) returns its outputs as a wired stage sends them: a stage may
    write in place to what it received, and sends a copy of a value with gaps in its storage."""

    def __init__(self, stage: nn.Module, sends: bool) -> None:
        super().__init__()
        self.stage, self.sends = stage, sends
        self.microbatch: tuple[tuple, dict] = ((), {})

    def forward(self) -> Any:
        args, kwargs = tree_map_only(torch.Tensor, _as_received, self.microbatch)
        out = self.stage.forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, _as_sent, out) if self.sends else out


def _as_received(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a wired stage reads it: through ``contiguous_grad``, and, where it fills its storage in
    another order (a channels-last map), received as that order's contiguous buffer and permuted back
    (``runtime.wire``): its gradient is then copied only if not laid out in that order."""
    order = dense_order(t) if t.requires_grad else None
    if order is None:
        return contiguous_grad(t)
    return contiguous_grad(t.permute(order)).permute(order_undone(order))


def _as_sent(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the wire sends it: itself where it fills its storage (contiguous, or permuted to be),
    else a contiguous copy (a slice), and with a gradient of its own where it views a weight (``own_gradient``)."""
    return own_gradient(t.contiguous() if sent_as_copy(t) else t)


@dataclass(frozen=True)
class _Backwards:
    """The backwards measured, as the schedule runs them after ``zero_grad``: whether the first makes
    the weights' gradients (``made``: none exist before it), how many run (the next meets them and the
    gradients the earlier sent back, which the received values keep as ``grad``, as torch's schedules
    hold them: GPipe all to its last backward, so all of them run), whether a forward runs between the
    first two (``refill``: 1F1B's steady state, back to the microbatches in flight), and whether what
    the first sent stays held after its backward (``warmup_send``: ``MemoryModel.holds_warmup_send``)."""

    made: bool = False
    count: int = 1
    refill: bool = False
    warmup_send: bool = False

    @classmethod
    def of(cls, schedule: MemoryModel, stage: int, num_stages: int) -> _Backwards:
        refill, in_flight = schedule.refills(stage, num_stages), schedule.in_flight(stage, num_stages)
        if refill:
            count = 2
        elif schedule.forwards_first(stage, num_stages):  # up to the backward holding the most sent back
            count = min(in_flight, schedule.sends_held(stage, num_stages) + 1)
        else:
            count = 1
        return cls(schedule.makes_gradients(stage, num_stages) or (refill and not schedule.keep_gradients),
                   count, refill, schedule.holds_warmup_send(stage, num_stages))


@dataclass(frozen=True)
class _Buffers:
    """The receive buffers a ``PipelineStage`` keeps, each for ``microbatches``: of its inputs (the first
    stage's are the step's batch it is handed, ``receives`` False: they want no gradient), of its
    outputs' gradients (``sends``: not the last, whose backward starts from the loss)."""

    receives: bool
    sends: bool
    microbatches: int


def _run_in_steady_state(
    module: nn.Module, device: torch.device, args: tuple, kwargs: dict, in_flight: int, step: _Step,
    buffers: _Buffers, backwards: _Backwards = _Backwards(),
) -> tuple[int, dict[str, int], dict[str, int], dict[str, int]]:
    """Forward ``in_flight`` microbatches, back-propagate the first (and as ``backwards`` says, forward
    one more and back-propagate the next), then end the step: the peak, its parts, the parts held
    before the backward and those of the peak after it."""
    cuda = device.type == "cuda"
    gc.collect()  # garbage from before (a plan tried for the inputs) would count in ``before``
    if cuda:  # before the receive buffers: the stage holds them (taken after, a stage's 400 MB went unseen)
        _take_workspaces(device)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    received = [fresh_copy((args, kwargs), buffers.receives) for _ in range(buffers.microbatches)]
    # (on a copy of its own: a stage may write in place to what it received)
    waiting, trainable = _first_step(module, fresh_copy((args, kwargs), buffers.receives),
                                     buffers.microbatches if buffers.sends else 0, step.tied)
    if cuda:  # the peak from here on, the buffers included as they are held
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for p in trainable:  # ``zero_grad`` freed them, or they accumulate from an earlier microbatch
        p.grad = None if backwards.made else torch.zeros_like(p)
    optimizers = step.optimizers(trainable)
    held = [module, *optimizers.all, *[t for mb in received for t in tensors_in(mb)],
            *[g for microbatch in waiting for g in microbatch]]  # received, not made here
    from autoshard.costs.trackers import QuietMemTracker  # (its import is slow: see trackers)

    tracker = QuietMemTracker()
    tracker.track_external(*held)
    with without_cyclic_gc(), tracker:  # in this order: see ``without_cyclic_gc``
        caller = _Untouched(module, buffers.sends)
        # the others' buffers wait for their microbatches
        outputs = [_forward(caller, microbatch, tracker) for microbatch in received[:in_flight]]
        # (the microbatch a refill runs brings its own)
        earlier_losses = _earlier_losses(outputs[0], buffers.microbatches - in_flight - backwards.refill, buffers.sends)
        resident = _parts(tracker.get_tracker_snapshot("current"), device, optimizers)
        for i in range(backwards.count):
            _backward(outputs[i], waiting[i] if waiting else None, tracker)
            if backwards.warmup_send and i == 0:
                outputs[i] = [t.detach() for t in tensors_in(outputs[i])]  # sent: its storages stay held
            elif not _is_loss(outputs[i], buffers.sends):  # the schedule keeps a loss to the step's end
                outputs[i] = None
            if backwards.refill and i == 0:
                outputs.append(_forward(caller, received[in_flight], tracker))
    parts = _parts(tracker.get_tracker_snapshot("peak"), device, optimizers)
    del outputs, caller, earlier_losses  # the step ends with no microbatch in flight
    after = _after_backward(held, device, step, optimizers, resident["optimizer"])  # the buffers stay
    if cuda:
        torch.cuda.synchronize(device)
        weights = parts["weights"]  # allocated before ``before``: the stage holds them throughout
        return torch.cuda.max_memory_allocated(device) - before + weights, parts, resident, after
    return max(sum(parts.values()), sum(after.values())), parts, resident, after


def _forward(caller: _Untouched, microbatch: tuple[tuple, dict], tracker: QuietMemTracker) -> Any:
    """The stage's output on ``microbatch``, a new microbatch to the tracker, not a second iteration."""
    caller.microbatch = microbatch
    tracker.reset_mod_stats()
    return caller()


def _backward(output: Any, received: list[torch.Tensor] | None, tracker: QuietMemTracker) -> None:
    """Back-propagate one microbatch from the gradients ``received`` for what it sent (the last
    stage's, None: ones, as from the loss)."""
    sent = [t for t in tensors_in(output) if t.requires_grad]
    if sent:
        gradients = received if received is not None else [torch.ones_like(t) for t in sent]
        tracker.track_external(*gradients)
        torch.autograd.backward(sent, gradients)


def _is_loss(output: Any, sends: bool) -> bool:
    """Whether ``output`` is the last stage's loss: one tensor of one element."""
    return not sends and isinstance(output, torch.Tensor) and output.numel() == 1


def _earlier_losses(output: Any, count: int, sends: bool) -> list[torch.Tensor]:
    """Storages as big as the last stage's loss for ``count`` microbatches not in flight:
    ``torch.distributed.pipelining`` keeps every microbatch's loss until the step ends, and a loss
    can view a whole buffer (a CPU ``mse_loss``). None for another stage."""
    if not _is_loss(output, sends):
        return []
    nbytes = output.untyped_storage().nbytes()
    return [torch.empty(nbytes, dtype=torch.uint8, device=output.device) for _ in range(count)]


def _after_backward(held: list, device: torch.device, step: _Step, optimizers: StandIns,
                    state: int) -> dict[str, int]:
    """The parts of the most held while the step ends: the tie sum's buffer (made and freed, as
    ``TiedGradients.sync`` does before the optimizer steps), then the optimizer's step. What is
    not weight state or a receive buffer is in ``temporaries``."""
    from autoshard.costs.trackers import QuietMemTracker  # (its import is slow: see trackers)

    tracker = QuietMemTracker()
    tracker.track_external(*held)
    with without_cyclic_gc(), tracker:
        step.sum_ties(device)
        optimizers.step()
    parts = _parts(tracker.get_tracker_snapshot("peak"), device, optimizers)
    made = sum(parts.values()) - parts["weights"] - parts["gradients"] - parts["received"] - state
    return {**dict.fromkeys(PARTS, 0), "weights": parts["weights"], "gradients": parts["gradients"],
            "optimizer": state, "received": parts["received"], "temporaries": made}


def _take_workspaces(device: torch.device) -> None:
    """Have cuBLAS take its workspaces now: at the first matrix product a thread runs on a device (the
    caller's, then autograd's in a backward) it takes one from the caching allocator and keeps it for
    the process. Taken during the measurement they counted in whichever stage was measured first
    (34 MB in a stage of 0.5 MB on an H200)."""
    with torch.enable_grad():
        a = torch.ones(2, 2, device=device, requires_grad=True)
        (a @ a).sum().backward()


def _first_step(module: nn.Module, microbatch: tuple[tuple, dict], count: int,
                tied: Sequence[nn.Parameter] = ()) -> tuple[list[list[torch.Tensor]], list[nn.Parameter]]:
    """One forward and backward before the measurement, as the steps before the steady state ran: the
    ``count`` receive buffers for the gradients of what the stage sends (a ``PipelineStage`` allocates
    them before its first step, so they are there during the forwards too), and the trainable weights
    the backward gives a gradient, the only ones ``torch.optim`` keeps state for (not a weight read
    under ``torch.no_grad`` or before a ``detach``), and those of ``tied``, into which ``TiedGradients.sync``
    writes one; and those a backward of its own, run by a custom Function's, adds into (Reformer's reversible
    layers recompute theirs), which ``autograd.grad`` does not return. Nothing keeps a gradient of it.
    The received values' gradients are asked for too, as the stage makes them to send back: torch 2.13's
    CPU GroupNorm backward on a channels-last map of under 2,048 positions writes its input's gradient
    through a null pointer where none is asked for (a diffusers UNet's stage killed the process)."""
    caller = _Untouched(module, sends=count > 0)
    caller.microbatch = microbatch
    sent = [t for t in tensors_in(caller()) if t.requires_grad]
    trainable = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
    received = [t for t in tensors_in(microbatch) if t.requires_grad]
    grads = torch.autograd.grad(sent, [*trainable, *received], [torch.ones_like(t) for t in sent],
                                allow_unused=True)[:len(trainable)] if sent and trainable else ()
    synced = {id(p) for p in tied}
    given = [p for p, grad in zip(trainable, grads) if grad is not None or p.grad is not None or id(p) in synced]
    for p in trainable:
        p.grad = None
    return [[torch.ones_like(t) for t in sent] for _ in range(count)], given


def _parts(snapshot: Mapping[torch.device, Mapping[Any, int]], device: torch.device,
           optimizers: StandIns) -> dict[str, int]:
    """The tracker's snapshot of ``device`` as bytes per part of ``PARTS``, less Adam's step counts
    (a scalar a weight, on the CPU whatever the device; the memory model leaves them out)."""
    from autoshard.costs.trackers import PART_OF

    parts = dict.fromkeys(PARTS, 0)
    for found, by_type in snapshot.items():
        if torch.device(found).type != device.type:
            continue
        for ref, size in by_type.items():
            if ref in PART_OF:
                parts[PART_OF[ref]] += size
    parts["optimizer"] -= sum(state["step"].untyped_storage().nbytes() for optimizer in optimizers.all
                              for state in optimizer.state.values()
                              if "step" in state and state["step"].device.type == device.type)
    return parts


__all__ = ["MEASURED_SCHEDULES", "OPTIMIZER_STATE", "PARTS", "StageMemoryMeasurement", "measure_stage_memory",
           "microbatches_in_flight", "optimizer_state_names"]
