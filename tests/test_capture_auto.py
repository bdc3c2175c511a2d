"""Choosing the front end, and the passes users name in a pipeline: trace, export, capture."""

from __future__ import annotations

import re

import pytest
import torch
from test_capture_fx import Around, Gate
from torch import nn

import autoshard
from autoshard.capture import capture
from autoshard.errors import (ExampleInputsError, InputMismatchError, InvalidArgumentError,
                              PipelineValidationError, TraceError)
from autoshard.examples import ResidualMLP, load_example
from autoshard.passes import Pipeline, PassRegistry, default_registry
from autoshard.passes.capture import CapturePass
from autoshard.passes.export import ExportPass


class Half(nn.Module):
    """Slices with a size turned into a Python int: fx cannot (a Proxy is no int), export can."""

    def forward(self, x):
        return x[:, : int(x.shape[1] // 2)] * 2


class TypeChecked(nn.Module):
    """Checks its input's type: a proxy is no tensor, so fx keeps it whole; export runs it."""

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError("expects a tensor")
        return x * 2


def test_auto_keeps_export_when_fx_must_wrap_a_module_that_exports():
    model = Around(TypeChecked(), 2)
    result = capture(model, (torch.randn(3, 2),))
    assert result.front_end == "export" and result.wrapped == ()
    assert result.considered == ("fx: wrapped modules 1, functions 0",
                                 "export: wrapped modules 0, functions 0")
    x = torch.randn(5, 2)
    assert torch.equal(result.graph_module(x), model(x))


class RunningSum(nn.Module):
    """A Python loop over the sequence: plain fx keeps it whole; fx with pinned sizes (and export)
    unroll it for the example's length."""

    def forward(self, x):
        total, sums = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            total = total + x[:, t]
            sums.append(total)
        return torch.stack(sums, 1)


@pytest.mark.parametrize("pipeline, refusal", [
    (None, r"turns a size into a Python number, which fixed it to 6 .* these inputs make it 9"),
    ("export,shape-prop,build-dag,linearize,split,emit,verify",
     r"x.shape\[1\] is 9, but the plan only serves 6 \(torch.export")], ids=["auto", "export"])
def test_a_length_the_capture_fixed_is_refused_with_the_pipeline_that_keeps_it_free(pipeline, refusal):
    model = Around(RunningSum(), 4)
    example, later = torch.randn(2, 6, 4), torch.randn(3, 9, 4)
    sharded = autoshard.shard_model(model, 2, example_inputs=(example,), pipeline=pipeline, respecialize=False)
    with pytest.raises(InputMismatchError, match=refusal) as info:
        sharded(later)
    respecialized = autoshard.shard_model(model, 2, example_inputs=(example,), pipeline=pipeline)
    assert torch.equal(respecialized(later), model(later)) and len(respecialized.specializations) == 1
    advised = re.search(r"pipeline='([^']+)'", str(info.value)).group(1)
    general = autoshard.shard_model(model, 2, example_inputs=(example,), pipeline=advised)
    assert [w.name for w in general.plan.wrapped] == ["inner"]
    assert torch.equal(general(later), model(later))


def test_auto_keeps_fx_on_a_tie_and_does_not_try_export_when_fx_wraps_no_module():
    gated = capture(Around(Gate(), 2), (torch.randn(3, 2),))
    assert gated.front_end == "fx" and [w.name for w in gated.wrapped] == ["inner"]
    assert len(gated.considered) == 2
    plain = capture(ResidualMLP(), (torch.randn(3, 16),))
    assert plain.front_end == "fx" and plain.considered == ("fx: wrapped modules 0, functions 0",)
    model, args, kwargs = load_example("transformer-lm")  # fx wraps two functions, no module
    assert capture(model, args, kwargs).considered == ("fx: wrapped modules 0, functions 2",)


class ScalesTensors(nn.Module):
    """Takes a branch only for a tensor: fx's proxy is no tensor, so fx's graph silently skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        h = self.lin(x)
        if isinstance(h, torch.Tensor):
            h = h * 2
        return h


def test_auto_tries_export_when_the_fx_graph_computes_something_else_than_the_model():
    model = Around(ScalesTensors(), 2)
    result = capture(model, (torch.randn(3, 2),))
    assert result.front_end == "export" and result.wrapped == ()
    assert result.considered[0].startswith("fx: wrapped modules 0, functions 0, differs from the model (")
    x = torch.randn(5, 2)
    assert torch.equal(result.graph_module(x), model(x))
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(3, 2),))  # verified
    assert torch.equal(sharded(x), model(x))


def test_without_examples_only_fx_runs_and_a_failure_says_what_to_pass():
    class TopLevel(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    assert capture(ResidualMLP()).front_end == "fx"
    with pytest.raises(TraceError, match="no front end could capture TopLevel.*pass example inputs"):
        capture(TopLevel())
    # both front ends fail in the top-level forward: one way out, not each one's "try the other front end"
    with pytest.raises(TraceError, match=r"TopLevel: fx: .*\(at test_capture_auto.py:\d+\); export: .*\(at "
                                         r"test_capture_auto.py:\d+\)\. Code in the top-level forward .* move that "
                                         r"code into a submodule, which is then kept whole$") as both:
        capture(TopLevel(), (torch.randn(2, 2),))
    assert "other front end" not in str(both.value)


class NeedsAConfig(nn.Module):
    """Fails on any input, traced or not, as a model with an incomplete config does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.missing_setting


def test_a_model_that_fails_on_its_own_example_is_reported_as_such_not_as_untraceable():
    with pytest.raises(ExampleInputsError, match=r"NeedsAConfig itself raises on the example inputs "
                                                 r"\(AttributeError: .*missing_setting"):
        autoshard.shard_model(NeedsAConfig(), 2, example_inputs=(torch.randn(2, 4),))


def test_a_front_end_can_be_asked_for_by_name():
    model = Around(Half(), 2)
    x = (torch.randn(3, 4),)
    assert capture(model, x, front_end="fx").front_end == "fx"
    assert capture(model, x, front_end="export").front_end == "export"
    with pytest.raises(InvalidArgumentError, match="unknown front end 'jit'; choose one of auto, fx, export"):
        capture(model, x, front_end="jit")


@pytest.fixture
def registry():
    return PassRegistry([*default_registry.passes(), CapturePass, ExportPass], entry_point_group=None)


@pytest.mark.parametrize("front_end", ["trace", "export", "capture"])
def test_every_front_end_pass_feeds_the_rest_of_the_pipeline(registry, front_end):
    model = Around(Half(), 2)
    pipeline = Pipeline.parse(f"{front_end},build-dag,linearize,split{{stages=2}},emit,verify", registry)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(3, 4),), pipeline=pipeline)
    assert sharded.num_stages == 2
    x = torch.randn(6, 4)
    assert torch.equal(sharded(x), model(x))


