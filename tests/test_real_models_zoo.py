"""The real-model families the suite shards: tiny configs, random weights, nothing downloaded.

Each family is built the way users build it and called the way users call it: keyword inputs
(``input_ids``, ``attention_mask``, ``pixel_values``, a diffusion model's ``sample`` and
``timestep``...), ``use_cache=False``, eval mode. Two
inputs per family: the example a plan is built from (batch 2, sequence 8) and a later call
with another batch size and sequence length (3 and 5). ``GatedGPT2`` adds control flow on tensor
values (a gate module and a free function with a data-dependent loop), with a ``bias`` input
that picks the gate's branch. ``benchmarks/real_models.py`` imports this module too.

The tests at the bottom check the zoo itself: what the other tests take for granted.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import diffusers  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.whisper.modeling_whisper import WhisperEncoder  # noqa: E402

VOCAB = 100
EXAMPLE = (2, 8)  # batch, sequence of the example a plan is built from
LATER = (3, 5)    # a later call: another batch size and sequence length


@dataclass(frozen=True)
class Family:
    """A model family: how to build it and its inputs for a (batch, sequence) shape."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], dict[str, Any]]
    max_leaves: int = 0  # modules and functions the default capture may wrap


def _generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * key[0] + key[1])


def token_ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=_generator(batch, seq))


def text(batch: int, seq: int, cache: bool = True) -> dict[str, Any]:
    """Token ids and a padding mask (the first row's first third is padding)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, : seq // 3] = 0
    inputs: dict[str, Any] = {"input_ids": token_ids(batch, seq), "attention_mask": mask}
    if cache:
        inputs["use_cache"] = False
    return inputs


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build().eval()
    return seeded


def _called_once(model: nn.Module) -> nn.Module:
    """``model`` after one call, as a user's model usually is: Transformers installs the hooks that record
    its outputs on the first (the tests check that sharding leaves a model's hooks as they were)."""
    with torch.no_grad():
        model(torch.zeros(1, 3, 16, 16))
    return model


SEGFORMER = transformers.SegformerConfig(
    num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2],
    num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3)
LAYERS = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, vocab_size=VOCAB)
DECODER = dict(LAYERS, num_key_value_heads=1)


