"""Tied and shared weights: found by identity, held once, counted once per stage in the balance,
kept in one stage when they can be and listed with the stages to synchronise when not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.costs.models import held_weight_bytes
from autoshard.costs.ties import EXHAUSTIVE_TIE_GROUPS, shared_weights, tie_groups, weight_payers
from autoshard.examples import GPTStyleLM
from autoshard.plan_reporting import plan_report

from test_costs_memory_budgets import cut_assignments


def test_a_tied_lm_head_is_reported_held_once_and_exact():
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=100, width=32, layers=2).eval()
    assert model.lm_head.weight is model.wte.weight
    idx = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_inputs=(idx,))
    assert torch.equal(sharded(idx), model(idx))

    (tie,) = [w for w in sharded.plan.shared_weights if "lm_head.weight" in w.aliases]
    assert tie.name == "wte.weight" and tie.aliases == ("wte.weight", "lm_head.weight")
    assert tie.nodes == ("wte", "lm_head") and tie.kind == "parameter"
    assert tie.stages == tuple(sorted({sharded.plan.assignment["wte"], sharded.plan.assignment["lm_head"]}))
    assert tie.needs_gradient_sync == (len(tie.stages) > 1)
    if tie.needs_gradient_sync:
        assert tie in sharded.plan.gradient_sync

    # Held once: one Parameter object, whichever stages reference it.
    holders = [p for stage in sharded.stages for n, p in stage.named_parameters(remove_duplicate=False)
               if n in tie.aliases]
    assert holders and all(p is model.wte.weight for p in holders)
    unique = {id(p) for p in model.parameters()}
    assert {id(p) for p in sharded.parameters()} == unique
    assert sum(p.numel() for p in sharded.parameters()) == sum(p.numel() for p in model.parameters())
    # Each stage holding it counts its bytes once.
    for j in tie.stages:
        names = sharded.plan.weights(j)
        assert names.count("wte.weight") == 1


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.register_buffer("offset", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.middle(self.shared(x))) + self.offset


def test_a_module_called_twice_shares_its_weights_between_two_nodes():
    model = CalledTwice()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 3, example_inputs=(x,))
    by_name = {w.name: w for w in shared_weights(sharded.plan.dag, sharded.plan.assignment)}
    assert set(by_name) == {"shared.weight", "shared.bias"}
    weight = by_name["shared.weight"]
    assert weight.nodes == ("shared", "shared_1") and weight.aliases == ("shared.weight",)
    stages = {sharded.plan.assignment["shared"], sharded.plan.assignment["shared_1"]}
    assert weight.stages == tuple(sorted(stages))
    assert torch.equal(sharded(x), model(x))


def test_a_frozen_shared_weight_needs_no_gradient_sync():
    model = CalledTwice()
    for p in model.shared.parameters():
        p.requires_grad_(False)
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),))
    assert all(not w.trainable for w in sharded.plan.shared_weights)
    assert sharded.plan.gradient_sync == ()


def test_params_cost_counts_a_shared_weight_once_in_each_stage_holding_it():
    model = CalledTwice()
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),))
    plan = sharded.plan
    for j, stage in enumerate(sharded.stages):
        held = {id(t): t for t in [*stage.parameters(), *stage.buffers()]}
        assert plan.stage_costs("params")[j] == sum(t.numel() * t.element_size() for t in held.values())
        assert plan.param_bytes(j) == plan.stage_costs("params")[j]


# -- tied weights in the balance itself ------------------------------------------------------

KEEP_TIED_OFF = "capture,shape-prop,build-dag,linearize,split{keep-tied=false},emit,verify"


def held_by_stage(sharded) -> list[int]:
    """Bytes of the distinct parameters and buffers each stage module really holds."""
    return [sum(t.numel() * t.element_size() for t in {id(t): t for t in [*s.parameters(), *s.buffers()]}.values())
            for s in sharded.stages]


def best_true_params_over_cuts(dag, k: int) -> float:
    """Brute force: the least params bottleneck over all cut positions of program order, each
    weight counted once per stage holding it."""
    return min(max(held_weight_bytes(dag, a, k)) for a in cut_assignments(dag, k))


@pytest.mark.parametrize("k", [2, 3])
def test_a_tied_lm_is_balanced_by_the_bytes_each_stage_really_holds(k):
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=1000, width=16, layers=2).eval()  # the embedding outweighs a block
    idx = torch.randint(0, 1000, (2, 8))
    sharded = autoshard.shard_model(model, k, example_inputs=(idx,))
    plan = sharded.plan
    assert torch.equal(sharded(idx), model(idx))
    held = held_by_stage(sharded)
    assert plan.stage_costs("params") == held
    assert [s.costs["params"] for s in plan_report(sharded).stages] == held
    assert plan.split_info.bottleneck == max(held)
    assert max(held) == best_true_params_over_cuts(plan.dag, k)
    # Charging the tied weight to the embedding alone, the old split saw the head as free.
    loose = autoshard.shard_model(model, k, example_inputs=(idx,), pipeline=KEEP_TIED_OFF)
    assert max(held_by_stage(loose)) > max(held)


class AdjacentTied(nn.Module):
    """Two consecutive layers share one weight: the tie can stay in one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.l1, self.l2, self.b, self.c = (nn.Linear(8, 8) for _ in range(5))
        self.l2.weight = self.l1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.l2(self.l1(self.a(x)).relu())))


