"""``verify`` catches a capture that drifted from the model, such as a config rebuilt from its
fields that lost a private setting, and it compares in the mode the capture recorded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_capture_fx import Config, UsesConfig

import autoshard
from autoshard.capture import trace_with_leaves
from autoshard.errors import VerificationError
from autoshard.verify import verify_stages


def _rebuilt_config(gm: torch.fx.GraphModule, config: Config) -> None:
    """What plain fx does to a dataclass argument: a new one from the fields, private state lost."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and getattr(gm, node.target) is config:
            fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
            setattr(gm, node.target, Config(**fields))


def test_a_rebuilt_config_is_caught_before_any_stage():
    model = UsesConfig()
    x = torch.randn(4, 3)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,))  # verified: the config is the model's
    traced = trace_with_leaves(model, (x,)).graph_module
    _rebuilt_config(traced, model.config)
    with pytest.raises(VerificationError, match="traced graph differs from the model before any") as info:
        verify_stages(model, traced, list(sharded.stages), sharded.plan.boundaries, (x,), {})
    assert info.value.stage is None


def test_keyword_inputs_and_constants_are_verified_like_positional_ones():
    model = UsesConfig()
    sharded = autoshard.shard_model(model, 2, example_kwargs={"x": torch.randn(4, 3)})
    assert torch.equal(sharded(x=torch.ones(2, 3)), model(torch.ones(2, 3)))


def test_verification_leaves_no_gradients_behind():
    model = UsesConfig()
    autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 3),))
    assert all(p.grad is None for p in model.parameters())
