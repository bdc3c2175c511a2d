"""What a capture answers about an input tensor besides its dtype and shape without a guard of its own: its
class (``isinstance(x, nn.Parameter)``), whether it is a leaf (``x.grad_fn is None``), and which inputs are one
tensor (``y is x``); torch.export from the example, fx from its proxies (no Parameter, computed, two). The
first stage's binder compares each call's with the example's (``sharded.ExampleTensors``): a call they differ
on is captured again, or refused, never served by a plan whose code took the other branch. The copies a capture
and its verification run on keep them too (``isolation.cloned``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.isolation import cloned

EXPORT = "export,shape-prop,build-dag,linearize,split,emit,verify"
PIPELINES = pytest.mark.parametrize("pipeline", [None, EXPORT], ids=["capture", "export"])


class Tagged(torch.Tensor):
    """A subclass the model's code tells apart."""


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
        if isinstance(x, Tagged):
            h = h - 1
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


@PIPELINES
@pytest.mark.parametrize("call", ["same tensor", "parameter", "subclass", "not a leaf", "leaf requiring grad"])
def test_a_plan_serves_inputs_the_example_answered_otherwise_or_refuses_them(call, pipeline):
    torch.manual_seed(0)
    model, x, y = Asks(), torch.randn(2, 4), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x, y), pipeline=pipeline)
    leaf = torch.randn(2, 4, requires_grad=True)
    made = {"same tensor": (x, x), "parameter": (nn.Parameter(torch.randn(2, 4)), y),
            "subclass": (torch.randn(2, 4).as_subclass(Tagged), y), "not a leaf": (leaf * 1, y),
            "leaf requiring grad": (leaf, y)}[call]
    _served_or_refused(sharded, model, *made)
    assert torch.equal(sharded(x, y), model(x, y))  # and the example's plan still serves the example


@PIPELINES
def test_calls_whose_inputs_are_one_tensor_or_a_parameter_are_captured_for_that(pipeline):
    """The plan made for ``(x, x)`` answers ``y is x`` as the model does, that for a Parameter ``isinstance``;
    ``(x, y)`` takes the first plan again."""
    torch.manual_seed(0)
    model, x, y = Asks(), torch.randn(2, 4), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x, y), pipeline=pipeline)
    p = nn.Parameter(torch.randn(2, 4))
    with torch.no_grad():
        for call in ((x, x), (x, y), (y, y), (p, y), (x, y)):
            assert torch.equal(sharded(*call), model(*call)), call
    assert len(sharded.specializations) == 2


@pytest.mark.parametrize("call", ["same tensor", "parameter", "subclass", "leaf", "leaf requiring grad"])
def test_a_plan_made_without_example_inputs_refuses_inputs_unlike_its_proxies(call):
    """fx's proxies answered the code: two tensors, no Parameter, computed by autograd (a grad_fn). A call
    unlike that was served with their branch (13.7 off for a Parameter) before the binder compared them."""
    torch.manual_seed(0)
    model = Asks()
    sharded = autoshard.shard_model(model, 2)
    x, y, leaf = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    made = {"same tensor": (x * leaf, ) * 2, "parameter": (nn.Parameter(torch.randn(2, 4)), y),
            "subclass": ((x * leaf).as_subclass(Tagged), y), "leaf": (x, y), "leaf requiring grad": (leaf, y)}[call]
    with pytest.raises(autoshard.InputMismatchError, match="made without example inputs"):
        sharded(*made)
    computed = (x * leaf, y)
    assert torch.equal(sharded(*computed), model(*computed))  # as the proxies were: served


def test_a_refusal_for_a_tensor_unlike_the_examples_says_what_differs():
    torch.manual_seed(0)
    model, x, y = Asks(), torch.randn(2, 4), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x, y), respecialize=False)
    with pytest.raises(autoshard.InputMismatchError, match="x is a Tagged, but the plan was captured with a tensor"):
        sharded(torch.randn(2, 4).as_subclass(Tagged), y)
    with pytest.raises(autoshard.InputMismatchError, match="one tensor are x and y, but none were"):
        sharded(x, x)


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


class AsksTheLayout(nn.Module):
    """Branches on an input's strides and storage offset, which torch.export answers from the example."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.stride(-1) != 1:
            h = h - 3
        if x.storage_offset() != 0:
            h = h + 1
        return self.b(h)


def test_strides_the_models_code_asks_are_captured_for_and_an_offset_it_asks_is_refused():
    """Contiguity alone was compared: a column slice (strides (8, 1)) took the plan made for a transposed input
    (strides (1, 4)), and a row slice (offset 4) the plan made for offset 0, each with the other branch."""
    torch.manual_seed(0)
    model = AsksTheLayout().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 4),), pipeline=EXPORT)
    with torch.no_grad():
        for x in (torch.randn(4, 2).t(), torch.randn(2, 8)[:, :4], torch.randn(1, 4).expand(2, 4), torch.randn(2, 4)):
            assert torch.equal(sharded(x), model(x)), x.stride()
        with pytest.raises(autoshard.InputMismatchError, match=r"x.storage_offset\(\).*pass x.clone\(\)"):
            sharded(torch.randn(3, 4)[1:])
    assert "strides (8, 1)" in sharded.specializations[1].sharded.served_inputs()


@PIPELINES
def test_an_input_computed_by_autograd_is_served_where_the_code_never_asks(pipeline):
    """Embeddings computed outside the model (prompt tuning) are not leaves; a plan whose code never asked
    ``x.grad_fn`` serves them as it is, even one that cannot capture again (a review: refused)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    example = torch.randn(2, 4, requires_grad=True)  # (a leaf: torch.export's plans compare requires_grad)
    sharded = autoshard.shard_model(model, 2, (example,), pipeline=pipeline, respecialize=False)
    prompt = torch.randn(2, 4, requires_grad=True)
    embedded = prompt * 2
    sharded(embedded).sum().backward()
    expected = torch.autograd.grad(model(prompt * 2).sum(), prompt)[0]
    assert torch.equal(prompt.grad, expected)


class AsksOfADict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, d: dict) -> torch.Tensor:
        h = self.a(d["p"]) + d["q"]
        if d["p"] is d["q"]:
            h = h * 2
        return self.b(h)


def test_a_dict_whose_example_held_one_tensor_twice_is_compared_item_by_item():
    """The copies the capture ran on keep ``{"p": x, "q": x}`` one tensor: a later ``{"p": x, "q": y}`` took
    that plan's branch (a review: off by 0.69), and now another capture."""
    torch.manual_seed(0)
    model, x, y = AsksOfADict(), torch.randn(2, 4), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, ({"p": x, "q": x},))
    with torch.no_grad():
        for call in ({"p": x, "q": y}, {"p": y, "q": y}, {"p": x, "q": y}):
            assert torch.equal(sharded(call), model(call))
    assert len(sharded.specializations) == 1
