"""Measurements as artifacts: ``shape-prop`` provides ``facts``, ``profile`` provides ``times``, and a
split whose options read them needs them on its DAG, so validation refuses a pipeline without them
(or with them in the wrong place) before anything is captured."""

from __future__ import annotations

import re

import pytest
import torch

import autoshard
from autoshard.costs.facts import node_facts, node_seconds
from autoshard.costs.models import DAG_COST_MODELS
from autoshard.errors import InvalidArgumentError, PipelineValidationError
from autoshard.examples import ResidualMLP
from autoshard.passes import Instrument, Pipeline, ShardProgram
from autoshard.passes import analyses
from autoshard.passes.analyses import cost_reads, register_cost_model
from autoshard.passes.base import ExampleInputs
from autoshard.passes.split import SplitGreedyPass, SplitPass

INPUTS = frozenset({"model", "example_inputs"})


def validate(spec: str, initial: frozenset[str] = INPUTS) -> None:
    Pipeline.parse(spec).validate(initial)


@pytest.mark.parametrize("split, artifact, measurer", [
    ("split{stages=2 cost=flops}", "facts", "shape-prop"),
    ("split{stages=2 cost=activations}", "facts", "shape-prop"),
    ("split{stages=2 cost=memory}", "facts", "shape-prop"),
    ("split{stages=2 cost=time}", "times", "profile"),
    ("split{stages=2 max-memory=1e9}", "facts", "shape-prop"),
    ("split{stages=2 max-memory=1e9 memory-cost=time}", "times", "profile"),
    ("split-greedy{stages=2 cost=time}", "times", "profile"),
])
def test_a_split_that_reads_a_measurement_needs_the_pass_that_makes_it(split, artifact, measurer):
    with pytest.raises(PipelineValidationError, match=(
            rf"pass '{split.split('{')[0]}' \(position 3 .*\) needs '{artifact}'.*add `{measurer}` after the capture "
            r"\(`capture`, `export` or `trace`\) and before `build-dag` \(position 1\) \(it measures it on the "
            r"example inputs\)")):
        validate(f"capture,build-dag,linearize,{split},emit")


@pytest.mark.parametrize("split", [
    "split{stages=2}", "split{stages=2 cost=nodes}", "split{stages=2 max-memory=1e9 memory-cost=params}",
    "split{stages=2 cost=custom-mine}",
])
def test_a_split_that_reads_no_measurement_needs_none(split):
    validate(f"capture,build-dag,linearize,{split},emit")


def test_needs_follow_the_options():
    assert SplitPass(stages=2).needs() == {"dag", "order"}
    assert SplitPass(stages=2, cost="flops").needs() == {"dag", "order", "facts"}
    assert SplitPass(stages=2, cost="time", max_memory=(1e9,)).needs() == {"dag", "order", "facts", "times"}
    assert SplitGreedyPass(stages=2, cost="activations").needs() == {"dag", "order", "facts"}


