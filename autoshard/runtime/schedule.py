"""Pick a ``torch.distributed.pipelining`` schedule and check the world size fits it first.

PyTorch's schedules do not check that the processes match the stages: ``ScheduleGPipe`` given a
4-stage pipeline on 2 ranks simply waits forever for a stage nobody runs. Every rank computes the
same verdict from the same numbers, so a bad launch fails on all ranks before any of them blocks.
Stage ``i`` runs on rank ``i % world_size`` (PyTorch's loop placement).
"""

from __future__ import annotations

import bisect
import functools
import warnings
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import BACKWARD_INPUT, PipelineScheduleMulti, PipelineScheduleSingle
from torch.utils._pytree import SUPPORTED_NODES, keystr, tree_flatten_with_path, tree_is_leaf

from autoshard.arguments import whole_number
from autoshard.costs.facts import node_facts
from autoshard.costs.values import TensorMeta
from autoshard.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PipelineSetupError,
    SpecializationMismatch,
    WorldSizeError,
    suggest, user_stacklevel,
)
from autoshard.runtime.wire import OutputTensors, loss_reader, send_own_tensors
from autoshard.sharded import fitted_call

#: Schedules by the names the example and the benchmark accept.
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
}
ScheduleLike = Union[str, type]
#: Where ``pipeline_stage`` records the plan's fingerprint in the stage module's ``meta``.
PLAN_KEY = "autoshard_plan"
#: Where it records the model's signature in the first stage's ``meta``: ``step`` binds by it.
SIGNATURE_KEY = "autoshard_model_signature"


def schedule_class(schedule: ScheduleLike) -> type:
    """The schedule class for a name in ``SCHEDULES`` (in any case: ``"1F1B"``) or a schedule class."""
    if isinstance(schedule, str):
        name = schedule.lower()
        if name not in SCHEDULES:
            raise InvalidArgumentError(
                f"unknown schedule {schedule!r}{suggest(name, SCHEDULES)}; known: {', '.join(SCHEDULES)}")
        return SCHEDULES[name]
    if isinstance(schedule, type) and issubclass(schedule, (PipelineScheduleSingle, PipelineScheduleMulti)):
        return schedule
    raise InvalidArgumentTypeError(
        f"schedule must be a name ({', '.join(SCHEDULES)}) or a torch.distributed.pipelining "
        f"schedule class, got {schedule!r}")


#: Schedules that place two stages per rank mirrored (rank r: r and 2W-1-r), not in a loop.
_V_SHAPED = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


#: The schedules to name when the chosen one cannot run the stages: they run several per process.
_SEVERAL_PER_PROCESS = "schedule 'interleaved-1f1b' or 'looped-bfs'"


def schedule_name(cls: type) -> str:
    """``schedule 'interleaved-1f1b'``: ``cls`` as ``build_schedule`` takes it, so that a message
    names what the caller can pass; a class ``SCHEDULES`` lacks keeps its own name."""
    return next((f"schedule {name!r}" for name, known in SCHEDULES.items() if known is cls), cls.__name__)


def check_world_size(num_stages: int, world_size: int, schedule: ScheduleLike) -> None:
    """Raise ``WorldSizeError`` unless ``world_size`` processes can run ``num_stages`` stages
    under ``schedule``."""
    cls = schedule_class(schedule)
    name = schedule_name(cls)
    if issubclass(cls, PipelineScheduleSingle):
        if num_stages != world_size:
            raise WorldSizeError(
                f"{name} runs one stage per process: {num_stages} stages need {num_stages} processes, "
                f"but the world size is {world_size}; launch with --nproc-per-node {num_stages}, "
                f"shard into {world_size} stages, or use the {_SEVERAL_PER_PROCESS} with several stages per process")
        return
    if issubclass(cls, _V_SHAPED):
        raise WorldSizeError(
            f"{name} places stages in a V (rank r runs stages r and 2W-1-r), but autoshard places "
            f"stage i on rank i % world_size; use the {_SEVERAL_PER_PROCESS}")
    if num_stages % world_size or num_stages < world_size:
        raise WorldSizeError(
            f"{name} gives every process the same number of stages: {num_stages} stages do not divide "
            f"among {world_size} processes; shard into a multiple of {world_size} stages "
            f"(e.g. {2 * world_size}) or launch a number of processes that divides {num_stages}")


