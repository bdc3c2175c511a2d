"""Boundaries carry tensors only once shapes are known; boundary sizes are real bytes; stages
keep the model's buffer persistence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.costs.values import TensorMeta
from autoshard.examples import load_example
from autoshard.examples.models import causal_mask


def boundary_tensors(sharded, *args):
    """The actual values each stage sends, run stage by stage."""
    sent = []
    values = sharded.stages[0](*args)
    for stage in sharded.stages[1:]:
        sent.append(values)
        values = stage(*values)
    return sent


@pytest.mark.parametrize("k", [2, 3, 4])
def test_transformer_lm_boundaries_are_tensors_only_and_outputs_exact(k):
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, k, example_inputs=args)
    for j, values in enumerate(boundary_tensors(sharded, *args)):
        assert all(isinstance(v, torch.Tensor) for v in values), sharded.plan.boundaries[j]
        for value, described in zip(values, sharded.plan.boundary_values(j)):
            assert described.meta == TensorMeta(tuple(value.shape), str(value.dtype).removeprefix("torch."),
                                                value.numel() * value.element_size())
            assert described.nbytes == value.numel() * value.element_size()
    assert torch.equal(sharded(*args), model(*args))
    src = torch.randint(0, 100, (7, 2))
    assert torch.equal(sharded(src, causal_mask(7)), model(src, causal_mask(7)))


def test_without_shapes_the_old_behaviour_sends_non_tensors():
    """The contrast that shows the test above checks something: no shape-prop, a bool crosses."""
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, 3, pipeline="trace,build-dag,linearize,split,emit")
    sent = boundary_tensors(sharded, *args)
    assert any(not isinstance(v, torch.Tensor) for values in sent for v in values)


def test_non_tensor_values_have_no_out_edges_in_the_dag():
    model, args, _ = load_example("transformer-lm")
    dag = autoshard.shard_model(model, 2, example_inputs=args).plan.dag
    non_tensors = [n for n, d in dag.nodes(data=True) if not d["tensor"] and not d["input"]]
    assert non_tensors  # sizes, dtypes, the is_causal bool
    assert all(dag.out_degree(n) == 0 and not dag.nodes[n]["output"] for n in non_tensors)
    assert all(dag.nodes[n]["bytes"] == 0 for n in non_tensors)


class ReturnsALength(nn.Module):
    """Its output holds an int computed early, which the last stage must recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x: torch.Tensor):
        length = x.size(0)
        return self.layers(x)[:length - 1], length


def test_a_non_tensor_output_is_recomputed_by_the_last_stage():
    model = ReturnsALength()
    x = torch.randn(5, 8)
    sharded = autoshard.shard_model(model, 4, example_inputs=(x,))
    for values in boundary_tensors(sharded, x):
        assert all(isinstance(v, torch.Tensor) for v in values)
    out, length = sharded(x)
    expected, expected_length = model(x)
    assert torch.equal(out, expected) and length == expected_length == 5


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.inv_freq + self.scale


class RotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Rotary()
        self.second = Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_stage_state_dict_keys_are_the_models_restricted_to_the_stage():
    model = RotaryNet()
    x = torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
    model_keys = set(model.state_dict())
    seen = set()
    for stage in sharded.stages:
        keys = set(stage.state_dict())
        assert keys <= model_keys
        assert not any(k.endswith("inv_freq") for k in keys)
        held = {n for n, _ in [*stage.named_parameters(), *stage.named_buffers()]}
        assert keys == held & model_keys  # every persistent thing it holds, nothing else
        seen |= keys
    assert seen == model_keys
    assert torch.equal(sharded(x), model(x))
