"""Stages must back-propagate as the model does, not only compute the same forward values:
verification compares forward values, so each of these would pass it and train wrongly."""

from __future__ import annotations

import pytest
import torch
from conftest import DoublesWhen, Framed
from torch import nn

import autoshard
from autoshard.capture import trace_with_leaves
from autoshard.errors import InputMismatchError, TraceError


def gradients(run, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient after ``run(x).sum().backward()``, from zero."""
    model.zero_grad(set_to_none=True)
    out = run(x)
    (out if isinstance(out, torch.Tensor) else sum(o.sum() for o in out)).sum().backward()
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def assert_same_gradients(sharded, model: nn.Module, x: torch.Tensor) -> None:
    got, expected = gradients(sharded, model, x), gradients(model, model, x)
    assert got.keys() == expected.keys()
    for name in expected:
        if expected[name] is None:
            assert got[name] is None, f"{name} gets a gradient the model does not give it"
        else:
            assert got[name] is not None and torch.equal(got[name], expected[name]), name


class FrozenBranch(nn.Module):
    """A teacher branch under ``torch.no_grad()``: fx does not record the block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.target, self.mid, self.out = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.no_grad():
            t = self.target(h)
        return self.out(self.mid(h) + t)


def test_a_no_grad_block_is_kept_whole_so_no_gradient_flows_through_it():
    torch.manual_seed(0)
    model = Framed(FrozenBranch())
    result = trace_with_leaves(model, (torch.randn(2, 8),))
    assert [w.name for w in result.wrapped] == ["inner"] and "grad-mode block" in result.wrapped[0].reason
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),))
    assert_same_gradients(sharded, model, torch.randn(5, 8))


def test_a_no_grad_block_in_the_top_level_forward_keeps_its_gradients_even_when_sharded_under_no_grad():
    torch.manual_seed(0)
    model = FrozenBranch()
    with torch.no_grad():  # the capture itself runs the trace with grad enabled, so the block is seen
        sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    x = torch.randn(5, 8)
    assert torch.equal(sharded(x), model(x))
    assert_same_gradients(sharded, model, x)
    assert gradients(sharded, model, x)["target.weight"] is None


class GradReverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): identity forward, negated backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.scale * grad, None


class DomainAdversarial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features, self.classes, self.domain = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.relu(self.features(x))
        return self.classes(f), self.domain(GradReverse.apply(f, 0.7))


def test_a_custom_autograd_function_is_one_node_and_keeps_its_backward():
    torch.manual_seed(0)
    model = DomainAdversarial()
    result = trace_with_leaves(model, (torch.randn(2, 8),))
    assert result.wrapped == ()
    calls = [n for n in result.graph_module.graph.nodes if n.op == "call_function" and "GradReverse" in repr(n.target)]
    assert len(calls) == 1  # not the view_as its forward computes
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert_same_gradients(sharded, model, torch.randn(5, 8))
    assert torch.autograd.Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # patch undone


def test_torchs_own_autograd_functions_are_still_traced_through():
    """The reentrant checkpoint is an autograd.Function taking a function argument: recorded
    as one node it could not be emitted, and its backward only recomputes the forward."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.out = inner, nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True))

    model = Checkpointed()
    result = trace_with_leaves(model, (torch.randn(2, 8, requires_grad=True),))
    assert result.wrapped == ()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8, requires_grad=True),))
    assert_same_gradients(sharded, model, torch.randn(5, 8, requires_grad=True))


def test_a_module_with_a_backward_hook_stays_a_leaf_so_the_hook_runs():
    torch.manual_seed(0)
    model = Framed(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model.inner.register_full_backward_hook(lambda module, grad_in, grad_out: tuple(g * 0.5 for g in grad_in))
    result = trace_with_leaves(model, (torch.randn(2, 8),))
    assert [n.target for n in result.graph_module.graph.nodes if n.op == "call_module"] == ["pre", "inner", "post"]
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert_same_gradients(sharded, model, torch.randn(5, 8))


EXPORT = "export,shape-prop,build-dag,linearize,split,emit,verify"


class Reversing(nn.Module):
    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return GradReverse.apply(f, 0.7)


def test_export_keeps_a_custom_autograd_function_whole_so_its_backward_runs():
    """export records a Function's forward and drops its backward: the reversal was lost."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Reversing(), nn.Linear(8, 8), nn.Linear(8, 2))
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=EXPORT)
    assert [(w.name, "own backward" in w.reason) for w in sharded.plan.wrapped] == [("1", True)]
    assert_same_gradients(sharded, model, torch.randn(5, 8))
    assert torch.autograd.Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # patch undone


@pytest.mark.parametrize("compiled", [False, True])
def test_export_keeps_a_module_with_a_backward_hook_whole_so_the_hook_runs(compiled):
    """export dropped the hook: the gradients were the unhooked model's. Compiled in place
    (``module.compile()``), its call skipped the stand-in, and export traced through it again."""
    torch.manual_seed(0)
    model = Framed(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model.inner.register_full_backward_hook(lambda module, grad_in, grad_out: tuple(g * 0.5 for g in grad_in))
    if compiled:
        model.inner.compile(backend="eager")
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=EXPORT)
    assert_same_gradients(sharded, model, torch.randn(5, 8))


@pytest.mark.parametrize("front_end", ["capture", "export"])
@pytest.mark.parametrize("register", [
    lambda model: model.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0,)),
    lambda model: model.register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 5,)),
])
def test_a_backward_hook_on_the_model_itself_is_refused_saying_where_it_can_go(front_end, register):
    """No stage is the model, so both front ends dropped the hook: the inputs' gradients (and, with a
    pre-hook scaling the output's gradient, the weights') were the unhooked model's."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pipeline = f"{front_end},shape-prop,build-dag,linearize,split,emit,verify"
    register(model)
    with pytest.raises(TraceError, match="backward hook of its own.*register it on a submodule"):
        autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=pipeline)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    sharded = autoshard.shard_model(plain, 2, example_inputs=(torch.randn(2, 8),), pipeline=pipeline)
    register(plain)  # after sharding: the call captures again, and is refused so
    with pytest.raises(InputMismatchError, match="backward hook of its own"):
        sharded(torch.randn(2, 8))


class HalfPrecisionRegion(nn.Module):
    """A weight used twice inside an autocast region: eager autocast casts it once (its cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.mid(h)) @ self.mid.weight
        return self.out(h.float())


def test_an_autocast_region_captured_by_export_keeps_the_autocast_cache():
    torch.manual_seed(0)
    model = HalfPrecisionRegion()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(3, 8),))
    assert_same_gradients(sharded, model, torch.randn(5, 8))


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_code_reading_the_grad_mode_serves_the_mode_it_was_sharded_in_and_refuses_the_other(front_end):
    torch.manual_seed(0)
    model, x = DoublesWhen("is_grad_enabled"), torch.randn(3, 4)
    pipeline = f"{front_end},shape-prop,build-dag,linearize,split,emit,verify"
    # respecialize=False: a sharded model that re-specialises serves the other mode by capturing again
    with_grad = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 4),), pipeline=pipeline,
                                      respecialize=False)
    assert torch.equal(with_grad(x), model(x))
    with torch.no_grad(), pytest.raises(InputMismatchError, match="chose its path by the grad mode"):
        with_grad(x)
    with torch.no_grad():
        without = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 4),), pipeline=pipeline,
                                        respecialize=False)
        assert torch.equal(without(x), model(x))
    with pytest.raises(InputMismatchError, match="was disabled when the plan was captured"):
        without(x)
