"""What a capture answers about an input tensor besides its dtype and shape, from the example: its class
(``isinstance(x, nn.Parameter)``), whether it is a leaf (``x.grad_fn is None``), and which inputs are one tensor
(``y is x``). torch.export answers them as the example would, so its plans guard them
(``capture.guard.TensorLayout``, ``InputGuard.same_tensor``): a call they differ on is captured again, or
refused, never served by a plan whose code took the other branch. The copies a capture and its verification
run on keep them too (``isolation.cloned``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.isolation import cloned

EXPORT = "export,shape-prop,build-dag,linearize,split,emit,verify"


class Asks(nn.Module):
    """Branches on what the capture answers from the example."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + y
        if y is x:
            h = h * 2
        if isinstance(x, nn.Parameter):
            h = h + 10
        if x.grad_fn is not None:
            h = h - 3
        return self.b(h)


def _served_or_refused(sharded: nn.Module, model: nn.Module, *call: torch.Tensor) -> None:
    """Served exactly, or refused with one of autoshard's errors: never another branch's answer."""
    try:
        served = sharded(*call)
    except autoshard.AutoshardError:
        return
    assert torch.equal(served, model(*call))


@pytest.mark.parametrize("call", ["same tensor", "parameter", "not a leaf", "leaf requiring grad"])
def test_an_export_plan_serves_inputs_the_example_answered_otherwise(call):
    torch.manual_seed(0)
    model, x, y = Asks(), torch.randn(2, 4), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x, y), pipeline=EXPORT)
    leaf = torch.randn(2, 4, requires_grad=True)
    made = {"same tensor": (x, x), "parameter": (nn.Parameter(torch.randn(2, 4)), y),
            "not a leaf": (leaf * 1, y), "leaf requiring grad": (leaf, y)}[call]
    _served_or_refused(sharded, model, *made)
    assert torch.equal(sharded(x, y), model(x, y))  # and the example's plan still serves the example


def test_a_call_whose_inputs_are_one_tensor_is_captured_for_that():
    """The plan made for ``(x, x)`` answers ``y is x`` as the model does; ``(x, y)`` takes the first plan again."""
    torch.manual_seed(0)
    model, x, y = Asks(), torch.randn(2, 4), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x, y), pipeline=EXPORT)
    with torch.no_grad():
        for call in ((x, x), (x, y), (y, y)):
            assert torch.equal(sharded(*call), model(*call)), call
    assert len(sharded.specializations) == 1


def test_copies_keep_which_tensors_are_one_and_which_are_leaves():
    x = torch.randn(3)
    leaf = torch.randn(3, requires_grad=True)
    computed = leaf * 2
    a, b, c, d = cloned((x, x, leaf, computed))
    assert a is b and a is not x and torch.equal(a, x)
    assert c.requires_grad and c.is_leaf and c is not leaf
    assert d.requires_grad and not d.is_leaf
    d.sum().backward()
    assert leaf.grad is None  # a copy's backward reaches no tensor of the caller's
