"""The cost models: what each one charges, that they are computed once, user cost functions,
the training-memory model, and per-stage capacities and memory budgets through shard_model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import autoshard
from autoshard.api import default_pipeline, run_pipeline
from autoshard.costs.memory import StageMemory, check_memory_budgets, stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.errors import (
    InfeasibleSplitError, InvalidArgumentError, InvalidArgumentTypeError, PipelineValidationError,
)
from autoshard.examples import ResidualMLP, load_example
from autoshard.passes import (
    BuildDagPass, EmitPass, ExampleInputs, LinearizePass, PassContext, Pipeline, SplitPass, TracePass,
)
from autoshard.passes.shapes import ShapePropPass
from autoshard.passes.analyses import COST_MODELS, CostNode, node_costs

from autoshard.examples import GPTStyleLM


def program_of(model, *args, k=2):
    return run_pipeline(model, default_pipeline(k), ExampleInputs(args)).program


def test_every_issue_cost_model_is_registered():
    assert {"params", "flops", "activations", "memory", "time", "nodes"} <= set(COST_MODELS)


def test_activations_are_the_output_bytes_of_each_node():
    model, args, _ = load_example("residual-mlp")
    program = program_of(model, *args)
    costs = node_costs(program, PassContext(), "activations")
    for node, data in program.dag.nodes(data=True):
        expected = 0.0 if data["input"] else data["value_meta"].nbytes  # a model input is not an activation
        assert costs[node] == expected
    assert [costs[f"linears_{i}"] for i in range(8)] == [4 * 16 * 4] * 8  # float32[4, 16] each


def test_costs_are_computed_once_per_dag():
    calls = []

    def counting(program):
        calls.append(program.dag)
        return {n: 1.0 for n in program.dag.nodes}

    model, args, _ = load_example("residual-mlp")
    program = program_of(model, *args)
    ctx = PassContext()
    from autoshard.passes.analyses import use_cost_model

    use_cost_model(ctx, "counting", counting)
    first = node_costs(program, ctx, "counting")
    assert node_costs(program, ctx, "counting") is first
    assert len(calls) == 1
    assert "counting" not in COST_MODELS  # run-local: other runs do not see it


def test_a_cost_function_plans_like_the_named_model_it_mirrors():
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=2000, width=32, layers=4, tied=False).eval()
    idx = torch.randint(0, 2000, (2, 8))
    seen: list[CostNode] = []

    def my_flops(node: CostNode) -> float:
        seen.append(node)
        return float(node.flops)

    custom = autoshard.shard_model(model, 3, example_inputs=(idx,), cost=my_flops)
    named = autoshard.shard_model(model, 3, example_inputs=(idx,), cost="flops")
    assert custom.plan.assignment == named.plan.assignment
    assert {n.name for n in seen} == {n for n, d in custom.plan.dag.nodes(data=True) if not d["input"]}
    assert any(n.module == "lm_head" and n.param_bytes > 0 for n in seen)
    assert torch.equal(custom(idx), model(idx))


def test_numbers_from_numpy_or_torch_are_numbers():
    """np.prod(shape) gives a numpy integer, a torch reduction a 0-d tensor, np.linspace an array."""
    model, args, _ = load_example("residual-mlp")
    plain = autoshard.shard_model(model, 2, example_inputs=args, cost=lambda node: float(node.param_bytes))
    for kind in (np.float32, np.int64, torch.tensor):
        sharded = autoshard.shard_model(model, 2, example_inputs=args, cost=lambda node: kind(node.param_bytes))
        assert sharded.plan.assignment == plain.plan.assignment
    as_arrays = autoshard.shard_model(model, 2, example_inputs=args, capacities=np.array([1.0, 2.0]),
                                      max_memory=np.int64(10**12))
    as_lists = autoshard.shard_model(model, 2, example_inputs=args, capacities=[1.0, 2.0], max_memory=10**12)
    assert as_arrays.plan.assignment == as_lists.plan.assignment


def test_a_cost_function_returning_nonsense_is_named():
    def negative(node: CostNode) -> float:
        return -1.0

    model, args, _ = load_example("residual-mlp")
    with pytest.raises(InvalidArgumentError, match=r"'negative' returned -1.0 for node '\w+'; it must return"):
        autoshard.shard_model(model, 2, example_inputs=args, cost=negative)


def test_a_cost_that_is_neither_a_name_nor_a_function_is_refused():
    with pytest.raises(InvalidArgumentTypeError, match="cost must be"):
        autoshard.shard_model(ResidualMLP(), 2, cost=3)


def test_measured_costs_without_shape_prop_say_which_pass_to_add():
    with pytest.raises(PipelineValidationError, match="add `shape-prop`"):
        autoshard.shard_model(ResidualMLP(), 2, (torch.randn(2, 16),), cost="flops",
                              pipeline="capture,build-dag,linearize,split,emit")


def test_stage_memory_counts_state_saved_activations_boundaries_and_one_backward():
    """Linear(4, 8) | ReLU, Linear(8, 2) on 3 rows, counted by hand (fp32, Adam)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)  # frozen: no gradient, no optimizer state
    x = torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
    plan = sharded.plan
    mm = MemoryModel(optimizer_bytes_per_param=8)
    first, last = stage_memory(plan.dag, plan.assignment, 2, mm)
    assert [len(list(s.parameters())) for s in sharded.stages] == [2, 2]
    # stage 0: Linear(4, 8) saves only the model input x (received, 48 B); its output (96 B) is kept
    # until its gradient arrives; the backward holds that gradient and the weight's (128 + 32)
    # (a step of 2 microbatches, one per stage: a buffer for each's output gradient, one in use, and the
    # step's batch it is handed, both microbatches in flight); its forward keeps all it makes, beside the
    # gradient buffer the next backward uses. Both forwards run before its first backward, which meets no
    # gradient (``zero_grad`` freed them) and makes the weight's; the second meets them, a microbatch fewer
    # (its output freed once the first backward ran)
    in_use = 2 * (48 + 96) + 96
    assert first == StageMemory(0, (32 + 8) * 4 * 4, 0, 2, received_bytes=48, sent_bytes=96, output_grad_bytes=96,
                                backward_bytes=96 + 160, forward_bytes=96, weight_bytes=160, gradient_bytes=160,
                                buffer_bytes=2 * (96 + 48), idle_buffer_bytes=96, step_bytes=2 * 128,
                                first_backward_bytes=96 + 160, later_backward_bytes=96 + 160 - 96)
    # stage 1: ReLU saves its output (96 B; the Linear saves the same storage); it receives 96 B
    # and sends the 24 B output; the peak is the ReLU's backward: output gradient 24, the
    # Linear's input gradient 96 and the ReLU's own 96; a receive buffer for each microbatch, one in use;
    # 1F1B's steady state (the second microbatch's forward after the first's backward): torch's schedule
    # still holds the 96 B gradient the first backward sent back
    assert last == StageMemory(1, 16 * 4 * 4 + 8, 96, 1, received_bytes=96, sent_bytes=24, output_grad_bytes=24,
                               backward_bytes=24 + 96 + 96, weight_bytes=64 + 8, gradient_bytes=64, buffer_bytes=2 * 96,
                               idle_buffer_bytes=96, step_bytes=2 * 64, sent_back_bytes=96)
    # after the last backward: every receive buffer and single-tensor Adam's temporaries (2x the largest
    # weight it steps), less than the steady state here
    assert [s.total for s in (first, last)] == [640 + in_use + 160, 264 + 96 + 96 + 24 + 216 + 96 + 96]
    assert plan.stage_costs("memory", mm) == [s.total for s in (first, last)]
    capped = stage_memory(plan.dag, plan.assignment, 2, MemoryModel(microbatches=1))
    assert [s.in_flight for s in capped] == [1, 1]


