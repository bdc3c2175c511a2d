"""The verify step names the first stage whose values differ from the model's."""

from __future__ import annotations

import copy
import dataclasses
import random
import types
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import register_pytree_node

import autoshard
from autoshard.errors import TraceError, VerificationError
from autoshard.examples import ResidualMLP
from autoshard.capture.guard import check_condition
from autoshard.verify import capture_difference, other_values, verify_stages
from autoshard.capture import trace_with_leaves


def _perturb(stage: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``stage`` whose first boundary output has 1 added."""
    graph = fx.Graph()
    env = {}
    for node in stage.graph.nodes:
        if node.op == "output":
            outs = node.args[0]
            first = graph.call_function(torch.add, (env[outs[0]], 1.0))
            graph.output((first, *[env[o] for o in outs[1:]]))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(stage, graph)


def test_matching_stages_pass_and_report():
    model = ResidualMLP()
    x = torch.randn(2, 16)
    sharded = autoshard.shard_model(model, 3)
    gm = trace_with_leaves(model).graph_module
    summary = verify_stages(model, gm, list(sharded.stages), sharded.plan.boundaries, (x,), {})
    assert "3 stages match the model on the example inputs and on other values of its shapes" in summary
    assert "their weights' gradients match the model's" in summary
    with torch.no_grad():  # inference alone: no gradient compared, none claimed
        summary = verify_stages(model, gm, list(sharded.stages), sharded.plan.boundaries, (x,), {})
    assert "gradients" not in summary


@pytest.mark.parametrize("broken", [0, 1])
def test_a_broken_stage_is_named(broken):
    model = ResidualMLP()
    x = torch.randn(2, 16)
    sharded = autoshard.shard_model(model, 3)
    stages = list(sharded.stages)
    stages[broken] = _perturb(stages[broken])
    gm = trace_with_leaves(model).graph_module
    with pytest.raises(VerificationError, match=f"stage {broken} produced value") as info:
        verify_stages(model, gm, stages, sharded.plan.boundaries, (x,), {})
    assert info.value.stage == broken


class ScaledByPythonRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * random.random())  # the trace keeps the number it drew


def test_a_drift_from_a_draw_of_pythons_random_is_blamed_on_the_draw_and_leaves_the_generator():
    model, x = ScaledByPythonRandom(), torch.randn(2, 4)
    random.seed(1)
    with pytest.warns(autoshard.HostRandomnessWarning):
        gm = trace_with_leaves(model).graph_module
    random.seed(2)  # the model's next draw differs from the trace's
    expected_next = random.random()
    random.seed(2)
    with pytest.raises(VerificationError, match=r"the model drew from Python's random on this call.*"
                                                r"Draw with torch \(torch.rand\)"):
        verify_stages(model, gm, [gm], [], (x,), {})
    assert random.random() == expected_next


def test_a_stage_that_differs_where_the_model_drew_from_pythons_random_names_the_draw():
    """The graph matches the model where the model draws what the trace drew; a stage that differs
    then is most likely the draw again (Wav2Vec2's SpecAugment masks, drawn with numpy, once failed
    with "stage 1 (the last) returned a different output" alone)."""
    model, x = ScaledByPythonRandom(), torch.randn(2, 4)
    random.seed(1)
    with pytest.warns(autoshard.HostRandomnessWarning):
        gm = trace_with_leaves(model).graph_module
    random.seed(1)
    with pytest.raises(VerificationError, match=r"stage 0 \(the last\) returned a different output .*"
                                                r"the model drew from Python's random on this call"):
        verify_stages(model, gm, [_PlusOne(gm)], [], (x,), {})


class _PlusOne(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args) + 1


def test_a_capture_that_drifts_from_the_model_is_reported_before_any_stage():
    model = ResidualMLP()
    x = torch.randn(2, 16)
    sharded = autoshard.shard_model(model, 2)
    gm = trace_with_leaves(ResidualMLP()).graph_module  # other weights: the "trace" is wrong
    with pytest.raises(VerificationError, match="traced graph differs") as info:
        verify_stages(model, gm, list(sharded.stages), sharded.plan.boundaries, (x,), {})
    assert info.value.stage is None


def test_verification_restores_batchnorm_statistics():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    before = model[1].running_mean.clone()
    autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),))
    assert torch.equal(model[1].running_mean, before)
    assert model[1].num_batches_tracked.item() == 0


class NormInAList(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.extra = [torch.nn.BatchNorm1d(4)]  # outside the module tree: model.buffers() does not list it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.extra[0](self.a(x)))


def test_sharding_restores_a_batchnorm_kept_outside_the_module_tree():
    model = NormInAList().train()
    norm = model.extra[0]
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),))
    assert all(torch.equal(before[k], v) for k, v in norm.state_dict().items())


class ReturnsADict(torch.nn.Module):
    """A forward returning a plain dict (and a list inside it), as many real models do."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict:
        hidden = self.first(x)
        return {"hidden": [hidden], "out": self.second(hidden)}


def test_a_model_returning_a_dict_is_verified_and_returns_a_dict():
    model, x = ReturnsADict(), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
    out = sharded(x)
    assert type(out) is dict and type(out["hidden"]) is list
    torch.testing.assert_close(out, model(x))


class KeyValueCache:
    """A generation cache: layers append to it in place, and it compares by identity."""

    def __init__(self) -> None:
        self.layers: list[list[torch.Tensor]] = []


class CachingMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, KeyValueCache]:
        cache = KeyValueCache()
        for layer in self.layers:
            x = layer(x)
            cache.layers.append([x])
        return x, cache