def local_stage_indices(num_stages: int, rank: int, world_size: int) -> list[int]:
    """The stages rank ``rank`` runs: ``rank``, ``rank + world_size``, ..."""
    return list(range(rank, num_stages, world_size))


def _check_ranks_agree(local: list[PipelineStage], group: dist.ProcessGroup | None, schedule: tuple[str, int]) -> None:
    """Every rank must pass the stages it runs, all of the same split, under the same schedule and
    number of microbatches (``schedule``), or one waits for values another never sends. One
    collective, made by every rank here; then every rank raises alike."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    expected = local_stage_indices(local[0].num_stages, rank, world_size)
    given = sorted(s.stage_index for s in local)
    misplaced = None if given == expected else f"rank {rank} runs stages {expected} but was given {given}"
    plans = sorted({str(getattr(stage.submod, "meta", {}).get(PLAN_KEY)) for stage in local})
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (misplaced, plans, schedule), group=group)
    problems = [problem for problem, _, _ in gathered if problem]
    if problems:
        raise InvalidArgumentError(
            "; ".join(problems) + "; build every stage a rank runs (pipeline_stage) and pass them all")
    if any(other != schedule for _, _, other in gathered):
        by_rank = ", ".join(f"rank {r}: {name} over {n} microbatches" for r, (_, _, (name, n)) in enumerate(gathered))
        raise PipelineSetupError(
            f"the processes run different schedules or numbers of microbatches ({by_rank}); pass the "
            "same schedule and n_microbatches to build_schedule on every rank")
    if any(other != plans for _, other, _ in gathered):
        by_rank = ", ".join(f"rank {r}: {'/'.join(p)}" for r, (_, p, _) in enumerate(gathered))
        raise PipelineSetupError(
            f"the processes split the model differently ({by_rank}); build the same model with the "
            "same seed and shard it with the same arguments on every rank, or save one plan and "
            "load it everywhere")


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """``loss_fn`` for a model that computes its own loss (``GPTStyleLMWithLoss``, a Hugging Face
    model given ``labels``): the model's ``loss`` entry (a dict key, a ``ModelOutput`` field),
    else the last stage's output if it is one tensor, else its first tensor. A loss must have
    one element: anything else is refused (``PipelineSetupError``) rather than back-propagated.

    Computing the loss inside the model puts it in the plan, so cost models see the last stage's
    whole work. PyTorch's schedules still need a ``target`` on the last rank, which they split into
    microbatches: pass the labels (or any tensor with the batch dimension); it is ignored here.
    A loss per microbatch cannot be concatenated back into a batch: a schedule built with it steps with
    ``return_outputs=False`` unless told otherwise; read the losses from ``losses=[]``.
    """
    return _model_loss_at(None, output)


def _model_loss_at(reader: OutputTensors | None, output: Any, target: Any = None) -> torch.Tensor:
    """``model_loss`` on the rank of the last stage, whose ``reader`` says where ``loss`` is."""
    index = reader.loss_index if reader is not None else None
    loss = output if isinstance(output, torch.Tensor) else output[0 if index is None else index]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shapes = [list(t.shape) for t in ((output,) if isinstance(output, torch.Tensor) else output)]
        raise PipelineSetupError(
            f"model_loss needs the model's loss, one number per microbatch, but took a value of shape "
            f"{list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__} from the last "
            f"stage's outputs {shapes}; return the loss under the key 'loss' (or first), or pass a "
            "loss_fn that computes it")
    return loss


def build_schedule(
    stages: PipelineStage | Sequence[PipelineStage],
    schedule: ScheduleLike,
    n_microbatches: int,
    loss_fn: Callable[..., Any] | None = None,
    **options: Any,
) -> Any:
    """The schedule over this rank's stages, once the world size, the stage placement and the plan
    itself (the same on every rank: a collective) are checked.

    Pass every stage this rank runs (one for GPipe and 1F1B; ``rank``, ``rank + W``, ... for
    interleaved schedules). ``options`` go to the schedule class unchanged.

    The gradients a step adds are the mean over its microbatches, as PyTorch's schedules make them,
    but by the loss's gradient (``_MicrobatchMean``) rather than their ``scale_grads``, which divides
    the whole ``.grad`` at the step's end: the gradients steps before had accumulated too. Pass
    ``scale_grads`` to have PyTorch's own.
    """
    n_microbatches = whole_number(n_microbatches, "n_microbatches", at_least=1)
    local = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not local or not all(isinstance(s, PipelineStage) for s in local):
        raise InvalidArgumentTypeError("build_schedule needs the PipelineStage(s) this rank runs")
    cls = schedule_class(schedule)
    group = local[0].group
    check_world_size(local[0].num_stages, dist.get_world_size(group), cls)
    _check_ranks_agree(local, group, (schedule_name(cls), n_microbatches))
    _warn_of_per_microbatch_statistics(local, n_microbatches)
    last = next((stage.submod for stage in local if stage.is_last), None)
    the_models_loss = loss_fn is model_loss
    if the_models_loss and last is not None:
        loss_fn = functools.partial(_model_loss_at, loss_reader(last))
    if loss_fn is not None and "scale_grads" not in options:
        loss_fn, options = _microbatch_mean(loss_fn, n_microbatches), {**options, "scale_grads": False}
    if issubclass(cls, PipelineScheduleSingle):
        built = cls(local[0], n_microbatches, loss_fn=loss_fn, **options)
    else:
        built = cls(sorted(local, key=lambda s: s.stage_index), n_microbatches, loss_fn=loss_fn, **options)
    if _splits_backward(built):
        for stage in local:
            send_own_tensors(stage.submod)
    chunked_by_rows = not {"args_chunk_spec", "kwargs_chunk_spec"} & options.keys()
    first = next((stage.submod for stage in local if stage.stage_index == 0), None)
    built.step = _BatchShapes(n_microbatches, chunked_by_rows, _example_rows(first)).guard(
        _gradients_of_their_own(built.step, local), first, the_models_loss)
    return built


def _splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` runs the backward of a stage's inputs apart from its weights' (zero bubble)."""
    actions = [action for actions in (getattr(schedule, "pipeline_order", None) or {}).values() for action in actions
               if action is not None]
    parts = [part for action in actions for part in action.sub_actions or (action,)]  # (DualPipeV's overlaps)
    return any(part.computation_type is BACKWARD_INPUT for part in parts)