def test_a_budget_too_small_names_the_stage_and_the_shortfall():
    stages = [StageMemory(0, 100.0, 10.0, 2), StageMemory(1, 50.0, 10.0, 1)]
    check_memory_budgets(stages, [120, 60])
    with pytest.raises(InfeasibleSplitError, match=r"stage 1 needs 60 bytes.*max_memory\[1\] is 59: 1 byte short"):
        check_memory_budgets(stages, [120, 59])


@pytest.mark.parametrize("bad, error, message", [
    ([1, 1], InvalidArgumentError, "2 entries but there are 3 stages"),
    ([1, 0, 1], InvalidArgumentError, r"capacities\[1\] must be finite and > 0"),
    ([1, "x", 1], InvalidArgumentTypeError, r"capacities\[1\] must be a number"),
    ("111", InvalidArgumentTypeError, "capacities must be a list with one number per stage, got '111'"),
    (1, InvalidArgumentTypeError,  # it said: must be a number or a list, got 1
     r"capacities takes one number per stage, its relative speed \(such as \[1.0, 1.0, 2.0\]\), got 1; leave it out"),
])
def test_bad_capacities_are_refused_before_anything_runs(bad, error, message):
    with pytest.raises(error, match=message):
        autoshard.shard_model(ResidualMLP(), 3, capacities=bad)


