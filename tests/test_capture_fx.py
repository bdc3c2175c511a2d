"""fx capture with example inputs: the example runs alongside, so shape and dtype code traces,
the graph stays generic in sizes, and everything fixed from the example is checked on each call."""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import pickle
import types
from typing import Any

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from conftest import SignGate, assert_same_fingerprint, model_fingerprint
from torch import nn

import autoshard
from autoshard.capture import trace_with_leaves
from autoshard.capture.auto import capture
from autoshard.capture.guard import FREE_SIZES_PIPELINE
from autoshard.capture.meta_proxy import EXAMPLE
from autoshard.errors import InputMismatchError, PlanError, TraceError, VerificationError
from autoshard.isolation import module_state_restored
from autoshard.passes.instruments import ModelUnchanged
from autoshard.specialize import holders

HOOKS_TRACED = "capture{trace-hooks=true},shape-prop,build-dag,linearize,split,emit,verify"
"""Modules with forward hooks traced through, their hooks run by a node after the body (a plan's
re-specialisation captures so; a first capture keeps them whole by default)."""


class SplitHeads(nn.Module):
    """Shape arithmetic plain fx cannot trace: ``(*x.shape[:-1], 2, 4)`` iterates a Proxy."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x).view(*x.shape[:-1], 2, 4)
        first, second = y.unbind(-2)
        return torch.cat([second, first], dim=-1) * len(x.shape)


def test_shape_arithmetic_traces_and_the_graph_serves_other_shapes():
    model = SplitHeads()
    with pytest.raises(TraceError, match="top-level forward of SplitHeads"):
        trace_with_leaves(model)  # no example: plain fx
    result = trace_with_leaves(model, (torch.randn(2, 3, 8),))
    assert result.wrapped == ()
    for shape in [(2, 3, 8), (5, 7, 8)]:
        x = torch.randn(shape)
        assert torch.equal(result.graph_module(x), model(x))


class MaskedScore(nn.Module):
    """Branches on a dtype and on a size: facts the example answers."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype == torch.bool:
            mask = mask.float()
        if x.size(0) > 1:  # a condition on a size alone
            x = x - x.mean(0, keepdim=True)
        return self.score(x).squeeze(-1) * mask


def test_size_conditions_take_the_example_branch_and_refuse_inputs_that_flip_it():
    model = MaskedScore()
    mask = torch.tensor([[True, False, True]] * 2)
    result = trace_with_leaves(model, (torch.randn(2, 3, 4), mask))
    assert result.wrapped == ()
    assert len(result.specialized) == 1 and "x.size(0) > 1" in result.specialized[0]
    x, later_mask = torch.randn(5, 3, 4), torch.ones(5, 3, dtype=torch.bool)
    assert torch.equal(result.graph_module(x, later_mask), model(x, later_mask))
    flipped = r"condition at test_capture_fx.py:\d+ \(`if x.size\(0\) > 1:`\) is False for these inputs"
    with pytest.raises(InputMismatchError, match=flipped):
        result.graph_module(torch.randn(1, 3, 4), later_mask[:1])


def test_dtypes_the_trace_relied_on_are_checked_on_every_call():
    model = MaskedScore()
    result = trace_with_leaves(model, (torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)))
    assert "mask: bool" in result.input_guard
    problem = "mask is torch.float32, but the plan was captured with torch.bool"
    with pytest.raises(InputMismatchError, match=problem):
        result.graph_module(torch.randn(2, 3, 4), torch.ones(2, 3))


def test_dtypes_the_trace_never_asked_about_run_as_the_model_runs_them():
    """No question about a dtype answered, no guard: the same operations run on int32 ids as on the
    example's int64, as the model's do (docs/concepts.md, Dtypes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    sharded = autoshard.shard_model(model, 2, (torch.randint(0, 10, (2, 3)),))
    ids = torch.randint(0, 10, (2, 3), dtype=torch.int32)
    assert torch.equal(sharded(ids), model(ids)) and not sharded.specializations


class Gate(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class Around(nn.Module):
    """``inner`` (kept as the child ``inner``) followed by a linear layer."""

    def __init__(self, inner: nn.Module, width: int) -> None:
        super().__init__()
        self.inner = inner
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(self.inner(x))


def serves_like(sharded: nn.Module, twin: nn.Module, calls: int, batch: int = 3) -> None:
    """``calls`` calls in a row on fresh inputs return what the unsharded twin returns: state a
    module keeps for its next call advances alike."""
    for _ in range(calls):
        x = torch.randn(batch, 8)
        assert torch.equal(sharded(x), twin(x))


def test_conditions_on_tensor_values_still_make_a_leaf():
    model = Around(Gate(), 3)
    result = trace_with_leaves(model, (torch.randn(2, 3),))
    assert [(w.kind, w.name) for w in result.wrapped] == [("module", "inner")]
    for x in (torch.full((2, 3), 1.0), torch.full((4, 3), -1.0)):
        assert torch.equal(result.graph_module(x), model(x))


@dataclasses.dataclass
class Config:
    """A config as transformers has them: a dataclass with a private setting that is no field."""

    scale: float

    def __post_init__(self) -> None:
        self._mode = "default"  # lost if the config is rebuilt from its fields


def scaled(x: torch.Tensor, config: Config) -> torch.Tensor:
    if x.sum() > 1e9:  # value-dependent: this function is kept opaque, the config passed to it
        return x
    return x * (config.scale if config._mode == "double" else 1.0)


class UsesConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = Config(scale=2.0)
        self.config._mode = "double"
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled(self.lin(x), self.config)


def test_a_config_passed_to_an_opaque_function_is_the_same_object_not_a_rebuilt_one():
    model = UsesConfig()
    result = trace_with_leaves(model, (torch.randn(2, 3),))
    assert [w.name for w in result.wrapped] == [f"{__name__}.scaled"]
    gm = result.graph_module
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    assert any(c is model.config for c in constants)
    x = torch.randn(4, 3)
    assert torch.equal(gm(x), model(x))


class Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, scale=1.0, act="relu", norm=None, residual=False):
        y = self.lin(x) * scale
        y = torch.relu(y) if act == "relu" else torch.tanh(y)
        if norm is not None:
            y = y / norm
        return y + x if residual else y


def test_non_tensor_arguments_become_checked_constants():
    model = Keywords()
    kwargs = {"scale": 3.0, "act": "tanh", "norm": None, "residual": True}
    result = trace_with_leaves(model, (torch.randn(2, 3),), kwargs)
    gm = result.graph_module
    x = torch.randn(5, 3)
    assert torch.equal(gm(x, **kwargs), model(x, **kwargs))
    assert torch.equal(gm(x), model(x, **kwargs))  # trailing constants default to the example's
    assert result.input_guard == "x: float32, scale=3.0, act='tanh', norm=None, residual=True"
    with pytest.raises(InputMismatchError, match="act='relu', but the plan was captured with act='tanh'"):
        gm(x, act="relu")
    with pytest.raises(InputMismatchError, match="residual=1"):  # 1 is not the True it was captured with
        gm(x, residual=1)


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor | None = None


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return {"pair": Pair(y, None), "both": (y, x)}


def test_outputs_keep_the_models_structure_and_types():
    model = Structured()
    x = torch.randn(2, 3)
    out = trace_with_leaves(model, (x,)).graph_module(x)
    expected = model(x)
    assert type(out) is dict and list(out) == ["pair", "both"]
    assert type(out["pair"]) is Pair and out["pair"].second is None
    assert torch.equal(out["pair"].first, expected["pair"].first)
    assert type(out["both"]) is tuple and torch.equal(out["both"][1], x)


def test_example_values_are_not_kept_and_the_model_is_untouched():
    model = MaskedScore()
    before = model_fingerprint(model)
    x, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    x_before = x.clone()
    gm = trace_with_leaves(model, (x, mask)).graph_module
    assert not any(EXAMPLE in node.meta for node in gm.graph.nodes)
    assert torch.equal(x, x_before)
    assert_same_fingerprint(before, model_fingerprint(model))
    own = dict(model.named_parameters())
    assert all(own[name] is p for name, p in gm.named_parameters())


class StoresItsWindow(nn.Module):
    """Sets an attribute from its input's shape in forward, as Swin's layers do with their window."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.window = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] <= self.window:
            self.window = x.shape[1]
        return self.b(self.a(x).roll(self.window // 2, dims=1))


def test_a_forward_that_sets_attributes_keeps_no_proxy_on_the_model():
    """Traced, the forward stores a Proxy on the model; the model's next call (verify's) failed on it.
    The capture's real calls store real numbers, which are set back too: the model keeps the
    window it was given."""
    model, x = StoresItsWindow(), torch.randn(2, 6, 8)
    before = model_fingerprint(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), instruments=[ModelUnchanged()])
    assert_same_fingerprint(before, model_fingerprint(model))
    assert model.window == 16
    assert torch.equal(sharded(x), model(x))


def test_module_state_restored_takes_off_trace_values_stored_tensors_and_flags_added():
    """A flag a run adds (``if not getattr(self, "_warned", False): ...; self._warned = True``) is state the
    next call reads: a failed shard_model left it on the model (review); an object it stores is its own."""
    model = StoresItsWindow()
    proxy = fx.Proxy(fx.Graph().placeholder("x"))
    kept = object()
    with module_state_restored(model):
        model.window, model.b.extra, model.a.flag, model.a.own = proxy, [proxy], True, kept
        model.a.previous = torch.ones(1)
    assert model.window == 16 and not hasattr(model.b, "extra") and not hasattr(model.a, "flag")
    assert not hasattr(model.a, "previous") and model.a.own is kept


def test_module_state_restored_looks_into_no_empty_hook_dict_left_as_it_was(monkeypatch):
    """Every module keeps about fifteen hook dicts and sets, nearly all empty: looked into for trace values on
    each isolated run, they were half the time a 24-layer T5's runs spent setting its state back (1,070
    modules). A list the run filled with one is still taken off (above)."""
    from autoshard import isolation

    looked_into: list[object] = []
    holds = isolation.holds
    monkeypatch.setattr(isolation, "holds", lambda value, kinds: looked_into.append(value) or holds(value, kinds))
    model = StoresItsWindow()
    proxy = fx.Proxy(fx.Graph().placeholder("x"))
    with module_state_restored(model):
        model.b.extra = [proxy]
    assert not hasattr(model.b, "extra")
    assert not [value for value in looked_into if type(value) in (dict, collections.OrderedDict, set) and not value]


class Recorded(nn.Module):
    """Returns what a forward hook saw, as Transformers' output recorders do: the hook on ``first``
    (a leaf, so it sees its real output while tracing) and the hook inside ``gate`` (a leaf for
    its value-dependent branch) store into ``seen``."""

    def __init__(self, hook_inside_the_gate: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.first, self.gate = nn.Sequential(nn.Linear(4, 4), nn.Dropout(dropout)), ValueGate()
        self.seen: list | None = None
        recorded = self.gate.up if hook_inside_the_gate else self.first
        recorded.register_forward_hook(lambda module, args, out: None if self.seen is None else self.seen.append(out))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen = []
        y = self.gate(self.first(x))
        seen, self.seen = self.seen, None
        return y, seen[0]


class ValueGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.up(x) if x.mean() > -100 else x


class RecordedThenReshaped(Recorded):
    """Reshapes and transposes what the hook saw before a leaf reads it, as SegFormer's decode
    head does with the hidden states Transformers recorded: torch runs those operations on the
    real tensor while tracing, and their results reach the graph without any proxy."""

    def __init__(self, hook_inside_the_gate: bool, dropout: float = 0.0) -> None:
        super().__init__(hook_inside_the_gate, dropout)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, seen = super().forward(x)
        return y, self.head(seen.reshape(seen.shape[0], 2, 2).transpose(1, 2).flatten(1))


@pytest.mark.parametrize("recorded", [Recorded, RecordedThenReshaped])
def test_a_modules_output_seen_by_a_hook_and_what_torch_computes_from_it_are_traced_not_baked_in(recorded):
    model, x, later = recorded(hook_inside_the_gate=False), torch.randn(2, 4), torch.randn(3, 4)
    gm = trace_with_leaves(model, (x,)).graph_module
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and "constant" in str(n.target)
                and isinstance(getattr(gm, str(n.target)), torch.Tensor)]
    for inputs in (x, later):
        assert all(torch.equal(a, b) for a, b in zip(gm(inputs), model(inputs)))


@pytest.mark.parametrize("recorded", [Recorded, RecordedThenReshaped])
def test_a_tensor_a_hook_saw_inside_a_leaf_and_what_torch_computes_from_it_are_refused(recorded):
    """No node computes them, so the only graph fx could build would return the example's values."""
    with pytest.raises(TraceError, match="a tensor computed from the example inside gate reached the graph"):
        trace_with_leaves(recorded(hook_inside_the_gate=True), (torch.randn(2, 4),))


def test_a_dropout_whose_output_a_hook_saw_and_torch_reshaped_verifies_on_second_calls():
    """Baked in as a constant, the example's dropped-out value matched the stages' first call (the
    capture runs with the seed verification replays) and not their second, which drew other masks."""
    model = RecordedThenReshaped(hook_inside_the_gate=False, dropout=0.5).train()
    autoshard.shard_model(model, 2, (torch.randn(2, 4),))


def test_a_batchnorm_model_in_training_mode_keeps_its_statistics():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 4)).train()
    before = model_fingerprint(model)
    x = torch.randn(8, 4)
    rng = torch.random.get_rng_state()
    trace_with_leaves(model, (x,))
    assert torch.equal(rng, torch.random.get_rng_state())
    assert_same_fingerprint(before, model_fingerprint(model))


