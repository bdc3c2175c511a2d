"""``parallelize``: a plan's stages pipelined over one mesh dimension, data-parallel over another.

The composition torchtitan and DeepSpeed use at scale, on PyTorch's own pieces: ranks along the
``pp`` dimension of a ``DeviceMesh`` run the pipeline (``pipeline_stage``, ``build_schedule``);
ranks along ``dp`` run copies of it on their own rows of the batch, their weights sharded by FSDP2
(``fully_shard``, per block where a stage holds whole blocks) or replicated (``replicate``, FSDP2's
data-parallel twin, whose gradient sync ``torch.distributed.pipelining`` holds back until the last
microbatch as it does FSDP's). Data parallelism is applied to each stage's copy after
``pipeline_stage`` made it: FSDP modules cannot be deep-copied.

``Parallelized.memory_model`` is the plan's training-memory model for the layout built (FSDP's
1/dp shards and unsharded copies, mixed precision, recomputed blocks): ``plan_report(sharded,
memory=parallel.memory_model)`` predicts each rank's memory, and a plan made with that model and
``max_memory`` keeps its budgets under ``parallelize`` (``costs.memory`` says what it counts).

Every argument is checked first, identically on every rank and before any collective, so a bad
launch raises everywhere instead of leaving ranks waiting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage

from autoshard.arguments import whole_number
from autoshard.costs.memory_model import SCHEDULES as MODELLED_SCHEDULES
from autoshard.costs.memory_model import MemoryModel
from autoshard.emit import HELD_STATE
from autoshard.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PipelineSetupError,
    WorldSizeError,
    suggest,
)
from autoshard.isolation import each_tensor_once
from autoshard.runtime.blocks import whole_blocks
from autoshard.runtime.recompute import checkpoint_blocks
from autoshard.runtime.schedule import (
    SCHEDULES,
    ScheduleLike,
    build_schedule,
    check_world_size,
    local_stage_indices,
    schedule_class,
)
from autoshard.runtime.stage import pipeline_stage
from autoshard.runtime.ties import TiedGradients
from autoshard.sharded import ShardedModel

#: The kinds of data parallelism ``parallelize`` applies to each stage.
DATA_PARALLEL = ("fsdp", "ddp")
MixedPrecision = Union[torch.dtype, MixedPrecisionPolicy, None]


@dataclass
class Parallelized:
    """What ``parallelize`` built on this rank.

    Step ``schedule`` as any ``torch.distributed.pipelining`` schedule, with this rank's rows of
    the batch (``local_rows``): the inputs where ``is_first``, the target where ``is_last``. Then
    ``sync_gradients()`` (weights several stages share) and the optimizer step, over
    ``parameters()``.
    """

    schedule: Any
    """The schedule over this rank's stages (``build_schedule``)."""
    stages: list[PipelineStage]
    """This rank's stages; ``stage.submod`` holds the model's modules under the model's names."""
    mesh: DeviceMesh
    ties: TiedGradients
    """Sums the gradients of weights held by several stages (an LM head tied to the embedding)."""
    data_parallel: str | None
    dp_rank: int
    dp_size: int
    recomputed: dict[int, list[str]]
    """Per local stage, the blocks whose activations are recomputed in backward."""
    sharded_blocks: dict[int, list[str]]
    """Per local stage, the blocks FSDP shards as units of their own (the rest: one unit per stage)."""
    memory_model: MemoryModel | None
    """The plan's memory model for this layout: ``plan_report(sharded, memory=...)`` gives per
    stage what a rank holding it keeps (``layout_memory_model``); None under a schedule the model
    does not count (interleaved zero bubble)."""

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def local_rows(self, batch: Any) -> Any:
        """This data-parallel rank's rows of ``batch`` (a tensor, or a tuple, list or dict of them):
        its ``dp_rank``-th of ``dp_size`` equal parts along the first dimension. A tensor found twice
        (``labels=ids``) gives one part, found twice: the plan compares which inputs are one tensor."""
        return each_tensor_once(self._rows, batch)

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[0] % self.dp_size:
            raise InvalidArgumentError(
                f"a batch of {batch.shape[0]} rows does not split into {self.dp_size} equal data-parallel "
                f"parts; give a multiple of {self.dp_size} rows (of {self.dp_size} x microbatches, for the "
                "pipeline)")
        return batch.chunk(self.dp_size)[self.dp_rank]

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stages once (the optimizer's)."""
        seen: set[int] = set()
        for stage in self.stages:
            for parameter in stage.submod.parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield parameter

    def sync_gradients(self) -> None:
        """Sum the gradients of shared weights over the pipeline (``TiedGradients.sync``); once per
        optimizer step, after the step's last ``schedule.step``, on every rank."""
        self.ties.sync()


def _mesh_layout(mesh: Any, pp: str, dp: str) -> tuple[int, int, str | None]:
    """``(pp size, dp size, dp name or None)`` of ``mesh``, refusing names it lacks or leaves unused."""
    if not isinstance(mesh, DeviceMesh):
        raise InvalidArgumentTypeError(
            f"parallelize needs a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; make one "
            f"with init_device_mesh(device_type, (pp, dp), mesh_dim_names=({pp!r}, {dp!r}))")
    names = tuple(mesh.mesh_dim_names or ())
    if pp not in names:
        raise InvalidArgumentError(
            f"the mesh has no dimension named {pp!r}{suggest(pp, names)} (its dimensions: "
            f"{', '.join(map(repr, names)) or 'unnamed'}); name the pipeline dimension with pp=..., or build the "
            f"mesh with mesh_dim_names=({pp!r}, {dp!r})")
    unused = [name for name in names if name not in (pp, dp)]
    if unused:
        raise InvalidArgumentError(
            f"the mesh's dimension{'s' if len(unused) > 1 else ''} {', '.join(map(repr, unused))} "
            f"{'are' if len(unused) > 1 else 'is'} neither the pipeline's ({pp!r}) nor the data-parallel one "
            f"({dp!r}), so its ranks would train apart; pass dp={unused[0]!r} or build the mesh with only "
            f"{pp!r} and {dp!r}")
    shape = dict(zip(names, mesh.shape))
    return shape[pp], shape.get(dp, 1), dp if dp in names else None


def _mixed_precision(value: Any, data_parallel: str | None, dp_name: str | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``mixed_precision``: a compute dtype (reductions in float32) or a policy."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise InvalidArgumentError(f"mixed_precision must be a floating dtype (torch.bfloat16), got {value}")
        value = MixedPrecisionPolicy(param_dtype=value, reduce_dtype=torch.float32)
    if not isinstance(value, MixedPrecisionPolicy):
        raise InvalidArgumentTypeError(
            f"mixed_precision must be a dtype (torch.bfloat16: compute in it, reduce in float32) or an FSDP2 "
            f"MixedPrecisionPolicy, got {type(value).__name__}")
    if data_parallel is None or dp_name is None:
        raise InvalidArgumentError(
            "mixed_precision is applied by FSDP2 (its MixedPrecisionPolicy), so it needs data_parallel='fsdp' or "
            "'ddp' and a data-parallel mesh dimension (of size 1 if need be: init_device_mesh(..., (pp, 1)))")
    return value


def _check_world(mesh: DeviceMesh) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise PipelineSetupError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "(torchrun sets the environment it needs) and build the mesh before parallelize")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise WorldSizeError(
            f"the mesh {tuple(mesh.shape)} holds {mesh.size()} ranks but the job has {world} processes; build the "
            f"mesh over all of them (pp x dp = {world}) or launch {mesh.size()} processes")


def _stage_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _check_compute_dtype(sharded: ShardedModel, policy: MixedPrecisionPolicy | None) -> None:
    """Refuse mixed precision for a plan whose code pins a floating dtype (``x.to(torch.float32)``,
    as captured): the stages would mix it with weights in the compute dtype. Every stage is
    checked, on every rank alike."""
    dtype = None if policy is None else policy.param_dtype
    if dtype is None:
        return
    pinned: set[str] = set()

    def note(value: Any) -> Any:
        if isinstance(value, torch.dtype) and value.is_floating_point and value != dtype:
            pinned.add(str(value))
        return value

    for stage in sharded.stages:
        for node in stage.graph.nodes:
            fx.node.map_aggregate((node.args, node.kwargs), note)
    if pinned:
        raise InvalidArgumentError(
            f"the model's code converts values to {', '.join(sorted(pinned))} (as captured), so its stages cannot "
            f"compute in {dtype} under mixed precision; convert the model to {dtype} before sharding it and train "
            "without mixed_precision, or train in the model's dtype")


def _compute_in(module: fx.GraphModule, dtype: torch.dtype | None) -> None:
    """Let ``module``'s held-state guard see its weights in ``dtype``, which FSDP2 swaps in for each
    call. The guard refuses weights converted after capture because the capture may have answered
    the code's questions about their dtype; ``_check_compute_dtype`` refused the plans whose graph
    holds such an answer."""
    if dtype is not None:
        state = getattr(module, HELD_STATE)
        state.dtypes = state.dtypes | {dtype}


def _apply_data_parallel(stage: PipelineStage, blocks: dict[str, list[nn.Module]], kind: str,
                         dp_mesh: DeviceMesh, policy: MixedPrecisionPolicy | None) -> None:
    """FSDP2 on the whole blocks, then on the stage (its remaining weights), or replication.

    A unit's weights stay gathered after its forward (``reshard_after_forward=False``, torchtitan's
    choice under pipelining): the pipeline keeps them gathered from the first backward to the step's
    end anyway, and regathering them for each microbatch's forward would only add collectives."""
    options: dict[str, Any] = {"mesh": dp_mesh}
    if policy is not None:
        options["mp_policy"] = policy
    if kind == "ddp":
        replicate(stage.submod, **options)
        return
    for leaves in blocks.values():
        fully_shard(leaves, reshard_after_forward=False, **options)
    fully_shard(stage.submod, reshard_after_forward=False, **options)


def layout_memory_model(
    base: MemoryModel, *, data_parallel: str | None, dp: int, mixed_precision: MixedPrecisionPolicy | None,
    activation_checkpointing: bool, schedule: ScheduleLike, microbatches: int, stages_per_rank: int,
) -> MemoryModel | None:
    """``base`` (the plan's optimizer and master weights) for a layout ``parallelize`` runs: its
    data parallelism, compute dtype, recomputation, schedule and microbatches. Looped BFS runs every
    forward before any backward, as GPipe does, so it is counted as GPipe; for a schedule the model
    does not count (zero bubble) there is none (None), rather than another schedule's count. Only
    interleaved 1F1B's count depends on ``stages_per_rank``; the model refuses it for another schedule."""
    cls = schedule_class(schedule)
    name = next((name for name, known in SCHEDULES.items() if known is cls), "")
    name = "gpipe" if name == "looped-bfs" else name
    if name not in MODELLED_SCHEDULES:
        return None
    dtype = None if mixed_precision is None or mixed_precision.param_dtype is None else mixed_precision.param_dtype
    return dataclasses.replace(
        base, data_parallel=data_parallel, dp=dp if data_parallel else 1,
        mixed_precision=str(dtype) if dtype is not None and dtype.itemsize < 4 else None,
        activation_checkpointing=activation_checkpointing, microbatches=microbatches,
        schedule=name, stages_per_rank=stages_per_rank if name == "interleaved-1f1b" else None)


def parallelize(
    sharded: ShardedModel,
    mesh: DeviceMesh,
    *,
    pp: str = "pp",
    dp: str = "dp",
    data_parallel: str | None = "fsdp",
    schedule: ScheduleLike = "1f1b",
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    mixed_precision: MixedPrecision = None,
    activation_checkpointing: bool = False,
) -> Parallelized:
    """This rank's part of ``sharded`` pipelined over ``mesh[pp]`` and data-parallel over ``mesh[dp]``.

    Rank ``r`` along ``pp`` runs stages ``r, r + pp_size, ...`` (``local_stage_indices``), so an
    interleaved schedule runs several per rank. ``data_parallel`` is ``"fsdp"`` (weights,
    gradients and optimizer state sharded over ``dp``), ``"ddp"`` (replicated, gradients averaged)
    or None; a mesh without a ``dp`` dimension is plain pipelining. ``mixed_precision`` (a dtype:
    compute in it, reduce gradients in float32; or an FSDP2 ``MixedPrecisionPolicy``) needs a data
    parallel kind. ``activation_checkpointing`` recomputes each block's activations in backward.
    A collective: call it on every rank with the same arguments.
    """
    if not isinstance(sharded, ShardedModel):
        raise InvalidArgumentTypeError(
            f"parallelize needs the ShardedModel that shard_model returned, got {type(sharded).__name__}")
    pp_size, dp_size, dp_name = _mesh_layout(mesh, pp, dp)
    if data_parallel is not None and data_parallel not in DATA_PARALLEL:
        raise InvalidArgumentError(
            f"unknown data_parallel {data_parallel!r}{suggest(str(data_parallel), DATA_PARALLEL)}; use 'fsdp' "
            "(sharded weights), 'ddp' (replicated weights) or None (pipelining alone)")
    if data_parallel is None and dp_size > 1:
        raise InvalidArgumentError(
            f"the mesh's {dp!r} dimension has {dp_size} ranks but data_parallel is None, so those copies of the "
            f"pipeline would train apart; pass data_parallel='fsdp' or 'ddp', or a mesh without {dp!r}")
    microbatches = whole_number(microbatches, "microbatches", at_least=1)
    policy = _mixed_precision(mixed_precision, data_parallel, dp_name)
    _check_compute_dtype(sharded, policy)
    if not isinstance(activation_checkpointing, bool):
        raise InvalidArgumentTypeError(
            f"activation_checkpointing must be True or False, got {activation_checkpointing!r}")
    _check_world(mesh)
    num_stages = sharded.num_stages
    try:
        check_world_size(num_stages, pp_size, schedule)
    except WorldSizeError as exc:
        raise WorldSizeError(f"the mesh's {pp!r} dimension has {pp_size} ranks: {exc}") from None

    pp_rank = mesh.get_local_rank(pp)
    dp_rank = mesh.get_local_rank(dp_name) if dp_name is not None else 0
    device = _stage_device(mesh)
    group = mesh.get_group(pp)
    stages = [pipeline_stage(sharded, index, num_stages, device, group=group)
              for index in local_stage_indices(num_stages, pp_rank, pp_size)]
    recomputed: dict[int, list[str]] = {}
    sharded_blocks: dict[int, list[str]] = {}
    for stage in stages:
        blocks = whole_blocks(sharded, stage.stage_index, stage.submod) if data_parallel == "fsdp" else {}
        if activation_checkpointing:
            recomputed[stage.stage_index] = checkpoint_blocks(stage.submod)
        if data_parallel is not None and dp_name is not None:
            _apply_data_parallel(stage, blocks, data_parallel, mesh[dp_name], policy)
            sharded_blocks[stage.stage_index] = list(blocks) if data_parallel == "fsdp" else []
            _compute_in(stage.submod, policy.param_dtype if policy is not None else None)
    built = build_schedule(stages, schedule, microbatches, loss_fn=loss_fn)
    kind = data_parallel if dp_name else None
    memory = layout_memory_model(
        sharded.plan.memory_model, data_parallel=kind, dp=dp_size, mixed_precision=policy,
        activation_checkpointing=activation_checkpointing, schedule=schedule, microbatches=microbatches,
        stages_per_rank=max(1, num_stages // pp_size))
    return Parallelized(built, stages, mesh, TiedGradients(sharded, stages), kind, dp_rank, dp_size, recomputed,
                        sharded_blocks, memory)
