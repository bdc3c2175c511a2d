"""``ShardedModel``: the k stages chained, called exactly like the original model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from autoshard.capture.fx import WrappedLeaf


@dataclass(frozen=True)
class StagePlan:
    """What the split decided, kept beside the stages for reports and checks."""

    assignment: dict[str, int]
    boundaries: tuple[tuple[str, ...], ...]
    wrapped: tuple[WrappedLeaf, ...]
    dag: Any

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1

    def stage_nodes(self, stage: int) -> list[str]:
        """The non-input nodes of ``stage`` in program order."""
        return [n for n, s in self.assignment.items() if s == stage and not self.dag.nodes[n].get("input")]

    def modules(self, stage: int) -> list[str]:
        """Owning module paths of the nodes in ``stage``, in program order, without repeats."""
        return list(dict.fromkeys(self.dag.nodes[n]["module"] or "<root>" for n in self.stage_nodes(stage)))

    def param_bytes(self, stage: int) -> int:
        return sum(self.dag.nodes[n]["param_bytes"] for n in self.stage_nodes(stage))


class ShardedModel(nn.Module):
    """An ``nn.Module`` whose forward runs ``stages`` in order.

    ``stages[0]`` takes the model's inputs; every stage but the last returns a tuple of the
    values crossing its boundary, which the next stage takes positionally; the last stage
    returns what the model returns.
    """

    def __init__(self, stages: list[fx.GraphModule], plan: StagePlan) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.plan = plan

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self.stages[0](*args, **kwargs)
        for stage in self.stages[1:]:
            values = stage(*values)
        return values