def test_functional_pad_with_a_size_from_the_input_stays_symbolic():
    class PadToEight(nn.Module):
        def forward(self, x):
            return F.pad(x, (0, 8 - x.shape[-1]))

    model = PadToEight()
    gm = trace_with_leaves(model, (torch.randn(2, 5),)).graph_module
    x = torch.randn(3, 2)
    assert torch.equal(gm(x), model(x))


class TimeEmbedding(nn.Module):
    """diffusers' UNet idiom: a timestep may come as a number or a tensor, tested with ``torch.is_tensor``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1, 4)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([timestep], dtype=torch.long)
        elif len(timestep.shape) == 0:
            timestep = timestep[None]
        return x + self.proj(timestep.expand(x.shape[0]).float()[:, None])


def test_torch_is_tensor_answers_from_the_example():
    model = TimeEmbedding()
    result = trace_with_leaves(model, (torch.randn(2, 4), torch.tensor(7)))
    assert not result.wrapped
    assert torch.is_tensor(torch.ones(1)) and not torch.is_tensor(1)  # the real function is back
    later = (torch.randn(3, 4), torch.tensor(5))
    torch.testing.assert_close(result.graph_module(*later), model(*later), rtol=0, atol=0)


class HalfPrecisionBlock(nn.Module):
    """Two linears under ``torch.autocast``: the region changes the dtype they compute in."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.second(self.first(x)).float()


def test_an_autocast_region_is_kept_whole_as_fx_would_drop_it():
    model = Around(HalfPrecisionBlock(), 8)
    result = trace_with_leaves(model, (torch.randn(2, 8),))
    assert [(w.kind, w.name) for w in result.wrapped] == [("module", "inner")]
    assert "autocast" in result.wrapped[0].reason
    later = torch.randn(5, 8)
    assert torch.equal(result.graph_module(later), model(later))
    assert not torch.is_autocast_enabled("cpu")


def test_a_model_whose_own_forward_enters_autocast_is_sharded_exactly():
    model = HalfPrecisionBlock().eval()  # the region is in the top-level forward: fx fails, export keeps it
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert sharded.plan.wrapped == ()
    later = torch.randn(5, 8)
    assert torch.equal(sharded(later), model(later))


class CallCounter(nn.Module):
    """Keeps a Python int on ``self`` and halves its output from the fourth call on (a warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.lin(x)
        return h * 0.5 if self.calls > 3 else h


def test_a_module_counting_calls_in_a_python_int_is_kept_whole_and_keeps_counting():
    model = Around(CallCounter(), 8)
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert model.inner.calls == 0  # the capture's runs of the model were set back
    assert [w.name for w in sharded.plan.wrapped] == ["inner"]
    assert "changes its attribute 'calls' (0 -> 1)" in sharded.plan.wrapped[0].reason
    serves_like(sharded, twin, 5)  # across the fourth call, where the branch turns
    assert model.inner.calls == twin.inner.calls == 5


class ScaledByItsFirstBatch(nn.Module):
    """Keeps its first call's batch size and scales every output by it: a size, which the graph
    recomputes from each call's input, kept as state."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.first_batch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.first_batch is None:
            self.first_batch = x.shape[0]
        return self.b(torch.relu(h)) * self.first_batch


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_a_size_kept_from_the_first_call_is_state_not_recomputed(front_end):
    """The write of a traced size passed as a scratch value (Swin's window size): the stages scaled each
    call by its own batch, the model by its first call's (review)."""
    pipeline = f"{front_end},shape-prop,build-dag,linearize,split,emit,verify"
    with pytest.raises(TraceError, match=r"changes its attribute 'first_batch' \(None -> a size of its inputs\)"):
        autoshard.shard_model(ScaledByItsFirstBatch(), 2, example_inputs=(torch.randn(2, 8),), pipeline=pipeline)
    model = Around(ScaledByItsFirstBatch(), 8)
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=pipeline)
    assert [w.name for w in sharded.plan.wrapped] == ["inner"]  # kept whole: it keeps its own state
    for batch in (5, 3):
        x = torch.randn(batch, 8)
        assert torch.equal(sharded(x), twin(x))


