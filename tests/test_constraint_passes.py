"""Constraints as data: the pin, no-split and cut-before passes, shard_model's and the CLI's
pin / no_split / cut_before, and a user's pass adding to the ``constraints`` artifact."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

import autoshard
from autoshard import cli
from autoshard.errors import (
    InfeasibleSplitError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PipelineValidationError,
)
from autoshard.examples import GPTStyleLM, ResidualMLP
from autoshard.passes import Pass, PassContext, Pipeline, ShardProgram, SplitConstraints, register_pass
from autoshard.passes.registry import PassRegistry, default_registry

PIPELINE = "capture,shape-prop,build-dag,linearize,{},split,emit,verify"


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return ResidualMLP(), (torch.randn(4, 16),)


def holder(sharded, prefix: str) -> set[int]:
    """The stages holding parameters under ``prefix``."""
    return {j for j, stage in enumerate(sharded.stages) for name, _ in stage.named_parameters()
            if name == prefix or name.startswith(prefix + ".")}


def test_a_pin_holds_a_module_in_its_stage_off_balance(mlp):
    model, inputs = mlp
    plain = autoshard.shard_model(model, 4, inputs)
    assert holder(plain, "linears.0") == {0} and holder(plain, "linears.7") == {3}
    pinned = autoshard.shard_model(model, 4, inputs, pipeline=PIPELINE.format("pin{module=linears.1 stage=2}"))
    assert holder(pinned, "linears.1") == {2} and holder(pinned, "linears.0") <= {0, 1}
    assert torch.equal(pinned(*inputs), model(*inputs))  # verified too, by the pipeline's verify


def test_shard_model_pins_by_module_and_weight_name_as_passes_before_the_split(mlp):
    model, inputs = mlp
    sharded = autoshard.shard_model(model, 4, inputs, pin={"linears.1": 2, "linears.7.bias": 2, "linears.6": 2})
    assert holder(sharded, "linears.1") == {2} and holder(sharded, "linears.6") == {2}
    assert holder(sharded, "linears.7") == {2}  # the node reading the bias reads the weight too
    spec = sharded.plan_origin.pipeline
    assert "pin{module=linears.1,linears.7.bias,linears.6 stage=2},split" in spec


def test_no_split_and_cut_before_from_the_call_match_the_split_options(mlp):
    model, inputs = mlp
    by_call = autoshard.shard_model(model, 3, inputs, cut_before=["linears.5"], no_split=["linears.1"])
    by_option = autoshard.shard_model(model, 3, inputs, pipeline="capture,shape-prop,build-dag,linearize,"
                                      "split{cut-before=linears.5 no-split=linears.1},emit,verify")
    assert [holder(by_call, f"linears.{i}") for i in range(8)] == [holder(by_option, f"linears.{i}") for i in range(8)]
    assert min(holder(by_call, "linears.5")) > max(holder(by_call, "linears.4"))
    assert "no-split{modules=linears.1},cut-before{modules=linears.5},split" in by_call.plan_origin.pipeline


def test_a_class_pin_holds_every_module_of_the_class():
    torch.manual_seed(0)
    model, tokens = GPTStyleLM(layers=4).eval(), torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, 2, (tokens,), pin={"GPTBlock": 1})
    assert all(holder(sharded, f"blocks.{i}") == {1} for i in range(4))


def test_a_users_pass_adds_constraints_as_data(mlp):
    model, inputs = mlp
    registry = PassRegistry()
    for cls in default_registry.passes():
        registry.register(cls)

    @register_pass(registry=registry)
    @dataclasses.dataclass(frozen=True)
    class LastBlockLast(Pass):
        """Hold the last block in the last stage."""

        name: ClassVar[str] = "last-block-last"
        provides: ClassVar[frozenset[str]] = frozenset({"constraints"})

        def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
            added = (program.constraints or SplitConstraints()).adding(pins=[("linears.6", 3)])
            return dataclasses.replace(program, constraints=added)

    pipeline = Pipeline.parse(PIPELINE.format("last-block-last"), registry=registry)
    assert holder(autoshard.shard_model(model, 4, inputs, pipeline=pipeline), "linears.6") == {3}


@pytest.mark.parametrize(("spec", "message"), [
    ("capture,build-dag,linearize,split,pin{module=linears.0 stage=1},emit",
     "pass 'pin' (position 4) provides 'constraints' in pipeline"),
    ("capture,build-dag,linearize,pin{module=linears.0 stage=1},load-partition{path=plan.json},emit",
     "no pass of the pipeline reads it: add one that does (split"),
    ("capture,build-dag,linearize,pin{stage=1},split,emit", "'pin' needs a module path, class or weight name"),
    ("capture,build-dag,linearize,no-split,split,emit", "'no-split' needs at least one module path"),
])
def test_misplaced_or_empty_constraint_passes_are_refused_before_capture(mlp, spec, message):
    model, inputs = mlp
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises((PipelineValidationError, InvalidArgumentError)) as info:
        autoshard.shard_model(model, 4, inputs, pipeline=spec)
    assert message in str(info.value)
    assert not calls
    model._forward_pre_hooks.clear()


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(pin={"linears": 1, "linears.0": 2}), InfeasibleSplitError,
     "holds node"),
    (dict(pin={"linears.0": 4}), InfeasibleSplitError, "(pinned to stage 4) asks for a stage past the last one"),
    (dict(pin={"linears.0": 1}), InfeasibleSplitError, "the pins leave stage 0 of 4 empty: under pin 'linears.0'"),
    (dict(pin={"linears.7": 0}), InfeasibleSplitError, "the pins leave 1 node for the 3 stages 1..3"),
    (dict(pin={"Linear": 1}), InfeasibleSplitError,
     "stage 0 of 4 empty: under pin 'Linear' (pinned to stage 1) no node"),
    (dict(pin={"linears.3": 0, "linears.1": 2}), InfeasibleSplitError, "contradict each other"),
    (dict(pin={"linears.9": 0}), InvalidArgumentError, "no module path, class or weight is called 'linears.9'"),
    (dict(pin={"linears.0": -1}), InvalidArgumentError, "pin['linears.0'] must be a stage number >= 0"),
    (dict(pin=["linears.0"]), InvalidArgumentTypeError, "pin must be a {module, class or weight name: stage} mapping"),
    (dict(no_split=[3]), InvalidArgumentTypeError, "no_split must be a list of module paths or class names"),
    (dict(pin={"linears.0": 1}, pipeline="capture,build-dag,linearize,split-greedy,emit"), InvalidArgumentError,
     "'split-greedy' with strategy 'greedy' cannot honour pin"),
])
def test_bad_pins_are_named(mlp, kwargs, error, message):
    model, inputs = mlp
    with pytest.raises(error) as info:
        autoshard.shard_model(model, 4, inputs, **kwargs)
    assert message in str(info.value)


def test_the_cli_takes_pins_no_split_and_cut_before(capsys):
    code = cli.main(["split", "residual-mlp", "--stages", "4", "--pin", "linears.1=2", "--no-split", "linears.2",
                     "--cut-before", "linears.6"])
    out = capsys.readouterr().out
    assert code == 0
    assert ("pin{module=linears.1 stage=2},no-split{modules=linears.2},cut-before{modules=linears.6},split"
            in " ".join(out.split()))
    assert cli.main(["split", "residual-mlp", "--stages", "4", "--pin", "linears.0"]) == 2
    assert "--pin takes NAME=STAGE" in capsys.readouterr().err
    assert cli.main(["split", "residual-mlp", "--stages", "4", "--pin", "linears.2=1", "--pin", "linears.2=0"]) == 2
    assert "--pin linears.2 is given stage 1 and stage 0; give it once" in capsys.readouterr().err


def test_the_cli_compares_strategies_under_pins(capsys):
    code = cli.main(["split", "residual-mlp", "--stages", "3", "--pin", "linears.1=2",
                     "--compare", "fixed-order,min-cut"])
    assert code == 0 and "strategies compared" in capsys.readouterr().out
    assert cli.main(["split", "residual-mlp", "--stages", "3", "--pin", "linears.1=2", "--compare", "greedy"]) == 2
    assert "strategy 'greedy' cannot honour pin" in capsys.readouterr().err
