"""PyTorch's fused inference paths are kept: in eval mode the stages run the model's kernels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard

SPEC = "{front}{options},shape-prop,build-dag,linearize,split,emit,verify"


def _encoder(layers: int = 3) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def _kept_whole(sharded: autoshard.ShardedModel) -> list[str]:
    return [w.name for w in sharded.plan.wrapped if w.by_design]


@pytest.mark.parametrize("front", ["capture", "trace", "export"])
def test_encoder_layers_in_eval_mode_are_kept_whole_and_bit_exact(front):
    model = _encoder()
    x = torch.randn(2, 6, 32)
    sharded = autoshard.shard_model(model, 3, (x,), pipeline=SPEC.format(front=front, options=""))
    assert _kept_whole(sharded) == ["layers.0", "layers.1", "layers.2"]
    with torch.no_grad():  # the fused kernel runs only without grad: the model takes it, and so do the stages
        assert torch.equal(sharded(x), model(x))
    assert torch.equal(sharded(x), model(x))


def test_fused_paths_false_traces_through_them_for_a_finer_split():
    model = _encoder(layers=1)
    x = torch.randn(2, 6, 32)
    spec = SPEC.format(front="capture", options="{fused-paths=false}")
    sharded = autoshard.shard_model(model, 3, (x,), pipeline=spec)
    assert _kept_whole(sharded) == []
    assert not any(n.op == "call_module" and n.target.endswith("layers.0")
                   for stage in sharded.stages for n in stage.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), model(x))  # other kernels: equal to rounding


def test_in_training_there_is_no_fused_path_and_layers_are_traced_through():
    model = _encoder().train()
    x = torch.randn(2, 6, 32)
    sharded = autoshard.shard_model(model, 3, (x,))
    assert _kept_whole(sharded) == []
    torch.manual_seed(1)
    expected = model(x)
    torch.manual_seed(1)
    assert torch.equal(sharded(x), expected)


def test_a_layer_whose_settings_rule_out_the_fused_path_is_traced_through():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64)  # not batch_first: the regular path, always
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(6, 2, 32),))
    assert _kept_whole(sharded) == []


def test_the_auto_capture_does_not_count_modules_kept_whole_by_design():
    """``capture`` keeps fx when it wraps no module because it failed: export is not tried."""
    sharded = autoshard.shard_model(_encoder(), 2, (torch.randn(2, 6, 32),))
    assert sharded.plan.wrapped and not [w for w in sharded.plan.wrapped if not w.by_design]


class PaddedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=padding))


@pytest.mark.parametrize("options", ["", "{fused-paths=false}"])
def test_an_encoder_given_a_padding_mask_is_kept_whole_as_it_packs_the_batch(options):
    """In eval mode without grad ``nn.TransformerEncoder`` packs a padded batch into a nested
    tensor and leaves the padded positions at zero; traced through (as before), the stages
    computed values there, and verification, run with grad, did not see it."""
    torch.manual_seed(0)
    model = PaddedEncoder().eval()
    x, padding = torch.randn(2, 6, 16), torch.zeros(2, 6, dtype=torch.bool)
    padding[:, 4:] = True
    sharded = autoshard.shard_model(model, 2, (x, padding), pipeline=SPEC.format(front="capture", options=options))
    assert _kept_whole(sharded) == ["encoder"]
    with torch.no_grad():
        expected = model(x, padding)
        assert torch.equal(sharded(x, padding), expected)
    assert torch.equal(sharded(x, padding), model(x, padding))