class TracksItsDepth(nn.Module):
    """Moves a number up and back down within each call (a nesting depth): it ends each call as it began."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.depth = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * (self.depth + 1)
        self.depth += 1
        h = self.b(torch.relu(h))
        self.depth -= 1
        return h


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_a_number_the_top_level_forward_moves_and_sets_back_is_served_by_one_plan(front_end):
    """Its first write alone was written back: each call left 1 more, and the next took another path."""
    model = TracksItsDepth()
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    serves_like(sharded, twin, 3)
    assert model.depth == 0 and sharded.specializations == ()


class CountsAtTheTop(CallCounter):
    """``CallCounter``'s count and warm-up in a forward of two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(super().forward(x)))


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_a_top_level_forward_counting_calls_is_refused_not_frozen(front_end):
    """A count there would take a capture per call (each one's call writes the next value back), so
    verification refuses it, saying where a count serves."""
    model = CountsAtTheTop()
    with pytest.raises(TraceError, match="changes its attribute 'calls' on every call.*count outside the forward"):
        autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                              pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    assert model.calls == 0


class WarnsOnce(nn.Module):
    """Sets a flag on its first call, in its top-level forward (a warning given once), which nothing
    can keep whole: it was refused, so no plan served the model at all."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.warned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.warned:
            h = h * 2  # (the first call differs: the flag's path is in the graph)
            self.warned = True
        return self.b(torch.relu(h))


class WarmsUp(WarnsOnce):
    """Sets its flag twice in its first call: the value written last is the one its next call reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.warned is False:
            self.warned = "warming"
            h = h * 2
            self.warned = True
        return self.b(torch.relu(h))


@pytest.mark.parametrize("front_end", ["trace", "export"])
@pytest.mark.parametrize("kind", [WarnsOnce, WarmsUp])
def test_a_flag_the_top_level_forward_sets_once_is_written_back_and_the_next_call_captured_again(kind, front_end):
    model = kind()
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    assert model.warned is False  # the capture's runs were set back
    serves_like(sharded, twin, 4)  # the first call on the first plan, as the model's: then the flag is set
    assert model.warned is True  # (the last value written: WarmsUp's first write left "warming")
    (made,) = sharded.specializations  # the second call's, with the flag set; it serves the later ones
    assert "warned=True" in made.describe()
    if front_end == "trace":  # (export's stages call operators Python cannot pickle: refused anyway)
        with pytest.raises(PlanError, match="write warned back to the model on each call"):
            pickle.dumps(sharded)  # a copy watching no model would take the first call's path forever


class CalibratedOnce(nn.Module):
    """Sets a flag after its first call (a lazy calibration); ``check_in_forward`` false: the
    forward reads the flag and a helper method sets it, so the read is in the caller's code."""

    def __init__(self, check_in_forward: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.zeros(8))
        self.ready = False
        self.check_in_forward = check_in_forward

    def _calibrate(self, x: torch.Tensor) -> None:
        self.shift.copy_(x.mean(0))
        self.ready = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check_in_forward:
            if not self.ready:
                self.shift.copy_(x.mean(0))
                self.ready = True
        elif not self.ready:
            self._calibrate(x)
        return self.lin(x - self.shift)


@pytest.mark.parametrize("check_in_forward", [True, False])
def test_a_flag_a_module_sets_once_is_state_and_keeps_it_whole(check_in_forward):
    model = Around(CalibratedOnce(check_in_forward), 8)
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert model.inner.ready is False  # the capture's runs of the model were set back
    assert [w.name for w in sharded.plan.wrapped] == ["inner"]
    assert "changes its attribute 'ready' (False -> True)" in sharded.plan.wrapped[0].reason
    serves_like(sharded, twin, 3)  # the first call calibrates, the later ones use the stored shift


class Warmed(nn.Module):
    """State a run leaves that the capture must set back: a mode leaving None (read first, so
    kept whole), a plain tensor attribute counted in place, an attribute deleted."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mode = None
        self.seen = torch.zeros(())
        self.spare = 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if hasattr(self, "spare"):
            del self.spare
        if self.mode is None:
            self.mode = "warm"
            return self.lin(x) * 2
        return self.lin(x)


def test_a_mode_leaving_none_is_state_and_the_capture_sets_every_change_back():
    model = Around(Warmed(), 8)
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert [w.name for w in sharded.plan.wrapped] == ["inner"]
    assert model.inner.mode is None and model.inner.seen.item() == 0 and model.inner.spare == 3.0
    serves_like(sharded, twin, 2)


class FlagByName(nn.Module):
    """Reads its flag with getattr and sets it with setattr, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ready = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "ready"):
            setattr(self, "ready", True)
            return self.lin(x) * 2
        return self.lin(x)


class FlagBehindProperty(nn.Module):
    """Reads and sets ``ready``, a property over ``_ready``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ready:
            self.ready = True
            return self.lin(x) * 2
        return self.lin(x)


class WarmedByChildren(nn.Module):
    """Sets a flag after its children ran, which they read (``self.parent.warm``) on their next call."""

    class Child(nn.Module):
        def __init__(self, parent: nn.Module) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.__dict__["parent"] = parent  # not a child module: a plain reference

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * (1 if self.parent.warm else 3)

    def __init__(self) -> None:
        super().__init__()
        self.kids = nn.ModuleList([self.Child(self) for _ in range(2)])
        self.warm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for kid in self.kids:
            x = kid(x)
        self.warm = True
        return x


@pytest.mark.parametrize("inner", [FlagByName, FlagBehindProperty, WarmedByChildren])
def test_flags_read_by_name_behind_a_property_or_by_children_are_state(inner):
    model = Around(inner(), 8)
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert [w.name for w in sharded.plan.wrapped] == ["inner"]
    serves_like(sharded, twin, 3)


def test_a_top_level_flag_read_by_children_is_served_not_frozen_by_the_front_end_that_misses_it():
    """fx sees the children read the flag, so each call its plan serves writes it back, and the next
    takes the other path; export does not, and its capture must not be kept."""
    model = WarmedByChildren()
    twin = copy.deepcopy(model)
    with pytest.raises(VerificationError, match="second call on the example differs"):
        autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                              pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert model.warm is False
    serves_like(sharded, twin, 3)
    assert model.warm is True and len(sharded.specializations) == 1


class ScratchMultiplier(nn.Module):
    """Funnel's pattern: a number set afresh on every call, then updated within it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mult = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mult = 1
        h = self.lin(x)
        self.mult *= 2
        return h * self.mult


def test_a_number_a_forward_sets_afresh_before_updating_it_is_no_state():
    model = Around(ScratchMultiplier(), 8)
    model(torch.randn(2, 8))  # run before sharding: the number is left at 2
    result = trace_with_leaves(model, (torch.randn(2, 8),))
    assert result.wrapped == ()
    x = torch.randn(3, 8)
    assert torch.equal(result.graph_module(x), model(x))


class StepCounter(nn.Module):
    """Counts its calls in a buffer, rebinding it (``self.steps += 1``), and scales by the count."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.second(self.first(x)) * self.steps


@pytest.mark.parametrize("nested, pipeline", [(True, None),
                                              (True, "trace,shape-prop,build-dag,linearize,split,emit,verify"),
                                              (False, None)])
def test_a_forward_that_rebinds_a_buffer_keeps_counting_when_sharded(nested, pipeline):
    model = Around(StepCounter(), 8) if nested else StepCounter()
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=pipeline)
    assert all(isinstance(b, torch.Tensor) and not isinstance(b, fx.Proxy) for b in model.buffers())
    assert [float(b) for b in model.buffers()] == [0.0]  # capture and verify left the count alone
    if nested:  # fx keeps the counting block whole (auto then takes export, which keeps the write)
        wrapped = trace_with_leaves(model, (torch.randn(2, 8),)).wrapped
        assert [w.name for w in wrapped] == ["inner"] and "buffer 'steps'" in wrapped[0].reason
    serves_like(sharded, twin, 3)


class RunningOffset(nn.Module):
    """Adds its previous output to this one's, keeping it on itself for the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.previous: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.previous is not None:
            y = y + self.previous
        self.previous = y.detach()
        return y