@pytest.mark.parametrize("budgets, message", [
    ({0: "1GiB", 1: "1GiB"}, "max_memory must be a number of bytes or a size such as '40GiB' or a list with one per"),
    ([None, "1GiB"], r"max_memory\[0\] must be a number of bytes or a size such as '40GiB', got None"),
])
def test_a_budget_of_the_wrong_type_says_sizes_are_taken_too(budgets, message):
    """It said "must be a number", though "40GiB" is taken as well."""
    with pytest.raises(InvalidArgumentTypeError, match=message):
        autoshard.shard_model(ResidualMLP(), 2, max_memory=budgets)


@pytest.mark.parametrize("stages, budgets, message", [
    (4, [1e6], "max_memory has 1 entry but there are 4 stages"),
    (1, [1e6, 1e6], "max_memory has 2 entries but there is 1 stage"),
])
def test_a_budget_list_of_the_wrong_length_counts_in_words(stages, budgets, message):
    """It read "has 1 entries" and "there are 1 stages"."""
    with pytest.raises(InvalidArgumentError, match=message):
        autoshard.shard_model(ResidualMLP(), stages, max_memory=budgets)


def test_capacities_reach_a_split_written_in_a_pipeline_and_nothing_else():
    model, x = ResidualMLP(num_blocks=8), torch.randn(4, 16)
    written = Pipeline([TracePass(), ShapePropPass(), BuildDagPass(), LinearizePass(), SplitPass(), EmitPass()])
    from_spec = autoshard.shard_model(model, 3, example_inputs=(x,), pipeline=written, capacities=[1, 1, 2])
    default = autoshard.shard_model(model, 3, example_inputs=(x,), capacities=[1, 1, 2])
    assert from_spec.plan.assignment == default.plan.assignment
    with pytest.raises(InvalidArgumentError, match="no pass of the pipeline"):
        autoshard.shard_model(model, 3, example_inputs=(x,), pipeline="trace,build-dag", capacities=[1, 1, 2])


def test_capacities_give_a_twice_as_fast_stage_twice_the_cost():
    model = ResidualMLP(num_blocks=8)
    x = torch.randn(4, 16)
    sharded = autoshard.shard_model(model, 3, example_inputs=(x,), capacities=[1, 1, 2])
    costs = sharded.plan.stage_costs("params")
    assert costs[2] == pytest.approx(2 * costs[0], rel=0.15)
    assert costs[2] == pytest.approx(2 * costs[1], rel=0.15)
    assert torch.equal(sharded(x), model(x))


def test_max_memory_is_respected_or_the_short_stage_is_named():
    model = ResidualMLP(num_blocks=8)
    x = torch.randn(4, 16)
    plan = autoshard.shard_model(model, 2, example_inputs=(x,)).plan
    needed = [s.total for s in stage_memory(plan.dag, plan.assignment, 2)]
    roomy = [2 * max(needed)] * 2
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=roomy)
    assert all(s.total <= b for s, b in zip(stage_memory(sharded.plan.dag, sharded.plan.assignment, 2), roomy))
    one_for_all = autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=roomy[0])
    assert one_for_all.plan.assignment == sharded.plan.assignment
    with pytest.raises(InfeasibleSplitError, match="stage"):
        autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=[max(needed) / 4] * 2)


def test_the_dag_level_cost_models_need_no_torch():
    import subprocess
    import sys

    code = ("import sys, autoshard.costs, autoshard.costs.ties, autoshard.costs.models; "
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