def _gradients_of_their_own(step: Callable[..., Any], stages: Sequence[PipelineStage]) -> Callable[..., Any]:
    """``step``, after which no weight's ``.grad`` is a receive buffer's storage. A ``PipelineStage``
    keeps one buffer per microbatch for the gradients of what it sends and receives into it every
    step; where a value sent is made of weights without a copy (``torch.stack([w1, w2])``, a cat, a
    view), autograd hands each weight a slice of that buffer and keeps it as its ``.grad`` when laid
    out as the weight is. The next step's gradient, received into it, overwrote the gradients kept
    between steps (``zero_grad(set_to_none=False)``, accumulation over steps). Views of a weight get
    a gradient of their own as they are sent (``wire.own_gradient``, as the memory model counts it);
    this catches the rest, once a step (the address of each weight's gradient looked up among the
    buffers': well under a microsecond a weight)."""
    weights = list({id(p): p for stage in stages for p in stage.submod.parameters()}.values())

    @functools.wraps(step)
    def stepped(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        buffers = sorted((storage.data_ptr(), storage.data_ptr() + storage.nbytes())
                         for stage in stages for infos in stage.grad_recv_info.values() for info in infos
                         if isinstance(buffer := getattr(info, "buffer", None), torch.Tensor)
                         and (storage := buffer.untyped_storage()).nbytes())
        starts = [start for start, _ in buffers]
        for weight in weights:
            grad = weight.grad
            if type(grad) is not torch.Tensor:  # none, or an FSDP-sharded weight's DTensor
                continue
            at = bisect.bisect_right(starts, grad.data_ptr()) - 1
            if at >= 0 and grad.data_ptr() < buffers[at][1]:
                weight.grad = grad.clone()
        return result
    return stepped


class _MicrobatchMean(torch.autograd.Function):
    """The loss as it is, whose gradient is divided by the step's microbatch count."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, n_microbatches: int) -> torch.Tensor:
        ctx.n_microbatches = n_microbatches
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.n_microbatches, None


def _microbatch_mean(loss_fn: Callable[..., Any], n_microbatches: int) -> Callable[..., Any]:
    """``loss_fn`` whose loss back-propagates the microbatch's share of the step's mean."""
    @functools.wraps(loss_fn)
    def loss(*args: Any, **kwargs: Any) -> Any:
        value = loss_fn(*args, **kwargs)
        wants_gradient = isinstance(value, torch.Tensor) and value.requires_grad
        return _MicrobatchMean.apply(value, n_microbatches) if wants_gradient else value
    return loss


class MicrobatchSizeWarning(UserWarning):
    """A step's microbatches have other rows than the example the plan was made on."""


def _example_rows(first: fx.GraphModule | None) -> frozenset[int]:
    """The leading sizes of the tensors the plan's example gave the first stage: what its memory and
    time predictions count as one microbatch (empty on the other ranks)."""
    if first is None:
        return frozenset()
    values = [getattr(node_facts(node), "value", None) for node in first.graph.find_nodes(op="placeholder")]
    return frozenset(value.shape[0] for value in values if isinstance(value, TensorMeta) and value.shape)


class _BatchShapes:
    """PyTorch's pipeline sizes the buffers between stages from the first microbatch it runs and
    keeps them: a batch that splits into unequal microbatches, or a later batch of another shape,
    made a rank crash in gloo or fail in backward while another computed its loss from
    mismatched rows. Checked here, on the ranks that are given inputs or targets, before
    anything is sent. Only those ranks raise (a check every rank joins would cost a collective
    per step): the others wait for the refused batch, so the error should end the job."""

    def __init__(self, n_microbatches: int, chunked_by_rows: bool, example_rows: frozenset[int] = frozenset()) -> None:
        self.n_microbatches = n_microbatches
        self.chunked_by_rows = chunked_by_rows  # torch's default: split every tensor along dim 0
        self.example_rows = example_rows
        self.first: dict[str, tuple[int, ...]] | None = None
        self._named: dict[tuple, list[tuple[int, str]]] = {}  # by call structure (``_named_tensors``)

    def guard(self, step: Callable[..., Any], first: fx.GraphModule | None,
              the_models_loss: bool = False) -> Callable[..., Any]:
        """``step``, checked; on the rank of the first stage (``first``), the model's inputs are
        bound as ``ShardedModel`` binds them and passed by name (PyTorch would hand positional
        inputs to the first stage's parameters, which are the example's: ``step(x, mask)``
        reached ``bias`` when the example passed ``bias`` and no ``mask``). With ``model_loss``
        (``the_models_loss``) the outputs are not merged unless asked for (``return_outputs=True``):
        the model's loss, one number per microbatch, cannot be concatenated into a batch, and torch
        failed so on the last rank after every microbatch had run (a new user's DistilBERT step)."""
        @functools.wraps(step)
        def checked(*args: Any, target: Any = None, **kwargs: Any) -> Any:
            options = {name: kwargs.pop(name) for name in _STEP_OPTIONS if name in kwargs}
            if the_models_loss:
                options.setdefault("return_outputs", False)
            try:  # binding refuses an argument the example passed and the step leaves out: the same advice
                if first is not None and SIGNATURE_KEY in first.meta:
                    args, kwargs = fitted_call(first, first.meta[SIGNATURE_KEY], args, kwargs)
                self.check(args, kwargs, target)
                return step(*args, target=target, **options, **kwargs)
            except SpecializationMismatch as exc:  # a step cannot capture again half-way, as a call does
                raise SpecializationMismatch(
                    f"{exc.refusal}. A pipeline step runs the stages it was built with: build them for the "
                    "microbatches the step runs, pipeline_stage(sharded, i, k, device, microbatch=one microbatch's "
                    "inputs), which makes the plan serving them", exc.before_compute, other_capture=False) from exc

        return checked

    def check(self, args: tuple, kwargs: dict[str, Any], target: Any) -> None:
        containers = [f"args[{i}] ({type(a).__name__})" for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        if containers:  # PyTorch's stages take positional arguments as tensors only
            raise InvalidArgumentError(
                f"step was given {', '.join(containers)} by position, but PyTorch's pipeline takes only tensors "
                "there; pass it by its argument's name (schedule.step(batch=...))")
        shapes = {name: tuple(value.shape) for name, value in self._named_tensors(args, kwargs, target)}
        if self.chunked_by_rows:
            for name, shape in shapes.items():
                if not shape or not shape[0] or shape[0] % self.n_microbatches:
                    rows = (f"{shape[0]} rows" if shape[0] else "no rows") if shape else "no batch dimension"
                    raise InvalidArgumentError(
                        f"{name} has {rows}, which does not split into {self.n_microbatches} equal "
                        f"microbatches; PyTorch's pipeline sends buffers sized from the first microbatch, "
                        f"so give a batch whose size is a multiple of {self.n_microbatches}")
        if self.chunked_by_rows and self.n_microbatches > 1:
            _warn_of_unequal_labels(target if target is not None else kwargs.get("labels"), self.n_microbatches)
        if self.first is None:
            self.first = shapes
            self._warn_of_other_rows(shapes)
            return
        changed = [f"{name} {list(shape)} (first step: {list(self.first[name])})"
                   for name, shape in shapes.items() if self.first.get(name, shape) != shape]
        if changed:
            raise InvalidArgumentError(
                f"this step's inputs differ in shape from the first step's: {', '.join(changed)}; the "
                "stages keep the sizes of the first step's microbatches, so build new stages and a new "
                "schedule for another batch shape, or pad the batch to the first one's")

    def _named_tensors(self, args: tuple, kwargs: dict[str, Any], target: Any) -> list[tuple[str, torch.Tensor]]:
        """``_named_tensors``, its names worked out once per call structure: a step whose values are all
        pytree leaves (tensors, None, numbers: the usual step) names the tensors by position, as the
        first step of its argument types and keywords named them (32k instructions a check, not 83k,
        on input_ids and labels by name and a target)."""
        key = (tuple(map(type, args)), tuple(kwargs), tuple(map(type, kwargs.values())), type(target),
               len(SUPPORTED_NODES))
        values = (*args, *kwargs.values(), target)
        named = self._named.get(key)
        if named is not None:
            return [(name, values[position]) for position, name in named]
        found = _named_tensors(args, kwargs, target)
        if len(self._named) < _STRUCTURES_KEPT and all(map(tree_is_leaf, values)):
            positions = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]
            if len(positions) == len(found) and all(values[i] is leaf for i, (_, leaf) in zip(positions, found)):
                self._named[key] = [(i, name) for i, (name, _) in zip(positions, found)]
        return found

    def _warn_of_other_rows(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Sharded on the whole batch and stepped in microbatches, a plan's report counted every
        microbatch in flight as the whole batch (2.5x the memory the stages held on a Hugging Face
        walk-through). Said once, at the first step: the plan itself serves any rows."""
        rows = {shape[0] // self.n_microbatches for shape in shapes.values() if shape}
        if not self.chunked_by_rows or len(self.example_rows) != 1 or len(rows) != 1 or rows == self.example_rows:
            return
        (example,), (microbatch,) = self.example_rows, rows
        warnings.warn(
            f"the plan was made on an example of {example} rows and this step's microbatches have {microbatch}: "
            f"plan_report's memory and predict_step count each microbatch as the example, {example / microbatch:.3g}x "
            "these rows; shard on one microbatch (or predict with one: predict_step(sharded, microbatch_inputs)) "
            "for predictions of this step", MicrobatchSizeWarning, stacklevel=user_stacklevel())


#: How many call structures a step guard keeps the names of (a step of yet another is named anew).
_STRUCTURES_KEPT = 16

#: Keyword arguments of ``step`` that are not the model's inputs.
_STEP_OPTIONS = ("losses", "return_outputs", "loss_kwargs")


def _named_tensors(args: tuple, kwargs: dict[str, Any], target: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor ``step`` will split into microbatches, named as the user passed it."""
    found = [(f"argument {i}{keystr(path)}", leaf) for i, arg in enumerate(args)
             for path, leaf in tree_flatten_with_path(arg)[0]]
    found += [(f"{name}{keystr(path)}", leaf) for name, value in kwargs.items()
              for path, leaf in tree_flatten_with_path(value)[0]]
    if target is not None:
        found += [(f"target{keystr(path)}", leaf) for path, leaf in tree_flatten_with_path(target)[0]]
    return [(name, leaf) for name, leaf in found if isinstance(leaf, torch.Tensor)]


class MicrobatchStatisticsWarning(UserWarning):
    """A module in training mode normalises each microbatch by that microbatch's statistics, or a loss
    averages over each microbatch's own labels."""


#: The label cross entropy (and Hugging Face's losses) leave out of their average.
IGNORED_LABEL = -100


def _warn_of_unequal_labels(target: Any, n_microbatches: int) -> None:
    """A loss averaged over a microbatch's labels (cross entropy, ignoring padding marked -100, as Hugging
    Face's are), then over the microbatches, is the whole batch's average only where every microbatch
    holds as many labels: the step's gradients silently differed from the unsplit model's (2.4x on
    GPT-2 with padded rows; half, with a loss of nan, where a microbatch held none). One comparison
    per step, on the rank given the target (or the labels), and only for an integer target holding -100.
    Counted as given and shifted by one (a causal LM scores ``labels[..., 1:]``): warned where both differ."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.dim() == 0:
        return
    labelled = (target != IGNORED_LABEL).reshape(n_microbatches, -1, *target.shape[1:])  # (microbatch, rows, ...)
    counts = labelled.flatten(1).sum(dim=1).tolist()
    shifted = labelled[..., 1:].flatten(1).sum(dim=1).tolist() if target.dim() > 1 else counts
    if len(set(counts)) > 1 and len(set(shifted)) > 1:
        warnings.warn(
            f"the target's {n_microbatches} microbatches hold {', '.join(map(str, counts))} labels other than "
            f"{IGNORED_LABEL} (left out by cross entropy): a loss averaged over each microbatch's labels, then over "
            "the microbatches, is not the whole batch's average, so this step's gradients differ from the unsplit "
            "model's on the whole batch; give every microbatch as many labels, or a loss_fn that sums over its "
            "microbatch and divides by the whole batch's number of labels over n_microbatches",
            MicrobatchStatisticsWarning, stacklevel=user_stacklevel())


def _warn_of_per_microbatch_statistics(stages: Sequence[PipelineStage], n_microbatches: int) -> None:
    """Batch norm in training mode computes its statistics over the batch it sees: in a pipeline
    that is one microbatch, so outputs and gradients differ from the unsplit model's on the whole
    batch (GPipe's known caveat). Legitimate, but worth saying, so warn on the rank that holds one."""
    if n_microbatches <= 1:
        return
    found = [f"stage {stage.stage_index}: {name}" for stage in stages
             for name, module in stage.submod.named_modules()
             if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training]
    if found:
        warnings.warn(
            f"batch norm in training mode ({', '.join(found)}) normalises each of the {n_microbatches} "
            "microbatches by its own statistics, not the whole batch's as the unsplit model does; put "
            "those modules in eval mode before sharding, or use group or layer norm, to match the model",
            MicrobatchStatisticsWarning, stacklevel=user_stacklevel())