def test_a_tensor_a_forward_keeps_for_its_next_call_keeps_its_module_whole():
    model = nn.Sequential(nn.Linear(8, 8), RunningOffset(), nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert model[1].previous is None  # capture and verify ran it, and set its state back
    assert [w.name for w in sharded.plan.wrapped] == ["1"]
    assert "attribute 'previous'" in sharded.plan.wrapped[0].reason
    serves_like(sharded, twin, 3, batch=2)


class Recurrence(nn.Module):
    """Starts from the state it kept, unless reset (RecurrentGemma's rg_lru); kept whole: it branches
    on values."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(x) if self.state is None else self.gate(x) + self.state
        h = torch.tanh(h) if h.sum() > 0 else h
        self.state = h
        return h


class ResetsItsRecurrence(nn.Module):
    """Resets the state of a child the graph calls whole, as RecurrentGemma's temporal block does
    with use_cache=False: a write the graph does not replay."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = Recurrence(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rnn.state = None
        return self.out(self.rnn(x))


@pytest.mark.parametrize("front_end", ["capture", "export"])
def test_a_write_onto_a_module_the_graph_calls_whole_keeps_the_writer_whole(front_end):
    """The reset was traced and dropped: the second call started from the first call's state (values
    off, and a backward through the first call's freed graph; under export, verification refused it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ResetsItsRecurrence(), nn.Linear(8, 8), ResetsItsRecurrence())
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    reasons = {w.name: w.reason for w in sharded.plan.wrapped}
    assert list(reasons) == ["1.rnn", "1", "3.rnn", "3"]
    assert "sets 'state' on a Recurrence the graph calls whole" in reasons["1"] and "calls whole" in reasons["3"]
    for _ in range(2):  # training steps: the second backward reached the first call's freed graph
        x = torch.randn(2, 8)
        assert torch.equal(sharded(x), model(x))
        sharded(x).sum().backward()


def flip_if_negative(x: torch.Tensor) -> torch.Tensor:
    return -x if x.sum() < 0 else x


class ReceiverNamedS(nn.Module):
    def __init__(s) -> None:  # noqa: N805 - a method's receiver need not be called self
        super().__init__()
        s.lin = nn.Linear(3, 3)

    def forward(s, x: torch.Tensor) -> torch.Tensor:  # noqa: N805
        return s.lin(flip_if_negative(x))


def test_the_function_kept_whole_is_found_whatever_the_forward_calls_its_receiver():
    model = ReceiverNamedS()
    result = trace_with_leaves(model, (torch.ones(2, 3),))
    assert [(w.kind, w.name) for w in result.wrapped] == [("function", f"{__name__}.flip_if_negative")]
    for x in (torch.ones(4, 3), -torch.ones(4, 3)):
        assert torch.equal(result.graph_module(x), model(x))


class CachesByBatchSize(nn.Module):
    """Keeps a dict of constants keyed by batch size, filled in place (the trace keys it by a Proxy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.offsets: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[0]
        if size not in self.offsets:
            self.offsets[size] = torch.arange(8.0)
        return self.lin(x) + self.offsets[size]


def test_a_cache_the_trace_filled_is_given_back_without_trace_values():
    model = CachesByBatchSize()
    with module_state_restored(model):
        trace_with_leaves(model, (torch.randn(2, 8),))
    assert model.offsets == {}
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert not any(isinstance(key, fx.Proxy) for key in model.offsets)
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x), model(x))


class _Cache:
    """A key/value cache a forward makes and fills, as Hugging Face's ``DynamicCache``."""

    def __init__(self) -> None:
        self.layers: list[dict] = [{"keys": None}]

    def update(self, keys: torch.Tensor) -> torch.Tensor:
        self.layers[0]["keys"] = keys if self.layers[0]["keys"] is None else torch.cat([self.layers[0]["keys"], keys])
        return self.layers[0]["keys"]


class MakesACache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Cache]:
        cache = _Cache()
        cache.update(self.lin(x))
        return self.out(cache.update(x)), cache


def test_an_object_the_forward_made_and_returned_is_refused_without_verification():
    """The graph kept the cache as a constant whose trace values were cleared: a plan made without the
    verify pass returned it emptied, the same object on every call."""
    x = torch.randn(2, 8)
    pipeline = "capture,shape-prop,build-dag,linearize,split{stages=2},emit"
    with pytest.raises(TraceError, match="MakesACache returns a _Cache holding values its forward computed"):
        autoshard.shard_model(MakesACache(), 2, example_inputs=(x,), pipeline=pipeline)


class Segments(nn.Module):
    """torchvision's segmentation models return an ``OrderedDict``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        result = collections.OrderedDict()
        result["out"] = self.a(x)
        result["aux"] = self.b(x)
        return result


def test_an_ordered_dict_output_stays_an_ordered_dict():
    sharded = autoshard.shard_model(Segments(), 2, example_inputs=(torch.randn(2, 3),),
                                    pipeline="trace,shape-prop,build-dag,linearize,split,emit,verify")
    out = sharded(torch.randn(4, 3))
    assert type(out) is collections.OrderedDict and list(out) == ["out", "aux"]


def fill_window(window: list[int], sizes: list[int]) -> list[int]:
    """Writes into the list it is given, as torchvision's video Swin does with its window size."""
    for i, size in enumerate(sizes):
        window[i] = min(window[i], size)
    return window


torch.fx.wrap("fill_window")


class FillsAList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        window = fill_window([8, 8], [x.shape[0], x.shape[1]])
        return self.lin(x) * window[0]


def test_a_function_that_fills_the_list_it_is_given_runs_in_every_pass():
    model = FillsAList()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(3, 4),),
                                    pipeline="trace,shape-prop,build-dag,linearize,profile,split,emit,verify")
    x = torch.randn(5, 4)
    assert torch.equal(sharded(x), model(x))


class ScaledBySize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        scale = torch.sqrt(torch.tensor(h.shape[-1], dtype=torch.float32))
        return self.b(h / scale) * torch.tensor([x.shape[0], 2.0]).sum()


def test_a_tensor_made_from_a_size_is_a_node_that_follows_the_size():
    model = ScaledBySize()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline="trace,shape-prop,build-dag,linearize,split,emit,verify")
    assert sharded.plan.wrapped == ()
    x = torch.randn(5, 8)  # another batch size: torch.tensor([5, 2.0]), not the example's [2, 2.0]
    assert torch.equal(sharded(x), model(x))


class MaskOfSizes(nn.Module):
    """Makes a tensor from its input's sizes passed one by one, as a decoder makes its default mask with
    ``torch.ones(batch_size, seq_length)``: torch refused the proxies before fx saw the call."""

    def __init__(self, constructor: str) -> None:
        super().__init__()
        self.constructor = constructor
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[:2]
        made = getattr(torch, self.constructor)(batch, length, device=x.device)
        if self.constructor == "empty":
            made.fill_(1.0)
        return self.b(self.a(x) * made[..., None])


@pytest.mark.parametrize("constructor", ["ones", "zeros", "empty", "rand", "randn"])
def test_a_tensor_made_from_sizes_passed_one_by_one_is_traced_not_kept_whole(constructor):
    torch.manual_seed(0)
    model = MaskOfSizes(constructor)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 3, 4),),
                                    pipeline="trace,shape-prop,build-dag,linearize,split,emit,verify")
    assert sharded.plan.wrapped == ()  # before: refused (code in the top-level forward fx cannot trace)
    x = torch.randn(3, 5, 4)  # other sizes, which the stages make their tensor of
    torch.manual_seed(1)
    got = sharded(x)
    torch.manual_seed(1)
    assert torch.equal(got, model(x))


class Pyramid(nn.Module):
    """RAFT's correlation block: one method fills an attribute, another reads it, same call."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: list[torch.Tensor] = [torch.tensor(0)]

    def build(self, x: torch.Tensor) -> None:
        self.levels = [x]
        self.levels.append(F.avg_pool1d(x.unsqueeze(1), 2).squeeze(1))

    def read(self) -> torch.Tensor:
        return torch.cat(self.levels, dim=-1)


class UsesAPyramid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.pyramid, self.b = nn.Linear(8, 8), Pyramid(), nn.Linear(12, 4)

    def forward(self, x):
        self.pyramid.build(self.a(x))
        return self.b(self.pyramid.read())


@pytest.mark.parametrize("pipeline", ["trace,shape-prop,build-dag,linearize,split,emit,verify",
                                      "export,shape-prop,build-dag,linearize,split,emit,verify"], ids=["fx", "export"])
def test_a_scratch_attribute_filled_before_it_is_read_is_captured(pipeline):
    model = UsesAPyramid()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=pipeline)
    assert sharded.plan.wrapped == ()
    assert len(model.pyramid.levels) == 1 and torch.equal(model.pyramid.levels[0], torch.tensor(0))
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x), model(x))


class RunningSum(nn.Module):
    """Like ``RunningOffset`` but starting from a tensor: the read before the write is an operation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.previous = torch.zeros(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + self.previous
        self.previous = y.detach().mean(0)
        return y


def test_an_attribute_read_before_it_is_written_is_state_even_when_it_held_a_tensor():
    model = nn.Sequential(nn.Linear(8, 8), RunningSum(), nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert [w.name for w in sharded.plan.wrapped] == ["1"]
    serves_like(sharded, twin, 3, batch=2)


def default(value, fallback):
    """x-transformers' helper: a callable fallback is called, anything else returned."""
    if value is not None:
        return value
    return fallback() if callable(fallback) else fallback


class KeysDefaultToQueries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, context=None):
        return self.q(x) * self.k(default(context, x))


def test_callable_answers_for_a_traced_tensor_from_its_example():
    model = KeysDefaultToQueries()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 4),),
                                    pipeline="trace,shape-prop,build-dag,linearize,split,emit,verify")
    assert sharded.plan.wrapped == ()
    x = torch.randn(3, 4)
    assert torch.equal(sharded(x), model(x))


