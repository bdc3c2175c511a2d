"""The foundation's acceptance cases: exactly k stages, balanced, outputs equal, model untouched."""

from __future__ import annotations

import math

import pytest
import torch

import autoshard
from autoshard.examples import BranchedNetwork, LongSkip, ResidualMLP, load_example
from autoshard.examples.models import causal_mask

from conftest import assert_same_fingerprint, model_fingerprint


def run_stages_by_hand(sharded, *args, **kwargs):
    """The stage-calling contract, spelled out as users write it."""
    if len(sharded.stages) == 1:
        return sharded.stages[0](*args, **kwargs)
    vals = sharded.stages[0](*args, **kwargs)
    assert isinstance(vals, tuple)
    for stage in sharded.stages[1:-1]:
        vals = stage(*vals)
        assert isinstance(vals, tuple)
    return sharded.stages[-1](*vals)


def stage_param_count(stage) -> int:
    return sum(p.numel() for p in stage.parameters())


BLOCK_PARAMS = 2 * (10 * 10 + 10)


@pytest.mark.parametrize("k", range(1, 11))
def test_branched_network_every_k(k):
    torch.manual_seed(0)
    model = BranchedNetwork()
    low = torch.randn(4, 10)           # sum far below 1000: right branch
    high = torch.full((4, 10), 100.0)  # sum 4000: left branch
    before = model_fingerprint(model)
    sharded = autoshard.shard_model(model, k, example_inputs=(low,))
    assert len(sharded.stages) == k
    assert max(stage_param_count(s) for s in sharded.stages) == math.ceil(10 / k) * BLOCK_PARAMS
    wrapped = [w.name for w in sharded.plan.wrapped]
    assert wrapped == [f"blocks.{i}" for i in range(10)]
    for x in (low, high):
        expected = model(x)
        assert torch.equal(sharded(x), expected)
        assert torch.equal(run_stages_by_hand(sharded, x), expected)
    assert_same_fingerprint(before, model_fingerprint(model))


def test_branched_inputs_really_take_both_branches():
    block = BranchedNetwork().blocks[0]
    high = torch.full((4, 10), 100.0)
    assert torch.equal(block(high), block.left(high))
    low = torch.zeros(4, 10)
    assert torch.equal(block(low), block.right(low))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_transformer_lm(k):
    model, args, kwargs = load_example("transformer-lm")
    before = model_fingerprint(model)
    sharded = autoshard.shard_model(model, k, example_inputs=args)
    assert len(sharded.stages) == k
    # The encoder and its layers are traced through: no module under it is an opaque leaf, and
    # every layer contributes its own nodes, so cuts can fall between or inside layers.
    assert not [w for w in sharded.plan.wrapped if w.kind == "module" and w.name.startswith("transformer_encoder")]
    assert all(layer_stages(sharded, i) for i in range(4))
    expected = model(*args)
    assert torch.equal(sharded(*args), expected)
    assert torch.equal(run_stages_by_hand(sharded, *args), expected)
    # A second input with another batch size and sequence length.
    src = torch.randint(0, 100, (7, 2))
    assert torch.equal(sharded(src, causal_mask(7)), model(src, causal_mask(7)))
    assert_same_fingerprint(before, model_fingerprint(model))


def layer_stages(sharded, layer: int) -> set[int]:
    """Stages holding nodes that run inside encoder layer ``layer``."""
    scope = f"transformer_encoder.layers.{layer}"
    dag = sharded.plan.dag
    return {stage for node, stage in sharded.plan.assignment.items()
            if any(path == scope for path, _ in dag.nodes[node].get("scopes", ()))}


def test_transformer_lm_layers_spread_over_stages_at_k4():
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, 4, example_inputs=args)
    stages = set().union(*(layer_stages(sharded, i) for i in range(4)))
    assert len(stages) >= 2  # the layers do not all land in one stage


@pytest.mark.parametrize("factory", [ResidualMLP, LongSkip])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_skip_connections_split_into_exactly_k(factory, k):
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(4, 16)
    sharded = autoshard.shard_model(model, k, example_inputs=(x,))
    assert len(sharded.stages) == k
    assert all(stage_param_count(s) > 0 for s in sharded.stages)
    assert torch.equal(sharded(x), model(x))
    assert torch.equal(run_stages_by_hand(sharded, x), model(x))


def test_long_skip_carries_the_input_through_every_stage():
    model = LongSkip()
    x = torch.randn(4, 16)
    sharded = autoshard.shard_model(model, 4, example_inputs=(x,))
    assert all("x" in boundary for boundary in sharded.plan.boundaries)


def test_one_stage_takes_inputs_and_returns_the_output():
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 1, example_inputs=args)
    assert len(sharded.stages) == 1
    assert torch.equal(sharded.stages[0](*args), model(*args))


def test_stages_hold_the_original_parameter_objects_under_original_names():
    model = ResidualMLP()
    sharded = autoshard.shard_model(model, 4)
    originals = dict(model.named_parameters())
    seen = {}
    for stage in sharded.stages:
        for name, param in stage.named_parameters():
            assert param is originals[name]
            seen[name] = param
    assert seen.keys() == originals.keys()


def test_same_model_and_options_give_the_same_stages():
    def plan():
        model, args, _ = load_example("transformer-lm")
        sharded = autoshard.shard_model(model, 3, example_inputs=args)
        return sharded.plan.assignment, [s.code for s in sharded.stages]

    assert plan() == plan()


def test_training_mode_dropout_is_verified_with_a_replayed_seed():
    model, args, _ = load_example("transformer-lm")
    model.train()
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    assert model.training  # verification did not switch the model to eval
    torch.manual_seed(3)
    expected = model(*args)
    torch.manual_seed(3)
    assert torch.equal(sharded(*args), expected)
