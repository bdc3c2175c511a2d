"""Sum the gradients of parameters that several stages hold (a tied LM head and embedding).

Each stage computes only its own part of such a parameter's gradient; the unsplit model's
gradient is their sum. ``sync`` adds the parts of every stage on this rank, then all-reduces the
sums over the pipeline group in one flat buffer per dtype, so every holder ends the step with the
full gradient and, after identical optimizer steps, identical weights. Every rank takes part,
with zeros for ties it does not hold: the group needs no sub-groups, whose creation would have
to be repeated in the same order by every process of the job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from autoshard.errors import InvalidArgumentTypeError, PipelineSetupError
from autoshard.runtime.rebuild import shared_across_stages, stage_tensors
from autoshard.sharded import ShardedModel


@dataclass(frozen=True)
class SharedParameter:
    """One parameter several stages hold: ``(stage, name in that stage)`` for each holder."""

    holders: tuple[tuple[int, str], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({stage for stage, _ in self.holders}))


def shared_parameters(sharded: ShardedModel) -> tuple[SharedParameter, ...]:
    """Parameters (requiring grad) held by more than one stage, ordered by their first holder."""
    tensors = {id(t): t for stage in sharded.stages for t in stage_tensors(stage).values()}
    found = [
        SharedParameter(tuple(holders), tuple(tensors[key].shape), tensors[key].dtype)
        for key, holders in shared_across_stages(sharded).items()
        if isinstance(tensors[key], torch.nn.Parameter) and tensors[key].requires_grad
    ]
    return tuple(sorted(found, key=lambda shared: shared.holders))


class TiedGradients:
    """Makes every holder of a shared parameter see the gradient of the whole model.

    Build it on every rank of the pipeline group with that rank's stages; call ``sync()`` once per
    optimizer step, after the last ``schedule.step`` of a gradient accumulation and before
    ``optimizer.step``: it writes the sum into every holder, so a second call would count it again.
    """

    def __init__(self, sharded: ShardedModel, stages: Sequence[PipelineStage],
                 group: dist.ProcessGroup | None = None) -> None:
        if not stages or not all(isinstance(stage, PipelineStage) for stage in stages):
            raise InvalidArgumentTypeError("TiedGradients needs the PipelineStage(s) this rank runs")
        self.group = stages[0].group if group is None else group  # the pipeline's, as build_schedule's
        self.shared = shared_parameters(sharded)
        self._local = {stage.stage_index: stage.submod for stage in stages}
        self._device = stages[0].device
        world = dist.get_world_size(self.group)
        self._across_ranks = [s for s in self.shared if len({i % world for i in s.stages}) > 1]
        self._shapes: dict[int, tuple[int, ...]] | None = None

    def _local_holders(self, shared: SharedParameter) -> list[torch.nn.Parameter]:
        held = (self._local[s].get_parameter(n) for s, n in shared.holders if s in self._local)
        return list({id(p): p for p in held}.values())

    def _local_shapes(self) -> dict[int, tuple[int, ...]]:
        """The shape of the local part of each shared parameter this rank sums (``self.shared``
        by index): its own for one held here, a peer's for one crossing ranks that only others hold
        (exchanged on the first call: a collective, made alike by every rank of the group)."""
        mine = {i: tuple(_local(p).shape) for i, s in enumerate(self.shared) for p in self._local_holders(s)[:1]}
        if self._shapes is None:
            across = [i for i, s in enumerate(self.shared) if s in self._across_ranks]
            gathered: list[dict[int, tuple[int, ...]]] = [mine]
            if across:
                gathered = [{}] * dist.get_world_size(self.group)
                dist.all_gather_object(gathered, {i: mine[i] for i in across if i in mine}, group=self.group)
            self._shapes = {}
            for i in across:
                seen = {shapes[i] for shapes in gathered if i in shapes}
                if len(seen) != 1:
                    raise PipelineSetupError(
                        f"the holders of '{self.shared[i].holders[0][1]}' hold parts of shapes {sorted(seen)} on the "
                        "ranks of one pipeline; shard (or replicate) every holder over the same data-parallel mesh")
                self._shapes[i] = seen.pop()
        return {**self._shapes, **mine}

    def _local_sum(self, shared: SharedParameter, total: torch.Tensor) -> torch.Tensor:
        """The local holders' gradients added into ``total`` (zeros)."""
        for param in self._local_holders(shared):
            if param.grad is not None:
                total += _local(param.grad).to(total.device)
        return total

    def _write(self, shared: SharedParameter, total: torch.Tensor) -> None:
        """``total`` into every local holder's gradient: in place where it has one (FSDP's gradients
        are views of one buffer per unit; a new tensor would leave their old part held there)."""
        for param in self._local_holders(shared):
            if param.grad is not None:
                _local(param.grad).copy_(total)
                continue
            part = total.to(_local(param).device, copy=True)
            param.grad = DTensor.from_local(part, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride()) \
                if isinstance(param, DTensor) else part

    def sync(self) -> None:
        """Give every holder the summed gradient; a collective over the pipeline group."""
        shapes = self._local_shapes()
        totals: dict[int, torch.Tensor] = {}
        across = {i: (s.dtype, shapes[i]) for i, s in enumerate(self.shared) if s in self._across_ranks}
        for flat, parts in summing_buffers(across, self._device):  # summed in place: no sum and copy
            for i, part in parts.items():
                totals[i] = self._local_sum(self.shared[i], part)
            dist.all_reduce(flat, group=self.group)
        for i, s in enumerate(self.shared):
            if i in shapes:
                total = totals.get(i)
                if total is None:  # held on this rank alone
                    total = self._local_sum(s, torch.zeros(shapes[i], dtype=s.dtype, device=self._device))
                self._write(s, total)


def summing_buffers(parts: Mapping[int, tuple[torch.dtype, tuple[int, ...]]],
                    device: torch.device) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """One zeros buffer a dtype holding every part (by index: its dtype and shape), with a view of
    each: one all-reduce a dtype. ``measure_stage_memory`` makes the same to count it."""
    out = []
    for dtype in dict.fromkeys(dtype for dtype, _ in parts.values()):
        batch = [i for i, (d, _) in parts.items() if d == dtype]
        sizes = [math.prod(parts[i][1]) for i in batch]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        out.append((flat, {i: part.view(parts[i][1]) for i, part in zip(batch, flat.split(sizes))}))
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard if it is a ``DTensor``, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