def test_the_export_pass_needs_example_inputs(registry):
    pipeline = Pipeline.parse("export,build-dag,linearize,split{stages=2},emit", registry)
    with pytest.raises(PipelineValidationError, match="needs 'example_inputs'"):
        autoshard.shard_model(ResidualMLP(), 2, pipeline=pipeline)


def test_a_model_the_capture_takes_but_its_example_fails_on_is_reported_by_its_own_error():
    """Tracing checks no pooling window, so the capture succeeds; the first real run is the
    model's own failure, named as such (Inception's auxiliary head on a small image)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AvgPool2d(5, stride=3), nn.Flatten())
    with pytest.raises(ExampleInputsError, match=r"Sequential itself raises on the example inputs"):
        autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 3, 5, 5),))


class _Held:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsAHolder(nn.Module):
    """fx cannot take ``len`` of a traced tuple; export cannot return a ``_Held``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> _Held:
        return _Held(self.last(self.first(pair[0])) * len(pair))


def test_returning_an_object_holding_tensors_is_refused_with_the_use_cache_advice_when_no_front_end_captures():
    x = torch.randn(3, 4)
    with pytest.raises(TraceError, match=r"returns objects that hold tensors \(the output: _Held\).*"
                                         r"call the model with use_cache=False.*Front ends: fx: failed"):
        capture(ReturnsAHolder(), ((x, x),), {})