class CachedBias(nn.Module):
    """x-transformers' ALiBi: computes a bias table for the sequence length and keeps it as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", None, persistent=False)

    def forward(self, x):
        n = x.shape[-1]
        if self.bias is not None and self.bias.shape[-1] >= n:
            return x + self.bias[..., :n]
        bias = torch.arange(n, dtype=x.dtype).neg()
        self.register_buffer("bias", bias, persistent=False)
        return x + self.bias


@pytest.mark.parametrize("pipeline", ["trace,shape-prop,build-dag,linearize,split,emit,verify",
                                      "export,shape-prop,build-dag,linearize,split,emit,verify"], ids=["fx", "export"])
def test_a_cache_registered_as_a_buffer_keeps_its_module_whole_and_leaves_the_model_as_it_was(pipeline):
    model = nn.Sequential(nn.Linear(6, 6), CachedBias(), nn.Linear(6, 6))
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 6),), pipeline=pipeline)
    assert [w.name for w in sharded.plan.wrapped] == ["1"]
    assert model[1].bias is None and "bias" not in model[1].state_dict()
    x = torch.randn(3, 6)
    assert torch.equal(sharded(x), model(x))


class ChecksSizesWithNumpy(nn.Module):
    """MONAI's SwinUNETR checks its input's spatial sizes with numpy at the top of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        if (np.array(x.shape[1:]) % 4 > 0).any():
            raise ValueError("sizes must be multiples of 4")
        return self.b(self.a(x))


def test_numpy_arithmetic_on_sizes_traces_and_its_condition_is_guarded():
    model = ChecksSizesWithNumpy()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 4, 8),), respecialize=False,
                                    pipeline="trace,shape-prop,build-dag,linearize,split,emit,verify")
    assert sharded.plan.wrapped == ()
    x = torch.randn(3, 12, 8)
    assert torch.equal(sharded(x), model(x))
    with pytest.raises(InputMismatchError, match="is True for these inputs"):
        sharded(torch.randn(3, 6, 8))


class StepsOverTheSequence(nn.Module):
    """A Python loop over the sequence (RWKV, Mamba's slow path) and a size rounded up to a window
    with ``math.ceil`` (Swin): both turn a size into a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        state = torch.zeros_like(x[:, 0])
        for step in range(x.shape[1]):
            state = torch.tanh(self.cell(state) + x[:, step])
        padded = int(math.ceil(x.shape[1] / 4)) * 4
        return self.head(state) * padded


def test_without_pins_a_size_turned_into_a_number_names_the_option_that_pins_it():
    with pytest.raises(TraceError, match="SizeToNumber: .*pin_sizes"):
        trace_with_leaves(StepsOverTheSequence(), (torch.randn(2, 3, 4),))


def test_pinned_sizes_trace_the_loop_and_refuse_another_length_but_serve_another_batch():
    model = StepsOverTheSequence()
    result = trace_with_leaves(model, (torch.randn(2, 3, 4),), pin_sizes=True)
    assert result.wrapped == ()
    assert any("turns into a number is 3" in s for s in result.specialized)
    x = torch.randn(5, 3, 4)
    assert torch.equal(result.graph_module(x), model(x))
    with pytest.raises(InputMismatchError, match=r"the code at test_capture_fx.py:\d+ \(`for step in range\(x.shape"
                                                 r"\[1\]\):`\) turns a size into a Python number, which fixed it to 3"):
        result.graph_module(torch.randn(2, 4, 4))


class StepsInAChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.steps, self.out = StepsOverTheSequence(), nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.steps(x))


@pytest.mark.parametrize("model, advice", [
    (StepsOverTheSequence(), "move that code into a submodule"),  # the top level: no front end keeps it whole
    (StepsInAChild(), "keep that code whole and the size free"),
])
def test_a_pinned_size_advises_only_what_serves_other_sizes(model, advice):
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 3, 4),), respecialize=False)
    with pytest.raises(InputMismatchError, match=f"{advice}.*pipeline='{FREE_SIZES_PIPELINE}'"):
        sharded(torch.randn(2, 4, 4))
    if isinstance(model, StepsInAChild):  # the advice works
        x = torch.randn(2, 4, 4)
        freed = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 3, 4),), pipeline=FREE_SIZES_PIPELINE)
        assert torch.equal(freed(x), model(x))


def test_auto_pins_sizes_with_fx_before_it_tries_export():
    result = capture(StepsOverTheSequence(), (torch.randn(2, 3, 4),))
    assert result.front_end == "fx" and result.wrapped == ()
    assert [c.split(":")[0] for c in result.considered] == ["fx", "fx with sizes pinned"]


class CountsFrames(nn.Module):
    """EnCodec's decode: ``len()`` of a tensor and a loop over it, its first size as a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, frames):
        if len(frames) != 1:
            raise ValueError("expected one frame")
        return sum(self.lin(frame) for frame in frames)


def test_len_of_a_traced_tensor_and_a_loop_over_it_are_pinned_where_sizes_are_pinned():
    model = CountsFrames()
    with pytest.raises(TraceError, match="SizeToNumber: len"):
        trace_with_leaves(model, (torch.randn(1, 3, 4),))
    result = trace_with_leaves(model, (torch.randn(1, 3, 4),), pin_sizes=True)
    assert result.wrapped == ()
    x = torch.randn(1, 5, 4)
    assert torch.equal(result.graph_module(x), model(x))
    with pytest.raises(InputMismatchError, match="fixed it to 1"):
        result.graph_module(torch.randn(2, 5, 4))


class RenormalisedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)`` rewrites the rows it looks up in place on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16, max_norm=1.0), nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_weights_a_forward_rewrites_are_set_back_after_the_captures_runs():
    torch.manual_seed(0)
    model = RenormalisedEmbedding()
    twin = copy.deepcopy(model)
    before = model_fingerprint(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randint(0, 50, (2, 5)),))
    assert_same_fingerprint(before, model_fingerprint(model))
    ids = torch.randint(0, 50, (3, 7))
    assert torch.equal(sharded(ids), twin(ids))
    assert torch.equal(model.embed.weight, twin.embed.weight)  # each renormalised the same rows once


def test_a_hooks_counter_on_a_module_is_set_back_after_the_captures_runs():
    model = Around(nn.Linear(8, 8), 8)
    model.inner.calls = 0

    def count(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        module.calls += 1

    model.inner.register_forward_hook(count)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    assert model.inner.calls == 0
    sharded(torch.randn(3, 8))
    assert model.inner.calls == 1  # the leaf runs with its hook in the stage


def test_a_hooked_module_split_across_stages_runs_its_hook_once_a_call_and_trains_like_the_model():
    """Traced through (``trace_hooks``), a module with a forward hook is split like any other: the
    hook runs after the module's body, in the stage holding its output, once per call, on the real
    values, and what it returns counts."""
    model = Around(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), 8)
    seen: list[torch.Tensor] = []
    model.inner.register_forward_hook(lambda module, args, out: seen.append(out.detach()) or out * 2)
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
    assert len({j for path, stages in holders(sharded).items() if path.startswith("inner.") for j in stages}) > 1
    x = torch.randn(3, 8)
    seen.clear()
    got, want = sharded(x), model(x)
    assert torch.equal(got, want) and len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got.sum(), list(model.parameters())),
                                                 torch.autograd.grad(want.sum(), list(model.parameters()))))


