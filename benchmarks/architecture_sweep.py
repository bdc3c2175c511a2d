"""Architectures beyond the test zoo: does ``shard_model`` take each as users call it?

    python benchmarks/architecture_sweep.py                 # every architecture, about four minutes
    python benchmarks/architecture_sweep.py swin llama-hidden-states   # some of them

Tiny configs with random weights (2 layers, width 32, vocabulary 100), nothing downloaded. Each
model is sharded into 3 stages from an example (batch 2), which ``shard_model`` verifies exactly,
and the stages are then called on a later input of another batch size (and sequence length, for
text) and compared with the model: a graph that baked the example's values in passes the first
check and fails the second. Models run in eval mode, as for inference, except those named
``-train`` (and the checkpointed Llama), which run in training mode and, when they return a loss,
backward.
The table says what the capture kept whole and the seconds taken; a failure shows its message.
``tests/test_real_models_zoo.py`` holds the families CI runs.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import diffusers as D  # noqa: E402
import transformers as T  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import autoshard  # noqa: E402

VOCAB = 100
STAGES = 3
LAYERS = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, vocab_size=VOCAB)
DECODER = dict(LAYERS, num_key_value_heads=1)
Inputs = Callable[[int, int], dict[str, Any]]


def text(**extra: Any) -> Inputs:
    """Token ids and a mask whose first row starts with padding, plus ``extra`` arguments."""
    def make(batch: int, seq: int) -> dict[str, Any]:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, : seq // 3] = 0
        return {"input_ids": torch.randint(0, VOCAB, (batch, seq)), "attention_mask": mask, **extra}
    return make


def ids_only(**extra: Any) -> Inputs:
    return lambda batch, seq: {"input_ids": torch.randint(0, VOCAB, (batch, seq)), **extra}


def with_labels(batch: int, seq: int) -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (batch, seq))
    return {"input_ids": ids, "labels": ids}


def seq2seq(batch: int, seq: int) -> dict[str, Any]:
    return {**text(use_cache=False)(batch, seq), "decoder_input_ids": torch.randint(0, VOCAB, (batch, seq // 2 + 1))}


def images(size: int) -> Inputs:
    return lambda batch, _: {"pixel_values": torch.randn(batch, 3, size, size)}


def llama_gradient_checkpointing() -> nn.Module:
    model = T.LlamaForCausalLM(T.LlamaConfig(**DECODER, use_cache=False))
    model.gradient_checkpointing_enable()
    return model


WAV2VEC2 = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, conv_dim=(8, 8),
                conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2)


ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], Inputs]] = {
    "phi": (lambda: T.PhiModel(T.PhiConfig(**LAYERS)), text(use_cache=False)),
    "phi3": (lambda: T.Phi3Model(T.Phi3Config(**DECODER, pad_token_id=0)), text(use_cache=False)),
    "gemma": (lambda: T.GemmaModel(T.GemmaConfig(**DECODER, head_dim=16)), text(use_cache=False)),
    "gemma2": (lambda: T.Gemma2Model(T.Gemma2Config(**DECODER, head_dim=16)), text(use_cache=False)),
    "falcon": (lambda: T.FalconModel(T.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                    vocab_size=VOCAB)), text(use_cache=False)),
    "gpt-j": (lambda: T.GPTJModel(T.GPTJConfig(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB,
                                               rotary_dim=8)), text(use_cache=False)),
    "bloom": (lambda: T.BloomModel(T.BloomConfig(n_layer=2, hidden_size=32, n_head=2, vocab_size=VOCAB)),
              text(use_cache=False)),
    "gpt-bigcode": (lambda: T.GPTBigCodeModel(T.GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                                                 vocab_size=VOCAB)), text(use_cache=False)),
    "codegen": (lambda: T.CodeGenModel(T.CodeGenConfig(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                                       vocab_size=VOCAB, rotary_dim=8)), text(use_cache=False)),
    "granite": (lambda: T.GraniteModel(T.GraniteConfig(**DECODER)), text(use_cache=False)),
    "starcoder2": (lambda: T.Starcoder2Model(T.Starcoder2Config(**DECODER)), text(use_cache=False)),
    "stablelm": (lambda: T.StableLmModel(T.StableLmConfig(**DECODER)), text(use_cache=False)),
    "olmo": (lambda: T.OlmoModel(T.OlmoConfig(**DECODER)), text(use_cache=False)),
    "cohere": (lambda: T.CohereModel(T.CohereConfig(**DECODER)), text(use_cache=False)),
    "xglm": (lambda: T.XGLMModel(T.XGLMConfig(num_layers=2, d_model=32, attention_heads=2, ffn_dim=64,
                                              vocab_size=VOCAB, max_position_embeddings=64)), text(use_cache=False)),
    "qwen2-moe": (lambda: T.Qwen2MoeModel(T.Qwen2MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=32)),
                  text(use_cache=False)),
    "recurrent-gemma": (lambda: T.RecurrentGemmaModel(T.RecurrentGemmaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
        lru_width=32, attention_window_size=8, block_types=["recurrent", "attention"], num_key_value_heads=1,
        head_dim=16)), text(use_cache=False)),
    "rwkv": (lambda: T.RwkvModel(T.RwkvConfig(num_hidden_layers=2, hidden_size=32, attention_hidden_size=32,
                                              intermediate_size=64, vocab_size=VOCAB, context_length=64)),
             ids_only(use_cache=False)),
    "mamba": (lambda: T.MambaModel(T.MambaConfig(num_hidden_layers=2, hidden_size=32, vocab_size=VOCAB,
                                                 state_size=4)), ids_only(use_cache=False)),
    "roberta": (lambda: T.RobertaModel(T.RobertaConfig(**LAYERS)), text()),
    "electra": (lambda: T.ElectraModel(T.ElectraConfig(**LAYERS, embedding_size=32)), text()),
    "albert": (lambda: T.AlbertModel(T.AlbertConfig(**LAYERS, embedding_size=16)), text()),
    "deberta-v2": (lambda: T.DebertaV2Model(T.DebertaV2Config(**LAYERS)), text()),
    "mpnet": (lambda: T.MPNetModel(T.MPNetConfig(**LAYERS)), text()),
    "xlnet": (lambda: T.XLNetModel(T.XLNetConfig(n_layer=2, d_model=32, n_head=2, d_inner=64, vocab_size=VOCAB)),
              text()),
    "funnel": (lambda: T.FunnelModel(T.FunnelConfig(block_sizes=[1, 1], d_model=32, n_head=2, d_head=16,
                                                    d_inner=64, vocab_size=VOCAB)), text()),
    "big-bird": (lambda: T.BigBirdModel(T.BigBirdConfig(**LAYERS, attention_type="original_full")), text()),
    "clip-text": (lambda: T.CLIPTextModel(T.CLIPTextConfig(**LAYERS)), ids_only()),
    "bart": (lambda: T.BartModel(T.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32,
                                              encoder_attention_heads=2, decoder_attention_heads=2,
                                              encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                                              max_position_embeddings=64)), seq2seq),
    "pegasus": (lambda: T.PegasusModel(T.PegasusConfig(encoder_layers=1, decoder_layers=1, d_model=32,
                                                       encoder_attention_heads=2, decoder_attention_heads=2,
                                                       encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                                                       max_position_embeddings=64)), seq2seq),
    "swin": (lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                              num_heads=[1, 2], window_size=4)), images(32)),
    "convnext": (lambda: T.ConvNextModel(T.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1])),
                 images(32)),
    "resnet": (lambda: T.ResNetModel(T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
               images(32)),
    "segformer": (lambda: T.SegformerModel(T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                                             hidden_sizes=[8, 16], num_attention_heads=[1, 2],
                                                             patch_sizes=[7, 3], strides=[4, 2],
                                                             mlp_ratios=[2, 2])), images(32)),
    "mobilevit": (lambda: T.MobileViTModel(T.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                                             neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                                                             num_attention_heads=2)), images(32)),
    "dinov2": (lambda: T.Dinov2Model(T.Dinov2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                    intermediate_size=64, image_size=28, patch_size=7)), images(28)),
    "beit": (lambda: T.BeitModel(T.BeitConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                              intermediate_size=64, image_size=32, patch_size=8)), images(32)),
    "vit-classifier-labels": (lambda: T.ViTForImageClassification(T.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=4, num_labels=3)),
        lambda batch, _: {"pixel_values": torch.randn(batch, 3, 16, 16), "labels": torch.arange(batch) % 3}),
    "wav2vec2": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**WAV2VEC2)),
                 lambda batch, seq: {"input_values": torch.randn(batch, 50 * seq)}),
    "wav2vec2-train": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**WAV2VEC2, mask_time_prob=0.5)),
                       lambda batch, seq: {"input_values": torch.randn(batch, 50 * seq)}),
    "llama-hidden-states": (lambda: T.LlamaModel(T.LlamaConfig(**DECODER)),
                            text(use_cache=False, output_hidden_states=True)),
    "llama-attentions": (lambda: T.LlamaModel(T.LlamaConfig(**DECODER, attn_implementation="eager")),
                         text(use_cache=False, output_attentions=True)),
    "llama-bf16": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER, use_cache=False)).to(torch.bfloat16),
                   ids_only()),
    "llama-train-checkpointing": (llama_gradient_checkpointing, with_labels),
    "gpt2-train-labels": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                                                 vocab_size=VOCAB, use_cache=False)), with_labels),
    "bert-masked-lm-train": (lambda: T.BertForMaskedLM(T.BertConfig(**LAYERS)), with_labels),
    "t5-generation-labels": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16, num_heads=2, d_ff=64, vocab_size=VOCAB,
        decoder_start_token_id=0)),
        lambda batch, seq: {**ids_only(use_cache=False)(batch, seq),
                            "labels": torch.randint(0, VOCAB, (batch, seq // 2 + 1))}),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(LAYERS, vocab_size=VOCAB, max_position_embeddings=32),
        vision_config=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                           image_size=16, patch_size=8), projection_dim=16)),
             lambda batch, seq: {**ids_only()(batch, seq), "pixel_values": torch.randn(batch, 3, 16, 16)}),
    "perceiver": (lambda: T.PerceiverModel(T.PerceiverConfig(
        num_latents=4, d_latents=16, d_model=16, num_blocks=1, num_self_attends_per_block=1,
        num_self_attention_heads=1, num_cross_attention_heads=1)),
        lambda batch, seq: {"inputs": torch.randn(batch, seq, 16)}),
    "longformer": (lambda: T.LongformerModel(T.LongformerConfig(**LAYERS, attention_window=4)), ids_only()),
    "encodec": (lambda: T.EncodecModel(T.EncodecConfig(
        hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2], codebook_size=16,
        codebook_dim=16, num_lstm_layers=1)), lambda batch, seq: {"input_values": torch.randn(batch, 1, 16 * seq)}),
    # diffusers (the CI zoo holds a conditional UNet and an SD3 transformer)
    "diffusers-unet2d": (lambda: D.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8), lambda batch, seq: {"sample": torch.randn(batch, 3, 2 * seq, 2 * seq),
                                                "timestep": torch.tensor(3)}),
    "diffusers-vae": (lambda: D.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
        norm_num_groups=8, layers_per_block=1), lambda batch, seq: {"sample": torch.randn(batch, 3, 2 * seq, 2 * seq)}),
    "diffusers-dit": (lambda: D.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10), lambda batch, _: {"hidden_states": torch.randn(batch, 4, 8, 8),
                                                   "timestep": torch.ones(batch, dtype=torch.long),
                                                   "class_labels": torch.zeros(batch, dtype=torch.long)}),
    "diffusers-flux": (lambda: D.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)),
        lambda batch, seq: {"hidden_states": torch.randn(batch, seq, 8),
                            "encoder_hidden_states": torch.randn(batch, 5, 16),
                            "pooled_projections": torch.randn(batch, 8), "timestep": torch.ones(batch),
                            "img_ids": torch.randn(seq, 3), "txt_ids": torch.randn(5, 3)}),
}
#: Run in training mode (dropout replayed from one seed); every other model is put in eval mode.
TRAINING = frozenset({"wav2vec2-train", "llama-train-checkpointing", "gpt2-train-labels", "bert-masked-lm-train"})
EXAMPLE, LATER = (2, 8), (3, 5)


def tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def check(build: Callable[[], nn.Module], inputs: Inputs, training: bool,
          example: tuple[int, int] = EXAMPLE, later: tuple[int, int] = LATER) -> tuple[str, str, float, str]:
    """(result, kept whole, seconds, note): shard ``build()`` from ``inputs(*example)``, then compare
    the stages with the model on ``inputs(*later)`` (same seed, exactly)."""
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        model = build().train(training)
        sharded = autoshard.shard_model(model, STAGES, example_kwargs=inputs(*example))
        call = inputs(*later)
        torch.manual_seed(1)
        actual = sharded(**call)
        torch.manual_seed(1)
        expected = model(**call)
        if model.training and getattr(actual, "loss", None) is not None:
            actual.loss.backward()
        same = len(tensors(actual)) == len(tensors(expected)) and all(
            torch.equal(a, e) for a, e in zip(tensors(actual), tensors(expected)))
        kept = ", ".join(w.name for w in sharded.plan.wrapped) or "-"
        return ("ok" if same else "DIFFERS on the later input"), kept, time.perf_counter() - start, ""
    except Exception as exc:  # noqa: BLE001 - the table reports every failure
        message = " ".join(str(exc).split())
        return "FAILS", "-", time.perf_counter() - start, f"{type(exc).__name__}: {message[:300]}"


def sweep(checks: dict[str, Callable[[], tuple[str, str, float, str]]], kind: str) -> None:
    """Run each check and print one table row per name, then the count that passed."""
    warnings.filterwarnings("ignore")
    table = Table(title=f"shard_model into {STAGES} stages, then a later input of another shape")
    for column in (kind, "result", "kept whole", "seconds", "note"):
        table.add_column(column, overflow="fold")
    failures = 0
    for name, run in checks.items():
        result, kept, seconds, note = run()
        failures += result != "ok"
        table.add_row(name, result, kept, f"{seconds:.1f}", note)
    Console(width=160).print(table)
    print(f"{len(checks) - failures} of {len(checks)} {kind}s shard and serve a later input exactly")


def main() -> None:
    names = sys.argv[1:] or list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)}; known: {', '.join(ARCHITECTURES)}")
    sweep({name: functools.partial(check, *ARCHITECTURES[name], name in TRAINING) for name in names}, "architecture")


if __name__ == "__main__":
    main()