class ValueGate(nn.Module):
    """One of two paths, chosen by the sign of its input's mean: control flow on tensor values."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) if x.mean() > 0 else self.down(x)


def halve_until_small(x: torch.Tensor) -> torch.Tensor:
    """A loop whose trip count depends on tensor values."""
    while x.abs().max() > 4:
        x = x / 2
    return x


class GatedGPT2(nn.Module):
    """GPT-2 with a value-dependent gate and a value-dependent free function after it."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt2 = transformers.GPT2Model(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB))
        self.gate = ValueGate(32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt2(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
        return self.head(halve_until_small(self.gate(hidden + bias)))


def gated_inputs(batch: int, seq: int, sign: float = 1.0) -> dict[str, Any]:
    """``sign`` +1 takes the gate's ``up`` path, -1 its ``down`` path."""
    return {**text(batch, seq, cache=False), "bias": torch.full((batch, 1, 1), 50.0 * sign)}


FAMILIES: tuple[Family, ...] = (
    Family("gpt2", _seeded(lambda: transformers.GPT2Model(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB))), text),
    Family("bert", _seeded(lambda: transformers.BertModel(transformers.BertConfig(**LAYERS))),
           lambda b, s: text(b, s, cache=False)),
    Family("llama", _seeded(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))),
           text),
    Family("t5", _seeded(lambda: transformers.T5Model(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16, num_heads=2, d_ff=64, vocab_size=VOCAB))),
        lambda b, s: {**text(b, s), "decoder_input_ids": token_ids(b, s // 2 + 1)}),
    Family("opt", _seeded(lambda: transformers.OPTModel(transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, ffn_dim=64, max_position_embeddings=64,
        word_embed_proj_dim=32, vocab_size=VOCAB))), text),
    Family("mistral", _seeded(lambda: transformers.MistralModel(transformers.MistralConfig(**DECODER))),
           text),
    Family("qwen2", _seeded(lambda: transformers.Qwen2Model(transformers.Qwen2Config(**DECODER))), text),
    Family("vit", _seeded(lambda: transformers.ViTModel(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=4))),
        lambda b, s: {"pixel_values": torch.randn(b, 3, 16, 16, generator=_generator(b, s))}),
    # SegFormer's decode head reshapes the hidden states Transformers records with forward hooks:
    # capture must make them nodes, not constants holding the example's values.
    Family("segformer", _seeded(lambda: _called_once(transformers.SegformerForSemanticSegmentation(SEGFORMER))),
           lambda b, s: {"pixel_values": torch.randn(b, 3, 16, 16, generator=_generator(b, s))}),
    # Swin's layers store their window size on themselves in forward: capture must undo that.
    Family("swin", _seeded(lambda: transformers.SwinModel(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4))),
        lambda b, s: {"pixel_values": torch.randn(b, 3, 32, 32, generator=_generator(b, s))}),
    Family("distilbert", _seeded(lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
        n_layers=2, dim=32, n_heads=2, hidden_dim=64, max_position_embeddings=64, vocab_size=VOCAB))),
        lambda b, s: text(b, s, cache=False)),
    Family("gpt-neox", _seeded(lambda: transformers.GPTNeoXModel(transformers.GPTNeoXConfig(**LAYERS))),
           text),
    Family("mixtral", _seeded(lambda: transformers.MixtralModel(transformers.MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2))), text),
    # DeepSeek-V3: attention through low-rank query and key-value projections, each head split into a rotary
    # and a plain part, and a mixture of experts routed by groups after a first dense layer.
    Family("deepseek-v3", _seeded(lambda: transformers.DeepseekV3Model(transformers.DeepseekV3Config(
        **LAYERS, num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16))), text),
    Family("whisper-encoder", _seeded(lambda: WhisperEncoder(transformers.WhisperConfig(
        encoder_layers=2, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, vocab_size=VOCAB))),
        lambda b, s: {"input_features": torch.randn(b, 8, 32, generator=_generator(b, s))}),
    Family("nn-transformer", _seeded(lambda: nn.Transformer(
        d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64, dropout=0.0,
        batch_first=True)),
        lambda b, s: {"src": torch.randn(b, s, 32, generator=_generator(b, s)),
                      "tgt": torch.randn(b, s // 2 + 1, 32, generator=_generator(s, b))}),
    Family("gated-gpt2", _seeded(GatedGPT2), gated_inputs, max_leaves=2),
    # diffusers: latents of side 2 x sequence (a multiple of the UNet's down-sampling), text
    # states of the sequence's length; the timestep per sample.
    Family("diffusers-unet", _seeded(lambda: diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)),
        lambda b, s: {"sample": torch.randn(b, 4, 2 * s, 2 * s, generator=_generator(b, s)),
                      "timestep": torch.full((b,), 10),
                      "encoder_hidden_states": torch.randn(b, s, 16, generator=_generator(s, b))}),
    Family("diffusers-sd3", _seeded(lambda: diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=16)),
        lambda b, s: {"hidden_states": torch.randn(b, 4, 2 * s, 2 * s, generator=_generator(b, s)),
                      "encoder_hidden_states": torch.randn(b, s, 16, generator=_generator(s, b)),
                      "pooled_projections": torch.randn(b, 8, generator=_generator(b, b, s)),
                      "timestep": torch.full((b,), 1)}),
)

BY_NAME = {f.name: f for f in FAMILIES}

pytestmark = pytest.mark.slow


def _shapes(inputs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def test_families_build_the_same_model_every_time():
    for family in (BY_NAME["gpt2"], BY_NAME["gated-gpt2"]):
        first, second = family.build(), family.build()
        pairs = zip(first.state_dict().values(), second.state_dict().values())
        assert all(torch.equal(a, b) for a, b in pairs)
        assert not first.training


def test_later_inputs_differ_in_batch_and_sequence_from_the_example():
    for family in FAMILIES:
        example, later = _shapes(family.inputs(*EXAMPLE)), _shapes(family.inputs(*LATER))
        assert example.keys() == later.keys()
        assert all(example[k][0] == 2 and later[k][0] == 3 for k in example), family.name
    assert _shapes(text(*EXAMPLE))["input_ids"] == (2, 8) and _shapes(text(*LATER))["input_ids"] == (3, 5)


def test_gated_inputs_take_both_branches_of_the_gate_and_the_loop():
    model = BY_NAME["gated-gpt2"].build()
    taken = []
    model.gate.up.register_forward_hook(lambda *_: taken.append("up"))
    model.gate.down.register_forward_hook(lambda *_: taken.append("down"))
    with torch.no_grad():
        model(**gated_inputs(*EXAMPLE, sign=1.0))
        model(**gated_inputs(*EXAMPLE, sign=-1.0))
    assert taken == ["up", "down"]
    assert torch.equal(halve_until_small(torch.tensor([3.0])), torch.tensor([3.0]))
    assert torch.equal(halve_until_small(torch.tensor([40.0])), torch.tensor([2.5]))