class Redrawer(nn.Module):
    """performer-pytorch's projection updater: its parent calls a method of it, not its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.tensor(0))

    def maybe_redraw(self) -> None:
        if self.calls >= 1000:  # a condition on a tensor's value
            self.calls.zero_()


class RedrawingBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.updater, self.layers = Redrawer(), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.updater.maybe_redraw()
        return self.layers(x)


def test_code_failing_in_a_childs_method_keeps_the_caller_whole_when_the_child_cannot_be():
    model = Around(RedrawingBody(), 8)
    result = trace_with_leaves(model, (torch.randn(2, 8),))
    assert [w.name for w in result.wrapped] == ["inner.updater", "inner"]
    x = torch.randn(3, 8)
    assert torch.equal(result.graph_module(x), model(x))


class LossBuiltInForward(nn.Module):
    """Builds its loss module on the spot, as Hugging Face heads do with ``CrossEntropyLoss()``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.CrossEntropyLoss()(self.last(self.first(x)), labels)


def test_a_module_built_in_forward_is_traced_through():
    model, x, labels = LossBuiltInForward(), torch.randn(3, 4), torch.tensor([0, 4, 2])
    result = trace_with_leaves(model, (x, labels))
    assert not result.wrapped
    assert any(n.target is F.cross_entropy for n in result.graph_module.graph.nodes)
    assert torch.equal(result.graph_module(2 * x, labels), model(2 * x, labels))


class WeightedLossInForward(nn.Module):
    """Builds a class-weighted loss on the spot from its buffer: ``CrossEntropyLoss(weight=...)``
    registers the weight as a buffer of the new module while the forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("class_weights", torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.CrossEntropyLoss(weight=self.class_weights)(self.last(torch.relu(self.first(x))), labels)


def test_a_loss_built_in_forward_with_class_weights_is_no_state_write():
    """Its constructor storing the weight is no state a later call reads: before, every front end
    refused it as a state write of the top-level forward, so nothing captured the model."""
    torch.manual_seed(0)
    model, x, labels = WeightedLossInForward(), torch.randn(3, 4), torch.tensor([0, 2, 1])
    sharded = autoshard.shard_model(model, 2, example_kwargs={"x": x, "labels": labels})
    later_x, later_labels = torch.randn(5, 4), torch.tensor([2, 2, 0, 1, 0])
    assert torch.equal(sharded(x=later_x, labels=later_labels), model(later_x, later_labels))
    sharded(x=later_x, labels=later_labels).backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(later_x, later_labels).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ours, model.parameters()))


class Settings:
    """A settings object a model keeps, like a Hugging Face config."""

    def __init__(self) -> None:
        self.problem_type: str | None = None


class FillsItsSettings(nn.Module):
    """Fills in ``config.problem_type`` from its labels on its first call, as Hugging Face
    sequence-classification heads do."""

    def __init__(self) -> None:
        super().__init__()
        self.config, self.linear = Settings(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "single" if labels.dtype == torch.long else "multi"
        logits = self.linear(x)
        if self.config.problem_type == "single":
            return F.cross_entropy(logits, labels)
        return F.binary_cross_entropy_with_logits(logits, labels)


def test_sharding_leaves_the_settings_a_model_keeps_as_they_were():
    """Sharding runs and traces the model, but the user has not called it: the next call of the
    model must take the path a fresh copy takes, not the one the example fixed. The setting the
    model's own call then fills in is one the stages' code read: they capture the model again."""
    model = FillsItsSettings()
    sharded = autoshard.shard_model(model, 2, example_kwargs={"x": torch.randn(2, 4), "labels": torch.tensor([0, 2])})
    assert model.config.problem_type is None
    multi_hot = torch.tensor([[1.0, 0.0, 1.0]])
    expected = model(torch.ones(1, 4), multi_hot)
    assert torch.equal(expected, F.binary_cross_entropy_with_logits(model.linear(torch.ones(1, 4)), multi_hot))
    assert torch.equal(sharded(x=torch.ones(1, 4), labels=multi_hot), expected)
    assert "config.problem_type='multi'" in sharded.specializations[0].describe()


class KeepsALog(nn.Module):
    """Notes each call in a list, a dict and a set of its own, and counts the rows it saw on the
    top-level module: bookkeeping no graph replays."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 3)
        self.sizes, self.by_call, self.seen_sizes, self.rows = [7], {}, set(), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        self.by_call[len(self.by_call)] = x.shape[0]
        self.seen_sizes.add(x.dim())
        self.rows += x.shape[0]
        return self.last(torch.relu(self.first(x)))


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_sharding_leaves_the_lists_a_forward_appends_to_as_they_were_and_warns_the_stages_do_not(front_end):
    """The capture's runs of the model appended to its log (eight entries after sharding, from a user
    who had not called it yet); the stages do not append at all, which only a warning can say."""
    model, x = KeepsALog(), torch.randn(2, 4)
    # (a set given the same item again is not a change: nor is a size set anew, a cache filled once)
    written = r"changes KeepsALog\.by_call, KeepsALog\.rows, KeepsALog\.sizes on every call"
    with pytest.warns(autoshard.StateNotReplayedWarning, match=written):
        sharded = autoshard.shard_model(model, 2, example_inputs=(x,),
                                        pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    assert (model.sizes, model.by_call, model.seen_sizes, model.rows) == ([7], {}, set(), 0)
    assert torch.equal(sharded(x), model(x))
    assert model.sizes == [7, 2]  # the model's own call only


class CopiesIntoABuffer(nn.Module):
    """Writes a value that requires grad into a buffer in place, as an EMA kept without no_grad does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("last_gate", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_gate.copy_(torch.sigmoid(self.gate(x)))
        return self.out(x)


def test_a_buffer_written_with_a_value_requiring_grad_is_left_without_the_captures_autograd_graph():
    """Its values were set back, but it kept the verification's autograd graph (and the activations
    that graph saved), and required grad, on a model the user had not called."""
    model = CopiesIntoABuffer().train()
    # (and the model leaks: each call's graph holds the last, through the buffer; the user is told)
    with pytest.warns(autoshard.GraphInBufferWarning, match="requires grad into its buffer last_gate in place"):
        sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 4),))
    assert model.last_gate.grad_fn is None and not model.last_gate.requires_grad
    assert torch.equal(model.last_gate, torch.zeros(2, 4))
    x = torch.randn(2, 4)
    twin = copy.deepcopy(model)
    assert torch.equal(sharded(x), twin(x)) and torch.equal(model.last_gate, twin.last_gate)


class KeepsStateInOtherShapes(nn.Module):
    """A log rebound to a longer list, a deque, a list inside a dict, a list made on the first call, a
    size kept in a dict (the same value on every call), and the handle of a hook its first call
    installs on a child."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 3)
        self.rebound, self.recent, self.stats, self.sizes = [], collections.deque(maxlen=3), {"seen": []}, {}
        self.handles: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rebound = self.rebound + [x.dim()]
        self.recent.append(x.dim())
        self.stats["seen"].append(x.shape[0])
        self.sizes["rows"] = x.shape[0] * 1000  # (a large int: a new object each call, equal to the last)
        if not hasattr(self, "made_late"):
            self.made_late: list[int] = []
        self.made_late.append(x.dim())
        if not self.handles:
            self.handles.append(self.first.register_forward_hook(lambda module, args, out: out * 2))
        return self.last(torch.relu(self.first(x)))


def test_state_kept_in_other_shapes_is_set_back_and_a_hook_installed_once_keeps_its_handle():
    """Set back, the list of handles lost the hook the first run installed, which stayed: every run of
    the capture installed one more (eight after sharding), doubling the output each time. A nested
    list kept a trace value (an fx Proxy) on the model."""
    model, x = KeepsStateInOtherShapes(), torch.randn(2, 4)
    fresh = copy.deepcopy(model)
    with pytest.warns(autoshard.StateNotReplayedWarning) as seen:
        sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
    (message,) = {str(w.message) for w in seen if w.category is autoshard.StateNotReplayedWarning}
    assert "KeepsStateInOtherShapes.made_late, KeepsStateInOtherShapes.rebound, KeepsStateInOtherShapes.recent, " \
           "KeepsStateInOtherShapes.stats on every call" in message  # not the size, set to an equal value
    assert model.rebound == [] and list(model.recent) == [] and model.stats == {"seen": []} and model.sizes == {}
    assert not hasattr(model, "made_late")
    assert len(model.handles) == 1 and len(model.first._forward_hooks) == 1
    expected = fresh(x)
    assert torch.equal(model(x), expected) and torch.equal(sharded(x), expected)
    assert len(model.first._forward_hooks) == 1


