"""Leaf detection by trial tracing: wrap the innermost untraceable thing, nothing coarser."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_fingerprint
from torch import nn

import autoshard
from autoshard.capture import trace_with_leaves
from autoshard.capture.fx import is_primitive
from autoshard.errors import TraceError
from autoshard.examples import BranchedNetwork, TransformerLM, load_example


def call_module_targets(gm) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "call_module"]


def test_branched_network_wraps_exactly_the_ten_blocks():
    result = trace_with_leaves(BranchedNetwork())
    assert [w.name for w in result.wrapped] == [f"blocks.{i}" for i in range(10)]
    assert all(w.kind == "module" and "control flow" in w.reason for w in result.wrapped)
    assert call_module_targets(result.graph_module) == [f"blocks.{i}" for i in range(10)]


def test_transformer_encoder_is_traced_through_to_its_layers():
    result = trace_with_leaves(TransformerLM(nlayers=3))
    targets = call_module_targets(result.graph_module)
    assert [t for t in targets if t.startswith("transformer_encoder")] == [
        f"transformer_encoder.layers.{i}" for i in range(3)]
    wrapped_modules = [w.name for w in result.wrapped if w.kind == "module"]
    assert "transformer_encoder" not in wrapped_modules
    # Free helpers in the encoder's forward are kept opaque instead of the whole encoder.
    wrapped_functions = [w.name for w in result.wrapped if w.kind == "function"]
    assert "torch.nn.functional._canonical_mask" in wrapped_functions


def test_traced_graph_computes_what_the_model_computes():
    model, args, kwargs = load_example("transformer-lm")
    gm = trace_with_leaves(model).graph_module
    assert torch.equal(gm(*args, **kwargs), model(*args, **kwargs))


def test_primitives_stay_leaves_and_composites_do_not():
    assert is_primitive(nn.Linear(2, 2)) and is_primitive(nn.LayerNorm(2)) and is_primitive(nn.ReLU())
    assert not is_primitive(nn.Sequential(nn.Linear(2, 2)))
    assert not is_primitive(nn.TransformerEncoderLayer(4, 1, 8))


class Helper(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def _check_positive(x):
    if (x > 0).all():  # data-dependent: untraceable inside a free function
        return x
    return -x


class UsesFreeFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.helper = Helper()

    def forward(self, x):
        x = self.a(x)
        x = _check_positive(x)
        return self.b(self.helper(x))


def test_a_failing_free_function_is_wrapped_not_the_model():
    model = UsesFreeFunction()
    result = trace_with_leaves(model)
    assert [(w.kind, w.name) for w in result.wrapped] == [("function", f"{__name__}._check_positive")]
    assert call_module_targets(result.graph_module) == ["a", "b"]  # Helper traced through
    x = torch.randn(3, 4)
    assert torch.equal(result.graph_module(x), model(x))
    # The module global is restored after tracing.
    assert (_check_positive.__name__ == "_check_positive"
            and globals()["_check_positive"].__code__.co_name == "_check_positive")


class TopLevelControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_top_level_data_dependent_control_flow_is_a_clear_trace_error():
    with pytest.raises(TraceError, match="top-level forward of TopLevelControlFlow"):
        trace_with_leaves(TopLevelControlFlow())


def test_module_with_hooks_stays_a_leaf_so_its_hooks_run():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    model[0].register_forward_hook(lambda m, i, o: o * 2)
    gm = trace_with_leaves(model).graph_module
    assert call_module_targets(gm) == ["0", "1"]
    x = torch.randn(1, 2)
    assert torch.equal(gm(x), model(x))


class AroundScripted(nn.Module):
    """A model holding a TorchScript block (``torch.jit.script`` or ``torch.jit.trace``) between eager layers."""

    def __init__(self, compile_: str) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.scripted = torch.jit.script(block) if compile_ == "script" else torch.jit.trace(block, torch.randn(2, 8))
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.scripted(self.first(x))))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("compile_", ["script", "trace"])
def test_a_torchscript_submodule_stays_a_leaf_its_stage_holds_and_serves_and_trains_like_the_model(
        compile_, fingerprint):
    """Its code is compiled, with no Python forward to trace through: the stage calls the module itself
    (holding its weights), and sharding leaves the model, whose registries there are no dicts, as it was."""
    model = AroundScripted(compile_)
    before = fingerprint(model)
    assert call_module_targets(trace_with_leaves(model).graph_module) == ["first", "scripted", "last"]
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 8),))
    assert_same_fingerprint(before, fingerprint(model))
    assert any(dict(stage.named_children()).get("scripted") is model.scripted for stage in sharded.stages)
    for batch in (3, 5):  # a second call, and another size
        x = torch.randn(batch, 8)
        got, want = sharded(x), model(x)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got.sum(), list(model.parameters())),
                                                     torch.autograd.grad(want.sum(), list(model.parameters()))))


def test_with_trace_hooks_a_module_with_forward_hooks_is_traced_through_and_its_hooks_run_on_every_call():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o) or o * 2)
    model[0].register_forward_hook(lambda m, i, kw, o: o + 1, with_kwargs=True)
    gm = trace_with_leaves(model, trace_hooks=True).graph_module
    assert call_module_targets(gm) == ["0.0", "1"]  # splittable inside
    x = torch.randn(1, 2)
    seen.clear()
    assert torch.equal(gm(x), model(x))  # both hooks, in order, each replacing the output
    assert len(seen) == 2 and all(type(t) is torch.Tensor for t in seen) and torch.equal(seen[0], seen[1])
    model[0]._forward_hooks.clear()
    assert torch.equal(gm(x), model(x))  # read at run time: a hook removed no longer runs


def test_with_trace_hooks_a_module_with_a_forward_pre_hook_stays_a_leaf_so_its_hook_runs():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    model[0].register_forward_pre_hook(lambda m, i: (i[0] * 2,))
    gm = trace_with_leaves(model, trace_hooks=True).graph_module
    assert call_module_targets(gm) == ["0", "1"]
    x = torch.randn(1, 2)
    assert torch.equal(gm(x), model(x))


def test_with_an_example_the_encoder_layers_are_traced_through_too():
    model, args, kwargs = load_example("transformer-lm")
    result = trace_with_leaves(model, args, kwargs)
    assert result.wrapped_modules == ()  # without an example each self-attention was a leaf
    assert {"transformer_encoder.layers.0.linear1", "transformer_encoder.layers.3.norm2"} <= set(
        call_module_targets(result.graph_module))
    assert torch.equal(result.graph_module(*args, **kwargs), model(*args, **kwargs))


def test_describe_lists_what_was_wrapped_fixed_and_accepted():
    model, args, kwargs = load_example("transformer-lm")
    text = trace_with_leaves(model, args, kwargs).describe()
    assert text.splitlines()[0].startswith("front end: fx;")
    assert "wrapped function torch.nn.modules.transformer._detect_is_causal_mask: TraceError" in text
    assert "specialized: torch.nn.modules.transformer._detect_is_causal_mask(...) returned True" in text


class NonPersistentScale(nn.Module):
    """A buffer kept out of ``state_dict`` (like rotary tables) beside one that is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * self.scale + self.shift)


@pytest.mark.parametrize("front_end, with_inputs", [
    ("trace", False), ("trace", True), ("export", True), ("capture", False), ("capture", True)])
def test_stages_keep_the_models_buffer_persistence_without_shape_propagation(front_end, with_inputs):
    """No shape-prop in the pipeline: the capture itself must carry persistence to the stages."""
    import autoshard

    model = NonPersistentScale()
    inputs = (torch.randn(2, 4),) if with_inputs else None
    sharded = autoshard.shard_model(model, 2, example_inputs=inputs,
                                    pipeline=f"{front_end},build-dag,linearize,split,emit")
    stage_keys = [set(stage.state_dict()) for stage in sharded.stages]
    assert set().union(*stage_keys) == set(model.state_dict())
    assert not any("scale" in keys for keys in stage_keys)
