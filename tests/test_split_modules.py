"""Random nn.Modules from the test kit split into exactly k stages that compute what the model does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.testing.modules import Gate, clip_large, dag_modules

from conftest import assert_same_fingerprint, model_fingerprint

STRATEGY_PASSES = ("split", "split{strategy=fixed-order}", "split{strategy=greedy}", "split{strategy=uniform}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_modules(), st.integers(1, 4), st.sampled_from(STRATEGY_PASSES))
def test_random_modules_split_into_exactly_k_equal_stages(built, k, split):
    model, inputs = built
    computed = len(model.blocks)
    k = min(k, computed)
    before = model_fingerprint(model)
    pipeline = f"trace,build-dag,linearize,{split},emit,verify"
    sharded = autoshard.shard_model(model, k, example_inputs=inputs, pipeline=pipeline)
    assert len(sharded.stages) == k
    expected, got = model(*inputs), sharded(*inputs)
    for a, b in zip(expected if isinstance(expected, tuple) else (expected,),
                    got if isinstance(got, tuple) else (got,)):
        assert torch.equal(a, b)
    assert_same_fingerprint(before, model_fingerprint(model))


def test_the_kit_blocks_really_branch_on_their_input():
    gate = Gate()
    high, low = torch.full((1, 4), 5.0), torch.full((1, 4), -5.0)
    assert torch.equal(gate(high), gate.up(high)) and torch.equal(gate(low), gate.down(low))
    assert torch.equal(clip_large(high), high.clamp(-3, 3))
    assert torch.equal(clip_large(torch.ones(1, 4)), torch.full((1, 4), 2.0))
    with pytest.raises(Exception):  # fx cannot trace a branch on a value
        torch.fx.symbolic_trace(gate)