def test_hooks_a_forward_installs_on_its_first_call_stay_installed():
    """Hugging Face installs its output recorders' hooks on the first call asking for hidden states
    and marks the model so; taking the hooks back after the capture's runs left the mark and lost
    the hidden states of every later call of the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50)
    model, ids = transformers.BertModel(config).eval(), torch.randint(0, 50, (2, 6))
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids,), example_kwargs={"output_hidden_states": True})
    expected = model(ids, output_hidden_states=True)
    assert len(expected.hidden_states) == 3
    got = sharded(ids, output_hidden_states=True)
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, expected.hidden_states, strict=True))


class DropoutInAList(nn.Module):
    """Keeps a dropout in a plain list: not a submodule, so the model's eval() never reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)
        self.extras = [nn.Dropout(0.5)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.extras[0](torch.relu(self.first(x))))


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_a_module_outside_the_module_tree_is_traced_through_and_its_mode_watched(front_end):
    """Its dropout was fixed to the capture's mode: switched to eval afterwards, the stages went on
    dropping while the model did not, silently."""
    model, x = DropoutInAList().train(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,),
                                    pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    torch.manual_seed(1)
    got = sharded(x)
    torch.manual_seed(1)
    assert torch.equal(got, model(x))
    model.extras[0].eval()
    with pytest.raises(InputMismatchError, match="a Dropout the model keeps outside its module tree .* was in "
                                                 "train mode when the plan was captured and is in eval mode now"):
        sharded(x)
    with pytest.raises(InputMismatchError, match="outside its module tree"):
        copy.deepcopy(sharded)(x)  # a copy watches the same module
    model.extras[0].train()
    torch.manual_seed(2)
    got = sharded(x)
    torch.manual_seed(2)
    assert torch.equal(got, model(x))


class _CheckpointedBlocks(nn.Module):
    """Blocks each called through ``torch.utils.checkpoint``, or a block kept whole that checkpoints inside."""

    def __init__(self, use_reentrant: bool | None, inside_a_leaf: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(3))
        self.use_reentrant, self.inside_a_leaf = use_reentrant, inside_a_leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.use_reentrant is None:
                x = block(x)
            elif self.inside_a_leaf and x.sum() > -1e9:  # a branch on values: this forward is kept whole
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x


class _Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool | None, inside_a_leaf: bool = False) -> None:
        super().__init__()
        self.inner = _CheckpointedBlocks(use_reentrant, inside_a_leaf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_models_own_checkpoint_traced_through_is_said_with_its_call_site(use_reentrant):
    """The stages run checkpointed code plainly, holding what the checkpoint would recompute: a user
    who checkpoints to fit is told, with the way to recompute in a pipeline."""
    with pytest.warns(autoshard.CheckpointTracedWarning) as warned:
        sharded = autoshard.shard_model(_Checkpointed(use_reentrant).train(), 2,
                                        example_inputs=(torch.randn(4, 8, requires_grad=True),))
    (message,) = {str(w.message) for w in warned if w.category is autoshard.CheckpointTracedWarning}
    assert "_Checkpointed calls torch.utils.checkpoint (test_capture_fx.py:" in message
    assert "x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)" in message
    assert "activation_checkpointing=True" in message
    assert len(sharded.stages) == 2


@pytest.mark.parametrize("model", [_Checkpointed(None), _Checkpointed(False, inside_a_leaf=True)],
                         ids=["no checkpoint", "inside a module kept whole"])
def test_no_checkpoint_traced_through_is_no_warning(model):
    """A module kept whole runs its checkpoint as written, at every call of its stage."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.CheckpointTracedWarning)
        sharded = autoshard.shard_model(model.train(), 2, example_inputs=(torch.randn(4, 8, requires_grad=True),))
    if model.inner.inside_a_leaf:
        assert "inner" in {w.name for w in sharded.plan.wrapped}


def _deep_block(width: int = 8) -> nn.Sequential:
    """Three linears: a block a plan of up to 5 stages may cut inside."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width))


def test_what_a_traced_through_modules_hook_writes_on_it_is_set_back_after_the_captures_runs():
    """The hook runs in a node after the body, on a module the graph does not hold as a submodule:
    the cost runs of the graph (FLOPs, saved activations) must set its state back as they set the
    graph's own, as they did when a hooked module was kept whole."""
    model = Around(_deep_block(), 8)
    model.inner.calls = 0
    model.inner.register_buffer("seen", torch.zeros(()))
    model.inner.outputs = []

    def count(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        module.calls += 1
        module.seen += 1
        module.outputs.append(output.detach())

    model.inner.register_forward_hook(count)
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
    assert (model.inner.calls, model.inner.seen.item()) == (0, 0.0)
    assert not [t for t in model.inner.outputs if not type(t) is torch.Tensor]  # no fake tensor left on it
    sharded(torch.randn(3, 8))
    assert (model.inner.calls, model.inner.seen.item()) == (1, 1.0)


def _same_step(sharded: nn.Module, model: nn.Module, x: torch.Tensor, seed: int = 0) -> bool:
    """The sharded model's output and every parameter's gradient equal the model's, each run from
    ``seed`` (dropout draws alike)."""
    params = list(model.parameters())
    torch.manual_seed(seed)
    got = sharded(x)
    got_grads = torch.autograd.grad(got.sum(), params)
    torch.manual_seed(seed)
    want = model(x)
    want_grads = torch.autograd.grad(want.sum(), params)
    return torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


@dataclasses.dataclass
class _Pair:
    first: torch.Tensor
    second: torch.Tensor


class _TwoOutputs(nn.Module):
    """A block returning two values as ``kind`` (tuple, dict or dataclass), read by its parent."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        first = self.b(torch.relu(self.a(x)))
        second = self.c(first)
        return {"tuple": (first, second), "dict": {"first": first, "second": second},
                "dataclass": _Pair(first, second)}[self.kind]


def _swapped(kind: str):
    """A hook returning a new output of the same kind, its two values swapped and changed."""
    def swap(module: nn.Module, args: tuple, out):
        if kind == "tuple":
            return out[1] * 2, out[0] - 1
        if kind == "dict":
            return {"first": out["second"] * 2, "second": out["first"] - 1}
        return _Pair(out.second * 2, out.first - 1)
    return swap


class _ReadsTwo(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner, self.out = _TwoOutputs(kind), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = self.inner(x)
        first, second = {"tuple": lambda: pair, "dict": lambda: (pair["first"], pair["second"]),
                         "dataclass": lambda: (pair.first, pair.second)}[self.inner.kind]()
        return self.out(first * second)


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_a_hooks_replacement_of_a_structured_output_serves_every_split_inside_the_module(kind):
    model = _ReadsTwo(kind)
    model.inner.register_forward_hook(_swapped(kind))
    for k in (2, 3, 4):
        sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
        assert _same_step(sharded, model, torch.randn(3, 8)), k
    assert len({j for path, stages in holders(sharded).items() if path.startswith("inner.") for j in stages}) > 1


def test_a_hook_writing_to_the_output_in_place_trains_like_the_model_with_the_cut_anywhere():
    model = Around(_deep_block(), 8)
    model.inner.register_forward_hook(lambda module, args, out: out.mul_(3))
    for k in (2, 3, 4, 5):
        sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
        assert _same_step(sharded, model, torch.randn(3, 8)), k


class _KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.b(torch.relu(self.a(x))) * scale
        return out if bias is None else out + bias


class _CallsWithKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = _KeywordBlock(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x, scale=2.0, bias=x))


def test_hooks_run_in_their_call_order_with_the_keyword_arguments_of_each_call():
    """Prepended, plain, with_kwargs and always_call hooks run as the module's call runs them, each
    seeing the real call's keyword arguments and the output the one before it returned."""
    model = _CallsWithKeywords()
    order: list[str] = []
    seen: list[tuple] = []

    def with_kwargs(module, args, kwargs, out):
        order.append("kwargs")
        seen.append((len(args), kwargs["scale"], torch.equal(kwargs["bias"], args[0])))
        return out + kwargs["bias"] * kwargs["scale"]

    model.inner.register_forward_hook(lambda module, args, out: order.append("plain") or out * 2)
    model.inner.register_forward_hook(with_kwargs, with_kwargs=True, always_call=True)
    model.inner.register_forward_hook(lambda module, args, out: order.append("first") or out - 3, prepend=True)
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
    assert len({j for path, stages in holders(sharded).items() if path.startswith("inner.") for j in stages}) > 1
    order.clear()
    seen.clear()
    assert _same_step(sharded, model, torch.randn(3, 8))
    assert order == ["first", "plain", "kwargs"] * 2 and seen == [(1, 2.0, True)] * 2


class _SharedBlock(nn.Module):
    """One hooked block called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.mid, self.out = _deep_block(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(self.mid(self.inner(x))))


def test_a_hooked_block_called_twice_and_a_hook_on_the_root_run_as_often_as_in_the_model():
    model = _SharedBlock()
    inputs_seen: list[torch.Tensor] = []
    root_calls: list[int] = []
    model.inner.register_forward_hook(lambda module, args, out: inputs_seen.append(args[0].detach()) or out + 1)
    model.register_forward_hook(lambda module, args, out: root_calls.append(1) or out * 5)
    x = torch.randn(3, 8)
    for k in (2, 4):
        sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
        inputs_seen.clear()
        root_calls.clear()
        got = sharded(x)
        in_sharded, root_in_sharded = inputs_seen[:], len(root_calls)
        inputs_seen.clear()
        assert torch.equal(got, model(x)) and root_in_sharded == 1
        assert len(in_sharded) == 2 and all(torch.equal(a, b) for a, b in zip(in_sharded, inputs_seen))


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_deep_block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + x
        return x


def test_hooks_on_a_module_lists_items_run_once_per_item_and_call_however_the_items_are_cut():
    model = _Layers()
    calls = collections.Counter()
    for index, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda module, args, out, index=index: calls.update([index]) or out * 0.5)
    for k in (2, 4, 5):
        sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
        calls.clear()
        assert _same_step(sharded, model, torch.randn(3, 8)), k
        assert calls == {0: 2, 1: 2, 2: 2}  # once in the sharded call, once in the model's


def test_dropout_inside_a_hooked_module_draws_as_the_model_does_in_training():
    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.drop = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.drop(torch.relu(self.b(self.drop(self.a(x))))))

    model = Around(Dropping(), 8).train()
    model.inner.register_forward_hook(lambda module, args, out: F.dropout(out, 0.2, module.training) + args[0])
    for k in (2, 3, 4, 5):
        sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(4, 8),), pipeline=HOOKS_TRACED)
        assert _same_step(sharded, model, torch.randn(5, 8), seed=k), k


def test_a_hook_added_or_removed_after_sharding_on_a_module_hooked_at_capture_is_run_or_not():
    model = Around(_deep_block(), 8)
    model.inner.register_forward_hook(lambda module, args, out: out + 1)
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),), pipeline=HOOKS_TRACED)
    x = torch.randn(3, 8)
    before = sharded(x)
    added = model.inner.register_forward_hook(lambda module, args, out: out * 7)
    assert torch.equal(sharded(x), model(x)) and not torch.equal(sharded(x), before)
    added.remove()
    assert torch.equal(sharded(x), before)


def test_a_saved_plan_of_a_hooked_model_rebuilds_stages_whose_hooks_run_once_a_call(tmp_path):
    model = Around(_deep_block(), 8)
    calls: list[int] = []
    model.inner.register_forward_hook(lambda module, args, out: calls.append(1) or out * 2)
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 3, example_inputs=(x,), pipeline=HOOKS_TRACED)
    again = autoshard.load_plan(sharded.save_plan(tmp_path / "plan.json"), model, (x,))
    assert holders(again) == holders(sharded)
    calls.clear()
    y = torch.randn(3, 8)
    assert torch.equal(again(y), model(y)) and len(calls) == 2


def test_the_export_front_end_runs_a_forward_hook_while_it_traces_only():
    """torch.export traces the hook into the graph: what it computes is kept, what it does as a
    side effect happens at capture (and is set back after it), not on each call (docs/concepts.md)."""
    model = Around(_deep_block(), 8)
    calls: list[int] = []
    model.inner.register_forward_hook(lambda module, args, out: calls.append(1) or out * 2)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline="export,build-dag,linearize,split,emit,verify")
    assert calls == []  # what it kept while export traced was set back
    x = torch.randn(3, 8)
    got = sharded(x)
    assert calls == []
    assert torch.equal(got, model(x)) and len(calls) == 1  # the model's call only


@pytest.mark.parametrize("hooked_after", [False, True])
def test_a_module_export_keeps_whole_for_a_backward_hook_runs_its_forward_hooks_once_a_call(hooked_after):
    """Its stand-in stood for its forward alone, so export traced its forward hook around it (once, on
    fake values: the list got symbolic sizes) and the stages' call of the module ran it again (the
    output doubled twice). Added after sharding, the hook captures again so."""
    model = Around(SignGate(), 8)
    model.inner.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))
    calls: list[Any] = []

    def record_and_double(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        calls.append(out)
        return out * 2

    if not hooked_after:
        model.inner.register_forward_hook(record_and_double)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline="export,build-dag,linearize,split,emit,verify")
    if hooked_after:
        model.inner.register_forward_hook(record_and_double)
        sharded(torch.randn(2, 8))  # captures again
    assert all(type(out) is torch.Tensor for out in calls)  # never a fake value
    calls.clear()
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x), model(x)) and len(calls) == 2
    assert torch.equal(calls[0], calls[1])


class RecordsWhatItCalls(nn.Module):
    """Returns what a forward hook of a module export keeps whole recorded (Transformers' output
    recorders fill a collector so)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = SignGate(), nn.Linear(8, 8)
        self.recorded: list[torch.Tensor] = []
        self.inner.register_forward_hook(lambda module, args, out: self.recorded.append(out))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.recorded.clear()
        return self.out(self.inner(x)), self.recorded[0]


def test_what_a_hook_of_a_module_export_keeps_whole_hands_the_forward_is_the_traced_value():
    """Run inside the stand-in, the hook recorded the stand-in's own run on zeros, which the graph
    kept as a constant (verification refused it)."""
    torch.manual_seed(0)
    model = RecordsWhatItCalls()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),),
                                    pipeline="export,build-dag,linearize,split,emit,verify")
    assert [w.name for w in sharded.plan.wrapped] == ["inner"]
    for batch in (2, 3):
        x = torch.randn(batch, 8)
        assert all(torch.equal(a, b) for a, b in zip(sharded(x), model(x)))