@pytest.mark.parametrize("cost", ["params", "flops"])
def test_adjacent_tied_layers_share_a_stage_unless_keep_tied_is_off(cost):
    torch.manual_seed(0)
    model, x = AdjacentTied().eval(), torch.randn(2, 8)
    kept = autoshard.shard_model(model, 2, example_inputs=(x,), cost=cost)
    plan = kept.plan
    assert plan.assignment["l1"] == plan.assignment["l2"]
    assert plan.gradient_sync == () and plan.split_info.separated == ()
    assert torch.equal(kept(x), model(x))
    loose = autoshard.shard_model(model, 2, example_inputs=(x,), cost=cost, pipeline=KEEP_TIED_OFF)
    assert loose.plan.assignment["l1"] != loose.plan.assignment["l2"]
    (tie,) = loose.plan.gradient_sync
    assert tie.name == "l1.weight" and tie.stages == (0, 1)
    assert torch.equal(loose(x), model(x))
    # Kept together costs nothing in balance: the same bottleneck, one weight held once.
    assert max(plan.stage_costs("flops")) <= max(loose.plan.stage_costs("flops"))
    assert max(plan.stage_costs("params")) < max(loose.plan.stage_costs("params"))


@pytest.mark.parametrize("k", [2, 4])
def test_a_tie_across_the_whole_model_is_split_and_listed_for_gradient_sync(k):
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=100, width=16, layers=3).eval()
    idx = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, k, example_inputs=(idx,))
    plan = sharded.plan
    (tie,) = plan.gradient_sync
    assert tie.name == "wte.weight" and tie.aliases == ("wte.weight", "lm_head.weight")
    assert tie.stages == (plan.assignment["wte"], plan.assignment["lm_head"]) == (0, k - 1)
    assert plan.split_info.separated == ("wte.weight",)
    assert [w.name for w in plan_report(sharded).gradient_sync] == ["wte.weight"]
    first, last = sharded.stages[0].get_parameter("wte.weight"), sharded.stages[-1].get_parameter("lm_head.weight")
    assert first is last is model.wte.weight
    assert torch.equal(sharded(idx), model(idx))


class FourCalledTwice(nn.Module):
    """Four layers run in turn, twice: more tie groups than the split tries exhaustively."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.layers, *self.layers]:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("k", [2, 3])
def test_many_tie_groups_are_still_counted_once_per_stage_holding_them(k):
    assert len(tie_groups(autoshard.shard_model(FourCalledTwice(), 1).plan.dag)) > EXHAUSTIVE_TIE_GROUPS
    torch.manual_seed(0)
    model, x = FourCalledTwice().eval(), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, k, example_inputs=(x,))
    held = held_by_stage(sharded)
    assert sharded.plan.stage_costs("params") == held and sharded.plan.split_info.bottleneck == max(held)
    assert max(held) == best_true_params_over_cuts(sharded.plan.dag, k)
    assert max(held_by_stage(autoshard.shard_model(model, k, example_inputs=(x,), pipeline=KEEP_TIED_OFF))) > max(held)
    assert torch.equal(sharded(x), model(x))


def test_a_shared_weight_is_charged_to_its_first_reader_every_reader_or_once_per_stage():
    dag = autoshard.shard_model(CalledTwice(), 1).plan.dag
    shared = ("shared.weight", "shared.bias")
    first = weight_payers(dag)
    assert first["shared"] == shared and first["shared_1"] == () and first["middle"] == ("middle.weight", "middle.bias")
    assert weight_payers(dag, apart={"shared.weight"})["shared_1"] == ("shared.weight",)
    apart = {node: stage for stage, node in enumerate(["shared", "middle", "shared_1"])}
    assert weight_payers(dag, assignment={**dict.fromkeys(dag, 0), **apart})["shared_1"] == shared
    assert weight_payers(dag, assignment=dict.fromkeys(dag, 0))["shared_1"] == ()
