"""In-place writes keep every reader of the written tensor on its side of the write, however the
splitter cuts (``autoshard.lowering.inplace``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.lowering.inplace import written_values
from autoshard.passes import Pipeline
from autoshard.passes.base import ExampleInputs


FX_ONLY = "trace,shape-prop,build-dag,linearize,split,emit,verify"


class WritesAfterReading(nn.Module):
    """``h`` is read by a long branch, then written in place, then read again."""

    def __init__(self, through_a_view: bool = False) -> None:
        super().__init__()
        self.through_a_view = through_a_view
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        if self.through_a_view:
            h.view(-1, 2, 4)[:, 0].mul_(3)
        else:
            h.add_(1)
        return y + self.c(h)


class InPlaceActivation(nn.Module):
    """``nn.ReLU(inplace=True)`` on a value a skip connection reads afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.relu = nn.Linear(8, 8), nn.ReLU(inplace=True)
        self.b = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.relu(h)) + h


class ZeroesByItemAssignment(nn.Module):
    """``h[h < 0] = 0`` after a branch read ``h``: fx records the assignment as ``operator.setitem``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        h[h < 0] = 0
        return y + self.c(h)


class WritesThroughAnIdentity(nn.Module):
    """timm's ResNet: ``act(drop_block(bn(x)))`` with an ``nn.Identity`` drop block and an in-place
    activation, which writes the normalised value through the identity's output (the same tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.act = nn.Linear(8, 8), nn.Identity(), nn.ReLU(inplace=True)
        self.b = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        return y + self.act(self.drop(h))


class ShiftsInPlace(nn.Module):
    """Kept whole (it branches on its input's values) and writes to its input: no op name tells."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > -1e9:  # always, but fake tensors and tracing cannot tell
            h.add_(1)
        return h.abs().sum()


class WritesInsideAModuleKeptWhole(nn.Module):
    """``h`` is read by a long branch, written inside a module kept whole, then read again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.shift = nn.Linear(8, 8), nn.Linear(8, 8), ShiftsInPlace()
        self.b = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        total = self.shift(h)
        return y + self.c(h) + total


class ShiftsItsSecondInputInPlace(nn.Module):
    """``ShiftsInPlace`` writing to its second input, not its first."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > -1e9:  # always, but fake tensors and tracing cannot tell
            h.add_(1)
        return x.abs().sum()


class WritesASecondInputInsideAModuleKeptWhole(nn.Module):
    """``h`` is read by a long branch, written inside a module kept whole that takes it second, then
    read again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.shift = nn.Linear(8, 8), nn.Linear(8, 8), ShiftsItsSecondInputInPlace()
        self.b = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        total = self.shift(x, h)
        return y + self.c(h) + total


@pytest.mark.parametrize("model", [WritesAfterReading(), WritesAfterReading(through_a_view=True),
                                   InPlaceActivation(), ZeroesByItemAssignment(), WritesThroughAnIdentity(),
                                   WritesInsideAModuleKeptWhole(), WritesASecondInputInsideAModuleKeptWhole()],
                         ids=["add_", "through a view", "ReLU(inplace)", "item assignment", "through nn.Identity",
                              "inside a module kept whole", "second input, inside a module kept whole"])
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("cost", ["params", "nodes"])
@pytest.mark.parametrize("pipeline", [None, FX_ONLY], ids=["auto", "fx"])
def test_every_split_gives_the_models_output(model, k, cost, pipeline):
    model.eval()
    sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(2, 8),), cost=cost, pipeline=pipeline)
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x.clone()), model(x.clone()))


def test_readers_before_the_write_precede_it_and_readers_after_follow_it():
    model = WritesAfterReading()
    program = run_pipeline(model, Pipeline.parse("capture,build-dag"), ExampleInputs((torch.randn(2, 8),), {})).program
    dag = program.dag
    assert dag.has_edge("b_0", "add_")  # read h before the write
    assert dag.has_edge("add_", "c")  # reads h after it
    assert written_values(program.traced.graph_module) == {"a", "add_"}


def test_item_assignment_traces_with_fx_and_keeps_nothing_whole():
    sharded = autoshard.shard_model(ZeroesByItemAssignment(), 2, example_inputs=(torch.randn(2, 8),), pipeline=FX_ONLY)
    assert sharded.plan.wrapped == ()


def test_a_write_inside_a_module_kept_whole_orders_its_readers_as_an_in_place_op_does():
    """Shape propagation sees the module move its input's version counter: the readers of ``h`` are
    ordered around it, and verification does not compare ``h`` as recorded after the write."""
    model = WritesInsideAModuleKeptWhole()
    program = run_pipeline(model, Pipeline.parse("capture,shape-prop,build-dag"),
                           ExampleInputs((torch.randn(2, 8),), {})).program
    dag = program.dag
    assert dag.has_edge("b_0", "shift") and dag.has_edge("shift", "c")
    assert written_values(program.traced.graph_module) == {"a", "shift"}


def test_a_write_to_a_second_input_inside_a_module_kept_whole_orders_its_readers_too():
    """Shape propagation watched the first input's version counter only: a write to the second left
    ``h``'s readers unordered around it (a split could read ``h`` after the write) and verification
    compared ``h`` as recorded after the write."""
    model = WritesASecondInputInsideAModuleKeptWhole()
    program = run_pipeline(model, Pipeline.parse("capture,shape-prop,build-dag"),
                           ExampleInputs((torch.randn(2, 8),), {})).program
    dag = program.dag
    assert dag.has_edge("b_0", "shift") and dag.has_edge("shift", "c")
    assert written_values(program.traced.graph_module) == {"a"}
