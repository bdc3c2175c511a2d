"""Tied and shared weights: found by identity, held once, listed with the stages to synchronise."""

from __future__ import annotations

import torch
from torch import nn

import autoshard
from autoshard.costs.ties import shared_weights

from gpt_style import GPTStyleLM


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