def test_an_output_object_holding_tensors_is_refused_saying_what_it_is():
    with pytest.raises(TraceError, match=r"returns a KeyValueCache holding values its forward computed.*"
                                         r"return its tensors in tuples"):
        autoshard.shard_model(CachingMLP(), 2, example_inputs=(torch.randn(2, 4),))


class NamespaceMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, types.SimpleNamespace]:
        y = self.b(self.a(x))
        return y, types.SimpleNamespace(kept=y)


def test_an_output_object_comparing_by_value_is_refused_as_one_the_capture_does_not_look_into():
    """A ``SimpleNamespace`` compares by value: the trace kept it as a constant with its tensor gone, and
    the comparison then blamed randomness or globals. The trace refuses it now, naming it."""
    with pytest.raises(TraceError, match=r"returns a SimpleNamespace holding values its forward computed, an object "
                                         r"the capture cannot rebuild"):
        autoshard.shard_model(NamespaceMLP(), 2, example_inputs=(torch.randn(2, 4),))


_TABLE = torch.arange(4.0)


class ReturnsATable(NamespaceMLP):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, types.SimpleNamespace]:
        return self.b(self.a(x)), types.SimpleNamespace(table=_TABLE)


def test_an_output_object_holding_a_global_tensor_is_refused_by_the_check_against_the_model():
    """No trace value in it (the trace lets it pass), but stages cannot send it on either."""
    with pytest.raises(VerificationError, match=r"objects that hold tensors \(\[1\]: SimpleNamespace\) where "
                                                r"the capture does not look"):
        autoshard.shard_model(ReturnsATable(), 2, example_inputs=(torch.randn(2, 4),))


@dataclasses.dataclass
class KeylessOutput:
    """An output class registered as a pytree node without key paths, as diffusers registers its own."""

    sample: Any
    extra: Any = None


register_pytree_node(KeylessOutput, lambda o: ([o.sample, o.extra], None), lambda values, _: KeylessOutput(*values))


class KeylessOutputMLP(torch.nn.Module):
    def __init__(self, cache: bool = False) -> None:
        super().__init__()
        self.cache = cache
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> KeylessOutput:
        for layer in self.layers:
            x = torch.relu(layer(x))
        cache = KeyValueCache() if self.cache else None
        if cache is not None:
            cache.layers.append([x])
        return KeylessOutput(x, cache)


