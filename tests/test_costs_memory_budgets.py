"""max_memory against the exact training-memory model: the split itself keeps each stage's
weights, gradients and optimizer state once and its activations once per microbatch in flight
(stage j of k holds k - j under 1F1B), so it finds a plan that fits whenever one does, tied
weights counted in every stage that holds them; a budget nothing fits names the short stage."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import autoshard
from autoshard.costs.memory import node_memory, stage_memory
from autoshard.costs.models import held_weight_bytes, summed_per_stage
from autoshard.errors import InfeasibleSplitError, InvalidArgumentError
from autoshard.examples import GPTStyleLM
from autoshard.graph.linearize import non_inputs, program_order
from autoshard.plan_reporting import plan_report


def cut_assignments(dag, k: int):
    """Every split of program order into k contiguous non-empty stages."""
    order = program_order(dag)
    inputs = [v for v in order if dag.nodes[v]["input"]]
    rest = non_inputs(dag, order)
    for cuts in itertools.combinations(range(1, len(rest)), k - 1):
        bounds = (0, *cuts, len(rest))
        assignment = dict.fromkeys(inputs, 0)
        for j in range(k):
            assignment.update(dict.fromkeys(rest[bounds[j]:bounds[j + 1]], j))
        yield assignment


def peak_memory(dag, assignment, k: int) -> float:
    return max(s.total for s in stage_memory(dag, assignment, k))


def activation_heavy_chain():
    """Eight 16x16 layers on a batch of 256: activations outweigh the weights' training state."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(8))), torch.randn(256, 16)


def test_the_split_fits_microbatches_in_flight_where_one_per_stage_would_not():
    model, x = activation_heavy_chain()
    balanced = autoshard.shard_model(model, 2, example_inputs=(x,)).plan
    budget = 120_000
    # Counting one microbatch per stage, the params-balanced plan seems to fit; but stage 0 keeps
    # two microbatches of activations, so it does not.
    assert max(summed_per_stage(node_memory(balanced.dag), balanced.assignment, 2)) <= budget
    assert stage_memory(balanced.dag, balanced.assignment, 2)[0].total > budget

    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=[budget, budget])
    plan = sharded.plan
    assert peak_memory(plan.dag, plan.assignment, 2) <= budget
    assert plan.assignment != balanced.assignment
    # Of the plans that fit, the one best balanced by params (brute force over cut positions).
    fitting = [a for a in cut_assignments(plan.dag, 2) if peak_memory(plan.dag, a, 2) <= budget]
    assert max(plan.stage_costs("params")) == min(max(held_weight_bytes(plan.dag, a, 2)) for a in fitting)
    assert torch.equal(sharded(x), model(x))


def test_a_budget_no_plan_fits_names_the_stage_and_the_shortfall():
    model, x = activation_heavy_chain()
    dag = autoshard.shard_model(model, 2, example_inputs=(x,)).plan.dag
    least = min(peak_memory(dag, a, 2) for a in cut_assignments(dag, 2))
    assert least > 50_000
    short = (r"no split into 2 stages fits max-memory .*stage (0|1) needs [\d,]+ bytes .* "
             r"but max_memory\[\1\] is 50,000: ")
    with pytest.raises(InfeasibleSplitError, match=short + r"[\d,]+ bytes short"):
        autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=50_000)


@pytest.mark.parametrize("k", [2, 3])
def test_a_tied_lm_fits_exactly_the_least_budget_any_cut_fits(k):
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=1000, width=16, layers=2).eval()
    idx = torch.randint(0, 1000, (2, 8))
    dag = autoshard.shard_model(model, k, example_inputs=(idx,)).plan.dag
    least = min(peak_memory(dag, a, k) for a in cut_assignments(dag, k))

    sharded = autoshard.shard_model(model, k, example_inputs=(idx,), max_memory=least)
    plan = sharded.plan
    assert peak_memory(plan.dag, plan.assignment, k) <= least
    (tie,) = plan.gradient_sync  # the embedding's state counts in both stages that hold it
    info = plan.dag.graph["weights"]["wte.weight"]
    for j in tie.stages:
        assert stage_memory(plan.dag, plan.assignment, k)[j].state_bytes >= info.nbytes * 4  # weight, grad, Adam
    assert torch.equal(sharded(idx), model(idx))
    with pytest.raises(InfeasibleSplitError, match="bytes short"):
        autoshard.shard_model(model, k, example_inputs=(idx,), max_memory=least - 1)


