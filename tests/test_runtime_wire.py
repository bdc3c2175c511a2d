"""A tuple crossing a stage boundary is sent as the tensors later stages take out of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autoshard.api import run_pipeline
from autoshard.errors import BoundaryValueError
from autoshard.graph import Partition
from autoshard.passes import Pipeline
from autoshard.passes.base import ExampleInputs, PassContext
from autoshard.passes.emit import EmitPass
from autoshard.runtime.boundaries import boundary_wires
from autoshard.runtime.stage import stage_module
from autoshard.runtime.wire import Wire


class Halves(nn.Module):
    """``x.chunk(2)`` makes a tuple; its second half is only read at the very end."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.late = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = x.chunk(2, dim=1)
        return self.second(self.first(halves[0])) + self.late(halves[1])


class WholeTuple(Halves):
    """The same tuple, but the last stage uses it whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = x.chunk(2, dim=1)
        return self.second(self.first(halves[0])) + torch.cat(halves, dim=1).sum()


def sharded_with_cut_after(model: nn.Module, x: torch.Tensor, last_of_stage_0: str):
    """The plan that cuts right after node ``last_of_stage_0``, whatever the splitter would do."""
    planning = Pipeline.parse("trace,shape-prop,build-dag")
    program = run_pipeline(model, planning, ExampleInputs((x,), {})).program
    order = list(program.dag.nodes)
    cut = order.index(last_of_stage_0) + 1
    assignment = {node: int(position >= cut) for position, node in enumerate(order)}
    partition = Partition.from_assignment(program.dag, assignment, 2)
    return EmitPass().run(dataclasses.replace(program, partition=partition), PassContext()).sharded


def test_a_tuple_read_by_item_crosses_as_its_items():
    torch.manual_seed(0)
    model, x = Halves(), torch.randn(3, 8)
    sharded = sharded_with_cut_after(model, x, "first")
    crossing = sharded.plan.boundaries[0]
    assert "chunk" in crossing and "getitem_1" not in crossing  # the tuple itself crosses
    wires = boundary_wires(sharded)[0]
    assert Wire("chunk", 1) in wires and Wire("chunk") not in wires
    first, last = (stage_module(sharded, i, torch.device("cpu")) for i in range(2))
    sent = first(x)
    assert all(isinstance(value, torch.Tensor) and value.is_contiguous() for value in sent)
    with torch.no_grad():
        torch.testing.assert_close(last(*sent), model(x), rtol=0, atol=0)


def test_a_tuple_used_whole_is_refused():
    torch.manual_seed(0)
    sharded = sharded_with_cut_after(WholeTuple(), torch.randn(3, 8), "first")
    with pytest.raises(BoundaryValueError, match=r"'chunk' \(tuple"):
        boundary_wires(sharded)