class Ran(Instrument):
    """Records the passes that started."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def before_pass(self, pass_, index, program) -> None:
        self.names.append(pass_.name)


def test_shard_model_refuses_before_any_pass_runs():
    """Without example inputs the default pipeline has no shape-prop: cost=flops used to fail after the capture."""
    ran = Ran()
    with pytest.raises(InvalidArgumentError, match="cost='flops' counts what the model computes on example inputs"):
        autoshard.shard_model(ResidualMLP(), 2, cost="flops", instruments=[ran])
    assert ran.names == []


@pytest.mark.parametrize("options", [{"max_memory": 1e6}, {"cost": "memory"}])
def test_a_measurement_asked_for_without_example_inputs_says_to_pass_them(options):
    """shard_model(model, k, max_memory=...) without example inputs only said to add `shape-prop` to a
    pipeline the caller never wrote, and adding it is refused next, for want of the inputs; then it
    spoke of passes and 'facts'. It names the option the caller gave."""
    named = "max_memory=1000000.0" if "max_memory" in options else "cost='memory'"
    with pytest.raises(InvalidArgumentError, match=(
            rf"^{re.escape(named)} counts what the model computes on example inputs, and none were given: "
            r"pass example_inputs=")) as refused:
        autoshard.shard_model(ResidualMLP(), 2, **options)
    assert not isinstance(refused.value, PipelineValidationError)


def test_a_measurement_made_after_the_dag_is_built_does_not_reach_the_split():
    with pytest.raises(PipelineValidationError, match=(
            r"'facts' is measured by `shape-prop` \(position 2\), after `build-dag` \(position 1\) built the DAG "
            r"that carries it to 'split': move `shape-prop` before `build-dag` \(position 1\)")):
        validate("capture,build-dag,shape-prop,linearize,split{stages=2 cost=flops},emit")
    validate("capture,shape-prop,build-dag,linearize,split{stages=2 cost=flops},emit")


def test_a_new_capture_drops_the_measurements_of_the_old_graph():
    with pytest.raises(PipelineValidationError, match=(
            r"`trace` \(position 2\) captures the graph again after `shape-prop` \(position 1\) measured 'facts', "
            r"and a new graph has none: move `shape-prop` after `trace`")):
        validate("trace,shape-prop,trace,build-dag,linearize,split{stages=2 cost=flops},emit")
    # profile rewrites the graph it is given and keeps what its nodes carry
    validate("trace,shape-prop,profile,build-dag,linearize,split{stages=2 cost=flops},emit")
    result = Pipeline.parse("trace,shape-prop,trace").run(
        ShardProgram(ResidualMLP(), example_inputs=ExampleInputs((torch.randn(2, 16),))))
    assert result.history[1][1].facts is not None and result.program.facts is None


def test_a_dag_the_caller_gives_may_carry_any_measurement():
    validate("split{stages=2 cost=flops}", frozenset({"model", "dag", "order"}))


@pytest.fixture(scope="module")
def measured():
    """ResidualMLP after trace, shape-prop, profile (one timed run per node) and build-dag."""
    torch.manual_seed(0)
    pipeline = Pipeline.parse("trace,shape-prop,profile{warmup=0 repeats=1},build-dag")
    return pipeline.run(ShardProgram(ResidualMLP(), example_inputs=ExampleInputs((torch.randn(2, 16),)))).program


@pytest.fixture(scope="module")
def unmeasured():
    return Pipeline.parse("trace,build-dag").run(ShardProgram(ResidualMLP())).program


def test_the_artifacts_hold_what_the_nodes_carry(measured):
    nodes = list(measured.traced.graph_module.graph.nodes)
    assert dict(measured.facts) == {n.name: node_facts(n) for n in nodes if node_facts(n) is not None}
    assert measured.times.seconds == {n.name: node_seconds(n) for n in nodes if node_seconds(n) is not None}
    for name, facts in measured.facts.items():
        assert measured.dag.nodes[name]["flops"] == facts.flops
    with pytest.raises(TypeError):
        measured.facts["x"] = None  # read-only: an artifact is never written to


@pytest.mark.parametrize("name", sorted(DAG_COST_MODELS))
def test_what_a_cost_model_is_said_to_read_is_what_it_fails_without(name, measured, unmeasured):
    DAG_COST_MODELS[name](measured.dag)
    if cost_reads(name):
        with pytest.raises(InvalidArgumentError, match="needs what the"):
            DAG_COST_MODELS[name](unmeasured.dag)
    else:
        DAG_COST_MODELS[name](unmeasured.dag)


def test_a_registered_cost_model_declares_what_it_reads(monkeypatch):
    monkeypatch.setattr(analyses, "COST_MODELS", dict(analyses.COST_MODELS))
    monkeypatch.setattr(analyses, "COST_MODEL_READS", dict(analyses.COST_MODEL_READS))
    register_cost_model("double-flops", reads=["facts"])(lambda program: {})
    with pytest.raises(PipelineValidationError, match="needs 'facts'"):
        validate("capture,build-dag,linearize,split{stages=2 cost=double-flops},emit")
    with pytest.raises(InvalidArgumentError, match=r"reads 'dag', which is no measurement; measurements are facts"):
        register_cost_model("odd", reads=["dag"])