@pytest.mark.parametrize("k", [2, 3])
def test_cost_memory_balances_training_memory_with_every_microbatch_in_flight(k):
    """Stage j keeps k - j microbatches of activations: balancing one per stage would overload
    stage 0. The plan's costliest stage, counted that way, is the least any cut reaches."""
    model, x = activation_heavy_chain()
    sharded = autoshard.shard_model(model, k, example_inputs=(x,), cost="memory")
    plan = sharded.plan
    optimum = min(peak_memory(plan.dag, a, k) for a in cut_assignments(plan.dag, k))
    assert peak_memory(plan.dag, plan.assignment, k) == pytest.approx(optimum)
    assert plan.split_info.bottleneck == pytest.approx(optimum)
    assert plan.split_info.bottleneck <= plan.split_info.bound, "the bound holds the plan as it is judged"
    one_per_stage = min(cut_assignments(plan.dag, k),
                        key=lambda a: max(summed_per_stage(node_memory(plan.dag), a, k)))
    assert peak_memory(plan.dag, one_per_stage, k) > optimum, "the example must tell the two apart"
    assert torch.equal(sharded(x), model(x))


def test_the_memory_model_sets_the_optimizer_the_plan_is_made_for():
    """SGD keeps no optimizer state: a budget only SGD fits is met with its model and refused
    (naming the shortfall) with the default Adam model; cost=memory balances under the model given."""
    model, x = activation_heavy_chain()
    sgd = autoshard.MemoryModel(optimizer_bytes_per_param=0)
    dag = autoshard.shard_model(model, 2, example_inputs=(x,)).plan.dag
    least_sgd = min(max(s.total for s in stage_memory(dag, a, 2, sgd)) for a in cut_assignments(dag, 2))
    assert least_sgd < min(peak_memory(dag, a, 2) for a in cut_assignments(dag, 2))
    fitted = autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=least_sgd, memory_model=sgd)
    assert max(s.total for s in stage_memory(fitted.plan.dag, fitted.plan.assignment, 2, sgd)) <= least_sgd
    with pytest.raises(InfeasibleSplitError, match="bytes short"):
        autoshard.shard_model(model, 2, example_inputs=(x,), max_memory=least_sgd)
    balanced = autoshard.shard_model(model, 2, example_inputs=(x,), cost="memory", memory_model=sgd)
    assert balanced.plan.split_info.bottleneck == pytest.approx(least_sgd)
    with pytest.raises(TypeError, match="memory_model must be an autoshard.MemoryModel"):
        autoshard.shard_model(model, 2, example_inputs=(x,), memory_model={"optimizer_bytes_per_param": 0})
    report = plan_report(fitted)  # the plan keeps the model it was made for
    assert fitted.plan.memory_model == sgd
    assert [s.memory for s in report.stages] == stage_memory(fitted.plan.dag, fitted.plan.assignment, 2, sgd)
    assert fitted.plan.stage_costs("memory") != fitted.plan.stage_costs("memory", autoshard.MemoryModel())


@pytest.mark.parametrize("options,message", [
    ({"optimizer_bytes_per_param": -1}, "optimizer_bytes_per_param must be a number >= 0"),
    ({"optimizer_bytes_per_param": float("nan")}, "optimizer_bytes_per_param must be a number >= 0"),
    ({"microbatches": 0}, "microbatches must be a whole number >= 1"),
    ({"microbatches": 1.5}, "microbatches must be a whole number >= 1"),
])
def test_a_memory_model_refuses_values_it_cannot_plan_with(options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        autoshard.MemoryModel(**options)
