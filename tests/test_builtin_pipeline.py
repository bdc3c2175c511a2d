"""The built-in passes as a text pipeline: parse, print back, validate, run."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.api import default_pipeline
from autoshard.errors import PassFailed, PipelineValidationError
from autoshard.examples import ResidualMLP
from autoshard.passes import Pipeline, ShardProgram, ExampleInputs, function_pass

SPEC = "capture,shape-prop,build-dag,linearize,split{stages=4 cost=params},emit,verify"


@pytest.mark.parametrize("spec", [SPEC, "trace,build-dag,linearize,split{stages=4 cost=params},emit,verify"])
def test_the_documented_spec_prints_back_to_the_same_text(spec):
    pipeline = Pipeline.parse(spec)
    assert str(pipeline) == spec
    assert Pipeline.parse(str(pipeline)) == pipeline


def test_default_pipeline_is_the_documented_one():
    assert str(default_pipeline(4)) == "capture,shape-prop,build-dag,linearize,split{stages=4},emit,verify"
    assert str(default_pipeline(4, verify=False)) == "capture,build-dag,linearize,split{stages=4},emit"
    assert Pipeline.parse(SPEC) == default_pipeline(4)


def test_a_text_pipeline_shards_like_the_default():
    model = ResidualMLP()
    x = torch.randn(2, 16)
    by_text = autoshard.shard_model(model, 4, example_inputs=(x,), pipeline=SPEC)
    by_default = autoshard.shard_model(model, 4, example_inputs=(x,))
    assert by_text.plan.assignment == by_default.plan.assignment
    assert torch.equal(by_text(x), model(x))


def test_a_crash_inside_a_pass_names_the_pass_position_and_spec():
    @function_pass("explode", requires=("dag",), provides=("order",), register=False)
    def explode(program, ctx):
        """Fail on purpose."""
        raise RuntimeError("boom")

    pipeline = Pipeline.parse("trace,build-dag") + explode()
    program = ShardProgram(model=ResidualMLP(), example_inputs=ExampleInputs((torch.randn(1, 16),)))
    with pytest.raises(PassFailed) as info:
        pipeline.run(program)
    assert info.value.pass_name == "explode" and info.value.index == 2
    assert "trace,build-dag,explode" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_split_without_a_stage_count_in_a_bare_pipeline_says_how_to_fix_it():
    pipeline = Pipeline.parse("trace,build-dag,linearize,split,emit")
    with pytest.raises(autoshard.AutoshardError, match=r"split\{stages=K\}"):
        pipeline.run(ShardProgram(model=ResidualMLP()))


def test_validation_happens_before_any_pass_runs():
    pipeline = Pipeline.parse("trace,build-dag,emit")
    with pytest.raises(PipelineValidationError, match="partition"):
        pipeline.validate(frozenset({"model"}))


@pytest.mark.parametrize("profile", ["profile{repeats=0}", "profile{warmup=-1}"])
def test_profile_settings_are_refused_before_the_capture(profile):
    pipeline = Pipeline.parse(f"trace,shape-prop,{profile},build-dag,linearize,split{{stages=2 cost=time}},emit")
    needs = "timing needs warmup >= 0, repeats >= 1 and threads >= 1"
    with pytest.raises(autoshard.InvalidArgumentError, match=needs) as info:
        pipeline.validate(frozenset({"model", "example_inputs"}))
    assert "in pass 'profile' (position 2)" in info.value.__notes__[0]
