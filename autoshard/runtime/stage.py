"""``pipeline_stage``: one stage of a ``ShardedModel`` as a ``torch.distributed.pipelining`` stage.

Everything that could make a launch hang is checked first, identically on every rank: the stage
count and index, the device, boundary values that are not tensors, and a world size the stages
cannot be spread over. Only then is the ``PipelineStage`` built.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.pipelining import PipelineStage

from autoshard.arguments import whole_number
from autoshard.errors import (
    NO_SPECIALISATIONS,
    InputMismatchError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PipelineSetupError,
    SpecializationMismatch,
    WorldSizeError,
    user_stacklevel,
)
from autoshard.isolation import isolated
from autoshard.runtime.boundaries import boundary_wires
from autoshard.runtime.devices import DeviceLike, resolve_device, retarget_devices
from autoshard.runtime.rebuild import like, replaced, shared_across_stages
from autoshard.runtime.replay import plan_fingerprint
from autoshard.runtime.schedule import PLAN_KEY, SIGNATURE_KEY, local_stage_indices
from autoshard.runtime.wire import Wire, rewire
from autoshard.sharded import ShardedModel
from autoshard.specialize import serves_as_captured


class PlanStage(PipelineStage):
    """A ``PipelineStage`` whose shape inference runs on zeros rather than uninitialised memory.

    Before the first step PyTorch runs every stage once on tensors it makes from the shapes the
    previous stage announced (``torch.empty``). A stage that uses a received integer as an index
    (token ids read by an embedding, labels of a loss the model computes itself) would index with
    garbage there and fail on one rank while its peers wait. Zeros are a valid index everywhere.
    (``_to_tensor`` is the hook torch 2.13's ``PipelineStage`` makes those tensors with; the
    multi-process tests pass labels across a boundary, so a change there fails them.)
    """

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):  # made from metadata, not received
            with torch.no_grad():
                tensor.zero_()
        return tensor

    # Those inference runs are not steps of training: a batch norm in training mode would count
    # them in its running statistics, and a dropout would take numbers from the generator. The
    # stage's buffers, module state and random generators are set back after them: after the
    # backward run when one follows (the backward reads the buffers the forward saved).
    def _forward_metadata_inference(self, args: Any, kwargs: dict[str, Any] | None = None,
                                    has_backward: bool = False) -> Any:
        untouched = contextlib.ExitStack()
        untouched.enter_context(isolated(self.submod, seed=None))
        try:
            result = super()._forward_metadata_inference(args, kwargs, has_backward)
        except BaseException:
            untouched.close()
            raise
        if has_backward:
            self._autoshard_untouched = untouched
        else:
            untouched.close()
        return result

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        untouched = getattr(self, "_autoshard_untouched", None) or contextlib.ExitStack()
        self._autoshard_untouched = None
        with untouched:
            return super()._backward_metadata_inference(*args, **kwargs)


class SharedBufferWarning(UserWarning):
    """A buffer several pipeline stages hold is updated by each stage's copy on its own."""


def _warn_of_shared_buffers(sharded: ShardedModel, shared: dict[int, list[tuple[int, str]]], stage_index: int) -> None:
    """A normalisation module called from several stages (one batch norm after every layer) has
    its running statistics on each of their ranks; in training mode each copy updates its own,
    which then differ from the model's. Gradients are summed (``TiedGradients``), these cannot be."""
    if not sharded.plan.training:
        return
    buffers = {id(b) for stage in sharded.stages for m in stage.modules()
               if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats for b in m.buffers()}
    mine = [", ".join(f"stage {s}: {name}" for s, name in holders) for key, holders in shared.items()
            if key in buffers and any(s == stage_index for s, _ in holders)]
    if mine:
        warnings.warn(
            f"buffers held by more than one stage ({'; '.join(mine)}): in training mode each stage's copy "
            "updates them on its own (a batch norm's running statistics), so they end up differing from the "
            "model's; keep the module that owns them in one stage (no_split=[...] or split{no-split=...}) "
            "or in eval mode",
            SharedBufferWarning, stacklevel=user_stacklevel())