def test_a_hook_returning_its_output_adds_no_memory_and_each_stage_holds_what_the_plan_predicts():
    """The hook node's value is the body's output itself (a view of it, not new storage), so the
    prediction matches what each stage holds, cut inside hooked blocks or not."""
    from autoshard.runtime import measure_stage_memory

    model = _Layers()
    for layer in model.layers:
        layer.register_forward_hook(lambda module, args, out: out)
    x = torch.randn(64, 8)
    sharded = autoshard.shard_model(model, 5, example_inputs=(x,), pipeline=HOOKS_TRACED)
    hooks = [node for node, data in sharded.plan.dag.nodes(data=True) if "run_forward_hooks" in str(data["target"])]
    assert len(hooks) == 3 and all(sharded.plan.dag.nodes[node]["allocated"] == 0 for node in hooks)
    predicted = autoshard.plan_report(sharded, device=autoshard.DeviceModel(1e12, 1e12)).stages  # no calibration
    measured = [measure_stage_memory(sharded, j, (x,)).peak for j in range(5)]
    assert [stage.memory.total for stage in predicted] == measured


class _Holder:
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("holder", [types.SimpleNamespace, _Holder])
@pytest.mark.parametrize("with_example", [True, False])
def test_an_output_object_the_trace_cannot_rebuild_is_refused_even_unverified(holder, with_example):
    """fx keeps an object it does not rebuild (not a tuple, list, dict or dataclass) as a constant, and the
    trace values in it were cleared: the plan returned the same emptied object on every call."""

    class Returning(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return holder(value=self.b(self.a(x)))

    example = (torch.randn(2, 4),) if with_example else None
    with pytest.raises(TraceError, match=f"Returning returns a {holder.__name__} holding values its forward computed"
                                         ".*emptied.*return its tensors in tuples"):
        autoshard.shard_model(Returning(), 2, example_inputs=example, verify=False)


class _Outputs(tuple):
    pass


class _Named(dict):
    pass


class _Slotted(list):
    __slots__ = ()


class ReturnsContainerSubclasses(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.c(self.b(self.a(x)))
        outputs = _Outputs((y, y + 1))
        outputs.scaled = y * 3  # an attribute of its own, computed
        return _Named(outputs=outputs, slotted=_Slotted([y - 1]))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("with_example", [True, False])
def test_subclasses_of_tuple_list_and_dict_are_returned_as_themselves_with_their_attributes(verify, with_example):
    """fx rebuilt them as their bases, dropping the class and its attributes; without the verify pass the plan
    returned a plain dict of a plain tuple, silently (and with it, verification refused them as opaque)."""
    model = ReturnsContainerSubclasses()
    example = (torch.randn(2, 4),) if with_example else None
    sharded = autoshard.shard_model(model, 3, example_inputs=example, verify=verify)
    x = torch.randn(5, 4)
    got, want = sharded(x), model(x)
    assert type(got) is _Named and type(got["outputs"]) is _Outputs and type(got["slotted"]) is _Slotted
    assert torch.equal(got["outputs"].scaled, want["outputs"].scaled)
    pairs = zip([*got["outputs"], *got["slotted"]], [*want["outputs"], *want["slotted"]])
    assert all(torch.equal(a, b) for a, b in pairs)