def test_an_output_type_registered_without_key_paths_is_verified():
    model = KeylessOutputMLP()
    x = torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 3, example_inputs=(x,))
    later = torch.randn(5, 4)
    out = sharded(later)
    assert type(out) is KeylessOutput
    torch.testing.assert_close(out.sample, model(later).sample, rtol=0, atol=0)


def test_an_object_holding_tensors_inside_a_keyless_output_is_named_by_its_position():
    with pytest.raises(TraceError, match=r"returns a KeyValueCache holding values its forward computed"):
        autoshard.shard_model(KeylessOutputMLP(cache=True), 2, example_inputs=(torch.randn(2, 4),))


class ScalesItsInput(torch.nn.Module):
    """Writes to its input, as ``hidden_states *= scale`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_that_writes_to_its_input_is_verified_on_fresh_copies_and_the_example_is_untouched():
    model = ScalesItsInput()
    example = torch.randn(2, 4)
    before = example.clone()
    sharded = autoshard.shard_model(model, 3, example_inputs=(example,), cost="flops")
    assert torch.equal(example, before)
    mine = torch.randn(5, 4)
    theirs = mine.clone()
    assert torch.equal(sharded(mine), model(theirs))
    assert torch.equal(mine, theirs)  # the stages write to their input as the model does


def pack_with_shapes(x: torch.Tensor):
    """einops.pack's shape: a tensor and the shapes to unpack it with; untraceable (it reads values)."""
    if x.abs().sum() < 0:
        raise ValueError("never")
    return x * 2, [x.shape]


class PacksShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))

    def forward(self, x):
        packed, shapes = pack_with_shapes(self.a(x))
        return self.b(packed).reshape(shapes[0])


def test_a_value_holding_tensors_and_sizes_is_compared_with_its_sizes_kept_sizes():
    model = PacksShapes()
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 4),), cost="nodes")
    assert [w.name for w in sharded.plan.wrapped] == [f"{__name__}.pack_with_shapes"]
    x = torch.randn(3, 4)
    assert torch.equal(sharded(x), model(x))


@dataclasses.dataclass
class PlainOutput:
    """A model output type not registered with pytree: compared field by field."""

    logits: torch.Tensor
    hidden: torch.Tensor


class ReturnsPlainDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> PlainOutput:
        h = torch.relu(self.a(x))
        return PlainOutput(self.b(h), h)


def test_a_plain_dataclass_output_is_verified_field_by_field():
    from autoshard.verify import first_difference
    model = ReturnsPlainDataclass()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    x = torch.randn(3, 8)
    out = sharded(x)
    assert isinstance(out, PlainOutput) and torch.equal(out.logits, model(x).logits)
    assert first_difference(out, model(x), 0.0, 0.0) is None
    changed = PlainOutput(out.logits, out.hidden + 1)
    assert first_difference(changed, model(x), 0.0, 0.0) is not None