def _check_stage_choice(sharded: Any, stage_index: Any, num_stages: Any) -> tuple[int, int]:
    if not isinstance(sharded, ShardedModel):
        raise InvalidArgumentTypeError(
            f"pipeline_stage needs the ShardedModel that shard_model returned, got {type(sharded).__name__}")
    stage_index, num_stages = whole_number(stage_index, "stage_index"), whole_number(num_stages, "num_stages")
    if num_stages != sharded.num_stages:
        raise InvalidArgumentError(
            f"num_stages is {num_stages} but the plan has {sharded.num_stages} stages; "
            f"pass {sharded.num_stages} or shard the model into {num_stages} stages")
    if not 0 <= stage_index < num_stages:
        raise InvalidArgumentError(
            f"stage_index {stage_index} is outside the plan's stages 0..{num_stages - 1}")
    return stage_index, num_stages


def _plan_for_microbatch(sharded: ShardedModel, microbatch: Any, group: dist.ProcessGroup | None,
                         world_size: int) -> ShardedModel:
    """The plan serving ``microbatch`` (for the model as the first of them leaves it:
    ``Specializer.settled``), or the same refusal on every rank (a rank that raised alone would leave its
    peers waiting in the first step)."""
    plan, problem = sharded, None
    if not isinstance(microbatch, (tuple, Mapping)):
        problem = (f"microbatch must be a tuple of one microbatch's positional inputs or a dict of its keyword "
                   f"inputs, got {type(microbatch).__name__}")
    else:
        args, kwargs = ((), dict(microbatch)) if isinstance(microbatch, Mapping) else (microbatch, {})
        try:
            if sharded.specializer is not None:
                plan = sharded.specializer.settled(sharded, sharded.specializer.plan_for(sharded, args, kwargs),
                                                   (args, kwargs))
            elif not serves_as_captured(sharded, args, kwargs):
                problem = _no_plan_chosen(sharded, isinstance(microbatch, Mapping))
        except Exception as exc:  # noqa: BLE001 - the model's own error too: every rank must hear of it
            problem = f"{type(exc).__name__}: {exc}"
    _agree(problem, group, world_size, "no plan serves the microbatch on every rank",
           "pass every rank the same microbatch, one the model accepts")
    return plan


def _plan_after_first_call(sharded: ShardedModel, group: dist.ProcessGroup | None, world_size: int) -> ShardedModel:
    """``sharded``, unless each of its calls writes a setting of the model that the next call reads anew (a
    Hugging Face classifier fills in ``config.problem_type`` on its first call with labels): a step runs the
    stages once per microbatch, and the first stage's check would refuse the second, so the stage is built
    from the plan made for the model as the first call leaves it (``Specializer.settled``), on every rank or
    on none."""
    moving = sharded.attributes_moved_by_each_call()
    if not moving:
        return sharded
    plan, problem = sharded, None
    if sharded.specializer is None:
        problem = (f"each call of these stages sets the model's {', '.join(moving)} to another value than they were "
                   "captured with, and they make no specialisations to serve the calls after the first: make them "
                   "with shard_model(..., respecialize=True), or set that value on the model before sharding it")
    else:
        try:
            plan = sharded.specializer.settled(sharded, sharded)
        except Exception as exc:  # noqa: BLE001 - the model's own error too: every rank must hear of it
            problem = f"{type(exc).__name__}: {exc}"
    _agree(problem, group, world_size, "no plan serves the calls after the first on every rank",
           "shard the model with respecialize=True on every rank, with the same example")
    return plan


def _agree(problem: str | None, group: dist.ProcessGroup | None, world_size: int, refusal: str, advice: str) -> None:
    """Raise ``PipelineSetupError`` on every rank where any rank met a ``problem``, naming each rank's."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, problem, group=group)
    problems = [f"rank {rank}: {text}" for rank, text in enumerate(gathered) if text]
    if problems:
        raise PipelineSetupError(f"{refusal} (" + "; ".join(problems) + f"); {advice}")


def _check_model_as_captured(sharded: ShardedModel) -> None:
    """Refuse to build a stage of the plan itself (no ``microbatch=``) for a model whose state rules that
    plan out already: a module switched to another mode, an attribute its code read set to another value
    since sharding. The plan's own check runs in the first step on rank 0 alone, while the other ranks
    wait on it and die with "Connection closed by peer"; here each rank checks its own model, before any
    collective, once per build (``check_model_state``: a walk over the modules and attributes read)."""
    try:
        sharded.check_model_state()
    except InputMismatchError as exc:
        refusal = exc.refusal if isinstance(exc, SpecializationMismatch) else str(exc)
        fix = ("build the stage with pipeline_stage(..., microbatch=one microbatch's inputs), which chooses (or "
               "captures) the plan serving the model as it is now" if sharded.specializer is not None else
               f"shard the model again as it is now ({NO_SPECIALISATIONS})")
        raise PipelineSetupError(
            f"the model changed after it was sharded, and this stage's plan no longer serves it: {refusal}. Its "
            f"first step would fail on the first rank alone; set the model back before building the stage, or "
            f"{fix}") from exc


def _no_plan_chosen(sharded: ShardedModel, by_name: bool) -> str:
    """Why stages that make no specialisations have no plan for a microbatch other than the call their
    plan was captured for, and what does: a copy (deepcopy, pickle, ``materialize_stage``) keeps no
    specializer, so its ``specialize`` and calls cannot capture; the sharded model it was copied from can,
    before it is copied (sharding again with respecialize=True would hand back another such copy)."""
    if sharded.captured_for is None:
        return ("these stages were made without example inputs, so no plan can be chosen for a microbatch: shard "
                "the model with example_inputs= like one microbatch, or build the stage without microbatch=")
    call = "sharded.specialize(**microbatch)" if by_name else "sharded.specialize(*microbatch)"
    return (f"{NO_SPECIALISATIONS}, and their plan was not captured for a microbatch like this one (its shapes and "
            "constants, the grad mode, the model's settings), the only one they serve without choosing: on the "
            f"sharded model shard_model (or load_plan) returned, call {call} before copying or materialising it, "
            "and build the stage from the plan it returns (for a model on the meta device: "
            f"materialize_stage({call}, stage_index, checkpoint)); or pass a microbatch like the example the "
            "plan was captured for")


def _group_position(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise PipelineSetupError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "(torchrun sets the environment it needs) before building pipeline stages")
    return dist.get_rank(group), dist.get_world_size(group)


def stage_module(sharded: ShardedModel, stage_index: int, device: torch.device,
                 private: frozenset[int] = frozenset(),
                 layout: list[list[Wire]] | None = None) -> fx.GraphModule:
    """Stage ``stage_index`` as a module of its own whose tensors (and the devices its graph names)
    are ``device``, taking and returning the tensors of its boundaries (``layout``, by default
    ``boundary_wires(sharded)``).

    A tensor already on ``device`` is the model's own (training it trains the model), unless its
    id is in ``private``: a tensor an earlier stage of the same rank also holds gets a copy of its
    own, because each PipelineStage accumulates its gradients separately (``TiedGradients`` sums
    them into every holder, so the copies train as the model's own does, which the first holds:
    ``sharded``'s own calls and ``state_dict`` see the weights trained).
    """
    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:
            raise PipelineSetupError(
                f"stage {stage_index} holds '{name}' on the meta device; load its weights first: "
                "sharded = autoshard.runtime.materialize_stage(sharded, stage_index, checkpoint) "
                "returns a copy that holds them (the sharded model it is given stays as it was)")
        if tensor.device == device and id(tensor) not in private:
            return tensor
        return like(tensor, tensor.detach().to(device, copy=True))

    module = replaced(sharded.stages[stage_index], place)
    retarget_devices(module, device)
    rewire(module, stage_index, boundary_wires(sharded) if layout is None else layout)
    return module


def pipeline_stage(
    sharded: ShardedModel,
    stage_index: int,
    num_stages: int,
    device: DeviceLike,
    group: dist.ProcessGroup | None = None,
    *,
    microbatch: tuple[Any, ...] | Mapping[str, Any] | None = None,
) -> PipelineStage:
    """The ``PipelineStage`` running stage ``stage_index`` of ``sharded`` on ``device``.

    Stage ``i`` runs on rank ``i % world_size`` of ``group`` (the default group if None); drive
    the stages with PyTorch's schedules (``autoshard.runtime.build_schedule`` checks the world
    size fits the schedule). Stages take and return flat tuples of tensors (a tuple crossing a
    boundary is sent as the items later stages read); the last stage returns the tensors of the
    model's output (a ``ModelOutput`` as ``return_dict=False`` would, one tensor as itself). The
    stage module's ``state_dict()`` keys are the original model's. Parameters several stages
    share need ``TiedGradients.sync()`` after each step.

    ``microbatch`` (one microbatch's positional inputs, or a dict of its inputs by name; give the
    same on every rank) builds the stage of the plan captured for its shapes, nested ones too: the
    plan itself when they are its example's, else a specialisation (``sharded.specialize``), so
    that no guard flips in the middle of a step. Every rank agrees on it or every rank refuses,
    naming each rank's reason. Where each call of that plan fills in a setting of the model that its
    next call reads (a Hugging Face classifier's ``config.problem_type``, set on its first call with
    labels), the stage is the plan's made for the model as the first call leaves it, the value
    written on the model (``Specializer.settled``): the plan itself would serve the first microbatch only.
    """
    stage_index, num_stages = _check_stage_choice(sharded, stage_index, num_stages)
    resolved = resolve_device(device, f"stage {stage_index}")
    if resolved.type == "meta":
        raise PipelineSetupError(
            "a pipeline stage cannot run on the meta device; give a cpu or accelerator device")
    layout = boundary_wires(sharded)  # refuses values that are no tensors before any collective
    rank, world_size = _group_position(group)
    if num_stages % world_size or num_stages < world_size:
        raise WorldSizeError(
            f"{num_stages} stages cannot be spread evenly over {world_size} processes; launch "
            f"{num_stages} processes (or a divisor of {num_stages}) or shard into a multiple of "
            f"{world_size} stages")
    if microbatch is not None:
        chosen = _plan_for_microbatch(sharded, microbatch, group, world_size)
    else:
        chosen = _plan_after_first_call(sharded, group, world_size)
        if chosen is sharded:
            _check_model_as_captured(sharded)
    if chosen is not sharded:
        sharded, layout = chosen, boundary_wires(chosen)  # the values the chosen plan's stages send
    local = local_stage_indices(num_stages, rank, world_size)
    if stage_index not in local:
        raise InvalidArgumentError(
            f"stage {stage_index} runs on rank {stage_index % world_size}, but this is rank {rank}, "
            f"which runs stages {local}")
    shared = shared_across_stages(sharded)
    _warn_of_shared_buffers(sharded, shared, stage_index)
    # a tensor several stages of this rank hold: the first holds the model's own, the others copies
    private = frozenset(key for key, holders in shared.items()
                        if min((s for s, _ in holders if s in local), default=stage_index) != stage_index)
    module = stage_module(sharded, stage_index, resolved, private, layout)
    module.meta[PLAN_KEY] = plan_fingerprint(sharded)
    if stage_index == 0:
        module.meta[SIGNATURE_KEY] = sharded.model_signature
    return PlanStage(module, stage_index, num_stages, resolved, group=group)