class FlagInDict(nn.Module):
    """Sets a flag through ``self.__dict__``, around ``nn.Module.__setattr__``: capture cannot see
    the write, and the first call alone matches."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ready = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.__dict__["ready"]:
            self.__dict__["ready"] = True
            return self.lin(x) * 2
        return self.lin(x)


def test_state_capture_cannot_see_is_caught_by_a_second_call():
    model = nn.Sequential(nn.Linear(4, 4), FlagInDict(), nn.Linear(4, 4))
    with pytest.raises(VerificationError, match="second call on the example differs from the model's"):
        autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 4),))


class _ScaledByBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * self.scale)  # the product saves `scale` for the backward


def test_sharding_leaves_a_backward_pending_on_the_model_runnable():
    """Restoring the buffers the runs did not write would move their version counters, and
    autograd refuses a backward through a graph whose saved tensors moved since."""
    model, x = _ScaledByBuffer(), torch.randn(3, 4)
    pending = model(x)
    autoshard.shard_model(model, 2, example_inputs=(x,), instruments=[autoshard.passes.ModelUnchanged()])
    assert model.scale._version == 0
    pending.sum().backward()
    assert model.fc1.weight.grad is not None
    # BatchNorm in training: the runs do update its statistics, which are written back, but not
    # through the counter (plain PyTorch runs such a pending backward after more forwards too)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    pending = model(x)
    statistics = model[1].running_mean.clone()
    autoshard.shard_model(model, 2, example_inputs=(x,))
    assert torch.equal(model[1].running_mean, statistics)
    pending.sum().backward()


class _DecayingBuffer(_ScaledByBuffer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(0.5).add_(1.0)  # the capture's runs move the counter; the product saves it
        return super().forward(x)


def test_a_backward_pending_through_a_buffer_the_forward_updates_in_place_still_runs():
    model, x = _DecayingBuffer(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    pending, expected = model(x), reference(x)
    version, value = model.scale._version, model.scale.clone()
    autoshard.shard_model(model, 2, example_inputs=(x,), instruments=[autoshard.passes.ModelUnchanged()])
    assert model.scale._version == version and torch.equal(model.scale, value)
    pending.sum().backward()
    expected.sum().backward()
    assert torch.equal(model.fc1.weight.grad, reference.fc1.weight.grad)


class _WritesWithOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        doubled = torch.empty_like(h)
        torch.mul(h, 2, out=doubled)  # autograd refuses out= on tensors that require grad
        return self.b(doubled)


def test_a_model_that_runs_only_without_grad_is_verified_without_grad():
    x = torch.randn(2, 8)
    model = _WritesWithOut().eval()
    with torch.no_grad():
        sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
        assert torch.equal(sharded(x), model(x))
    with torch.inference_mode():
        frozen = _ScaledByBuffer()  # weights made in inference mode: no grad can flow through them
    sharded = autoshard.shard_model(frozen, 2, example_inputs=(x[:, :4],))
    with torch.inference_mode():
        assert torch.equal(sharded(x[:, :4]), frozen(x[:, :4]))


def test_other_values_keep_each_tensors_shape_dtype_and_kind_of_value():
    floats = torch.tensor([[0.0, float("-inf"), 2.0], [-3.0, 4.0, 5.0]])
    ids = torch.arange(12).reshape(3, 4)
    mask, scalar = torch.tensor([True, False, True]), torch.tensor([7.0])
    args, kwargs = other_values(((floats, ids), {"mask": mask, "scalar": scalar, "flag": 3}), seed=0)
    new_floats, new_ids = args
    assert new_floats.shape == floats.shape and new_floats.dtype == floats.dtype
    assert not torch.equal(new_floats, floats)
    ratio = new_floats[floats.isfinite() & (floats != 0)] / floats[floats.isfinite() & (floats != 0)]
    assert bool(((ratio >= 0.9) & (ratio <= 1.1)).all())  # signs kept: a value stays on its side of 0
    assert new_floats[0, 0] == 0 and new_floats[0, 1] == float("-inf")  # an additive mask stays one
    assert new_ids.shape == ids.shape and not torch.equal(new_ids, ids)
    assert torch.equal(new_ids.flatten().sort().values, ids.flatten())  # shuffled: ids stay in range
    assert kwargs["mask"] is mask and kwargs["scalar"] is scalar and kwargs["flag"] == 3
    again = other_values(((floats, ids), {"mask": mask}), seed=0)[0]
    assert torch.equal(again[0], new_floats) and torch.equal(again[1], new_ids)  # the same every run
    assert other_values(((torch.zeros(4), torch.ones(3, dtype=torch.long)), {}), seed=0) is None  # nothing changes


class AddsItsMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean()


class AddsAConstant(nn.Module):
    """What a capture that fixed ``x.mean()`` to the example's value would run."""

    def __init__(self, constant: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("constant", constant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.constant


def test_a_value_fixed_where_the_model_computes_it_is_caught_on_other_values():
    model, x = AddsItsMean(), torch.randn(4, 4)
    right, baked = fx.symbolic_trace(model), fx.symbolic_trace(AddsAConstant(x.mean()))
    with pytest.raises(VerificationError, match=r"the traced graph: equal to the model on the example but not on "
                                                r"other values .* every new input would get a wrong answer"):
        verify_stages(model, baked, [baked], [], (x,), {})
    assert "not on other values" in capture_difference(model, baked, (x,), {})  # the front ends' choice sees it
    assert capture_difference(model, right, (x,), {}) is None
    with pytest.raises(VerificationError, match="the chained stages: equal to the model on the example but not"):
        verify_stages(model, right, [baked], [], (x,), {})


class RefusesUnsortedIds(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not torch.equal(ids, ids.sort().values):
            raise ValueError("ids must be sorted")
        return x * 2


def _guarded_on_the_second_id(model: nn.Module) -> fx.GraphModule:
    """``model``'s graph with a guard that refuses inputs whose second id is not the example's 4."""
    graph = fx.Graph()
    x, ids = graph.placeholder("x"), graph.placeholder("ids")
    second = graph.call_function(torch.Tensor.__getitem__, (ids, 1))
    graph.call_function(check_condition, (graph.call_function(torch.eq, (second, 4)), True, "ids[1] == 4"))
    graph.output(graph.call_function(torch.mul, (x, 2)))
    return fx.GraphModule(model, graph)


def test_values_the_model_or_the_plans_guards_refuse_are_not_compared():
    x, ids = torch.randn(2, 4), torch.arange(3, 9)
    model = RefusesUnsortedIds()
    gm = _guarded_on_the_second_id(model)
    summary = verify_stages(model, gm, [gm], [], (x, ids), {})  # the model refuses the shuffled ids
    assert summary.endswith("on the example inputs (rtol=0.0, atol=0.0)")
    doubles = fx.symbolic_trace(lambda x, ids: x * 2)
    summary = verify_stages(doubles, gm, [gm], [], (x, ids), {})  # the model runs them; the guard refuses them
    assert summary.endswith("on the example inputs (rtol=0.0, atol=0.0)")
    assert "on other values" in verify_stages(doubles, doubles, [doubles], [], (x, ids), {})


def test_on_other_values_the_graph_runs_only_where_the_stages_differ(monkeypatch):
    model, x = AddsItsMean(), torch.randn(4, 4)
    right, baked = fx.symbolic_trace(model), fx.symbolic_trace(AddsAConstant(x.mean()))
    graph_runs = []
    real = autoshard.verify._graph_run
    monkeypatch.setattr(autoshard.verify, "_graph_run", lambda *a, **k: graph_runs.append(1) or real(*a, **k))
    assert "on other values" in verify_stages(model, right, [right], [], (x,), {})
    assert len(graph_runs) == 1  # the example's run alone: the stages matched on the other values
    with pytest.raises(VerificationError, match="the chained stages: equal to the model on the example"):
        verify_stages(model, right, [baked], [], (x,), {})
    assert len(graph_runs) == 3  # then the graph ran on them too, and matched: the stages are at fault


class _StopsGradientOnTensors(nn.Module):
    """A frozen feature extractor written as many are: the trace's proxy is no ``torch.Tensor``, so an fx
    graph skipped the detach and gave ``a`` a gradient the model does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if isinstance(h, torch.Tensor):
            h = h.detach()
        return self.b(h)


class _HooksItsGradient(nn.Module):
    """Registers a tensor hook in its forward: the traced graphs drop it, and ``a`` got a third of the
    model's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad * 3)
        return self.b(h)


def test_a_capture_whose_gradients_differ_is_refused_and_capture_takes_the_front_end_that_matches():
    """Verification compared forward values only, so both kept their wrong gradients silently."""
    torch.manual_seed(0)
    model, x = _StopsGradientOnTensors(), torch.randn(4, 8)
    with pytest.raises(VerificationError, match="gradients differ.*a.weight gets a gradient, where the model gives "
                                                "it none"):
        autoshard.shard_model(model, 2, (x,), pipeline="trace,shape-prop,build-dag,linearize,split,emit,verify")
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x).sum().backward()
    assert model.a.weight.grad is None and model.b.weight.grad is not None
    with pytest.raises(VerificationError, match=r"a.weight's gradient differs from the model's"):
        autoshard.shard_model(_HooksItsGradient(), 2, (x,))
    with torch.no_grad():  # inference alone: nothing to compare
        sharded = autoshard.shard_model(_HooksItsGradient(), 2, (x,))
    assert sharded(x).shape == (4, 8)


class _HooksAlways(_HooksItsGradient):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda grad: grad * 3)  # needs grad: the model runs only with it
        return self.b(h)


def test_a_model_that_runs_only_with_grad_is_sharded_and_trains_as_the_model_does():
    """The check that the model runs on its example ran it without grad alone, and blamed the model
    (ExampleInputsError) for what only that mode refuses; then shape propagation, which runs without
    grad, failed on the hook (a helper probe): it skips what only tells autograd something."""
    torch.manual_seed(0)
    model, x = _HooksAlways(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,), verify=False)
    sharded(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))
    autoshard.shard_model(model, 2, (x,))  # verified: values and gradients


def test_comparing_gradients_changes_no_grad_of_the_weights_or_the_example():
    torch.manual_seed(0)
    model, x = _StopsGradientOnTensors(), torch.randn(4, 8, requires_grad=True)
    model.b.weight.grad = torch.ones(8, 8)
    autoshard.shard_model(model, 2, (x,))
    assert x.grad is None and model.a.weight.grad is None and torch.equal(model.b.weight.grad, torch.ones(8, 8))


class _WritesWhatItSaved(nn.Module):
    """Writes in place to what sigmoid saved for its backward: the model's own backward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.a(x))
        h.mul_(2)
        return self.b(h)


def test_a_model_whose_own_backward_raises_is_sharded_with_a_warning_that_gradients_went_unchecked():
    """The comparison was skipped without a word: the stages' gradients stood unchecked (memory probe)."""
    torch.manual_seed(0)
    model, x = _WritesWhatItSaved(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with pytest.warns(autoshard.UncheckedGradientsWarning, match=r"the model's own backward raises on the example "
                                                                 r"\(RuntimeError: one of the variables"):
        sharded = autoshard.shard_model(model, 2, (x,))
    assert torch.equal(sharded(x), model(x))


class _NanAndSparse(nn.Module):
    """A sparse embedding's gradient, and one that is nan (0 * inf): both compared, neither refused."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.a, self.b = nn.Embedding(10, 8, sparse=True), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.a(self.table(ids))
        return self.b(h) + self.a.bias.sum() * float("inf") * 0


def test_gradients_that_are_nan_or_sparse_are_compared_and_hooks_that_step_are_left_alone():
    """A nan gradient raised on a negative tolerance and a sparse one on ``max`` (a helper's probe); a
    weight's post-accumulate hook (an optimizer stepping in the backward) ran during sharding and
    trained the model."""
    torch.manual_seed(0)
    model, ids = _NanAndSparse(), torch.randint(0, 10, (4, 3))
    autoshard.shard_model(model, 2, (ids,))
    steps, before = [], model.a.weight.detach().clone()
    model.a.weight.register_post_accumulate_grad_hook(lambda p: steps.append(1) or p.data.sub_(p.grad))
    autoshard.shard_model(model, 2, (ids,))
    assert steps == [] and torch.equal(model.a.weight, before)
