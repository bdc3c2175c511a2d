"""Predicted training memory per stage against what the stage really holds (issue 20).

    python benchmarks/memory_accuracy.py            # the full grid and the budget table (long: ~1 h on two busy cores)
    python benchmarks/memory_accuracy.py --quick    # k = 4, 4 microbatches, Adam, the built-in examples
    python benchmarks/memory_accuracy.py --budgets  # the budget table only (--models to pick some)
    python benchmarks/memory_accuracy.py --quick --device cuda --models gpt-lm-gpu,gpt2-small  # on a GPU

For each model, k = 2, 4, 8, 1, 4 and 8 microbatches (1F1B), Adam and SGD, one row per stage:
* measured: ``autoshard.runtime.measure_stage_memory``, the peak of live tensor storages while the
  stage runs its microbatches in flight forward and one backward, with gradients and fp32
  optimizer state materialised, and then ends the step (the tied-gradient sum's buffer and the
  optimizer's real step, as ``torch.optim`` runs it on that device);
* predicted: ``plan_report(sharded, memory=MemoryModel(microbatches=..., optimizer=...)).stages[j].memory.total``,
  the model ``max_memory`` plans with (``autoshard/costs/memory.py``);
* weights only: what accelerate's ``compute_module_sizes`` / ``infer_auto_device_map`` count, the
  bytes of the stage's parameters and buffers (re-implemented: two lines, no install);
* DeepSpeed: its model-state formula without ZeRO, 16 B per parameter for fp32 Adam (4 weights +
  4 gradients + 8 optimizer); for plain SGD the same formula with no optimizer state, 8 B.
Ratios are estimate / measured; the issue's target is the predicted one within 0.9-1.1.

Models: the built-in examples (residual MLP, GPT-style LM, TransformerLM) and, without
``--quick``, the branched example (blocks fake tensors cannot run), the activation-heavy GPT-style
LM of the issue (width 64, batch 16 x 256), a Hugging Face zoo in training mode built from tiny
configs (random weights, nothing downloaded): GPT-2, Llama, BERT, ViT, T5, a diffusers UNet and
Mixtral (an expert loop fake tensors cannot run), and an LSTM tagger (fused kernels); then ALBERT
(weights shared by every layer), Qwen2 (grouped-query attention, rotary), BART, Swin, ResNet
(BatchNorm buffers), Wav2Vec2 in eval mode, torch's ``nn.TransformerDecoder`` and an LM with tied
embedding and head in bf16.

With ``--device cuda`` each model is planned and measured on the GPU (the probe of what autograd
saves runs the GPU's kernels); ``gpt-lm-gpu`` and ``gpt2-small`` are sized for one.

Then the budget table: for budgets of 0.6 to 1.0 times the unconstrained plan's fullest stage
(k = 4, Adam, 4 microbatches), whether a plan is returned and, if so, its predicted and measured
peak against the budget on every stage (the target is no stage over), beside the least fullest
stage any split of program order reaches (``autoshard.costs.split_search.program_order``, exact,
the search a refusal now runs last), which says whether a refused budget had a fitting split.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

import autoshard  # noqa: E402
from autoshard.costs.memory_model import MemoryModel  # noqa: E402
from autoshard.costs.models import memory_parts  # noqa: E402
from autoshard.costs.split_search.program_order import JUDGEMENT_LIMIT, ProgramOrderSplits  # noqa: E402
from autoshard.costs.split_search.request import training_memory  # noqa: E402
from autoshard.examples import GPTStyleLM, load_example  # noqa: E402
from autoshard.graph.linearize import program_order  # noqa: E402
from autoshard.runtime import measure_stage_memory  # noqa: E402
from autoshard.runtime.optimizer_step import OPTIMIZER_STATE  # noqa: E402

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def tiny_gpt2() -> Case:
    """A 4-layer GPT-2 LM of width 64 in training mode (dropout on), 4 sequences of 32 tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, n_positions=64, vocab_size=100)
    model = transformers.GPT2LMHeadModel(config).train()
    return model, (), {"input_ids": torch.randint(0, 100, (4, 32)), "use_cache": False}


def wide_gpt_lm() -> Case:
    """The issue's activation-heavy case: GPT-style LM of width 64, 16 sequences of 256 tokens."""
    torch.manual_seed(0)
    return GPTStyleLM(width=64, layers=4, max_seq=256).eval(), (torch.randint(0, 100, (16, 256)),), {}


def gpu_gpt_lm() -> Case:
    """A GPT-style LM sized for a GPU (measured there, a tiny case's stages read the allocator's 512-byte
    rounding): 8 layers of width 1024 (0.47 GB of weights), 8 sequences of 512 tokens."""
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=8192, width=1024, layers=8, heads=16, max_seq=512).eval()
    return model, (torch.randint(0, 8192, (8, 512)),), {}


def gpt2_small() -> Case:
    """GPT-2 small's shape (12 layers of width 768) in training mode, 4 sequences of 512 tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=512, vocab_size=8192)
    model = transformers.GPT2LMHeadModel(config).train()
    return model, (), {"input_ids": torch.randint(0, 8192, (4, 512)), "use_cache": False}


def tiny_llama() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    inputs = {"input_ids": torch.randint(0, 128, (4, 32)), "use_cache": False}
    return transformers.LlamaForCausalLM(config).train(), (), inputs


def tiny_bert() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                     vocab_size=128, max_position_embeddings=64)
    return transformers.BertForMaskedLM(config).train(), (), {"input_ids": torch.randint(0, 128, (4, 32))}


def tiny_vit() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                    image_size=32, patch_size=8, num_labels=10)
    return transformers.ViTForImageClassification(config).train(), (), {"pixel_values": torch.randn(4, 3, 32, 32)}


def tiny_t5() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16,
                                   vocab_size=128)
    return transformers.T5ForConditionalGeneration(config).train(), (), {
        "input_ids": torch.randint(0, 128, (4, 16)), "decoder_input_ids": torch.randint(0, 128, (4, 16)),
        "use_cache": False}


def tiny_mixtral() -> Case:
    """A 4-layer Mixtral: its expert loop branches on which tokens the router sent (fake tensors
    cannot run it), and its grouped matrix product's fake kernel wants bf16."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    inputs = {"input_ids": torch.randint(0, 128, (4, 32)), "use_cache": False}
    return transformers.MixtralForCausalLM(config).train(), (), inputs


class _LSTMTagger(nn.Module):
    """Embedding, four single-layer LSTMs (the fused kernel's fake twin saves its workspace empty), head."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, width)
        self.layers = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(width, 128)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(x)


def lstm_tagger() -> Case:
    torch.manual_seed(0)
    return _LSTMTagger().train(), (torch.randint(0, 128, (4, 32)),), {}


def tiny_unet() -> Case:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(16, 32), norm_num_groups=8,
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    return model.train(), (torch.randn(2, 3, 16, 16), torch.tensor([10, 500])), {"return_dict": False}


def _hf(model_class: str, config_class: str, inputs: dict[str, Any], train: bool = True, **config: Any) -> Case:
    """A transformers model built from a tiny config with random weights (seed 0)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return (model.train() if train else model.eval()), (), inputs


def _tokens(vocab: int = 128, batch: int = 4, length: int = 32) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, vocab, (batch, length))


def _images(batch: int = 2, side: int = 32) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"pixel_values": torch.randn(batch, 3, side, side)}


_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)


def tiny_albert() -> Case:
    """ALBERT: one layer's weights shared by all four layers (a weight read on several stages)."""
    return _hf("AlbertForMaskedLM", "AlbertConfig", {"input_ids": _tokens()}, embedding_size=32, vocab_size=128,
               max_position_embeddings=64, **_SMALL)


def tiny_qwen2() -> Case:
    """Qwen2: grouped-query attention and rotary embeddings."""
    return _hf("Qwen2ForCausalLM", "Qwen2Config", {"input_ids": _tokens(), "use_cache": False}, num_key_value_heads=2,
               vocab_size=128, max_position_embeddings=64, **_SMALL)


def tiny_bart() -> Case:
    return _hf("BartForConditionalGeneration", "BartConfig",
               {"input_ids": _tokens(length=16), "decoder_input_ids": _tokens(length=16), "use_cache": False},
               vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)


def tiny_swin() -> Case:
    """Swin: shifted windows (rolls, window partitions: views and copies of the activations)."""
    return _hf("SwinForImageClassification", "SwinConfig", _images(), image_size=32, patch_size=4, embed_dim=16,
               depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=10)


def tiny_resnet() -> Case:
    """transformers' ResNetModel: BatchNorm in training mode (running statistics are buffers)."""
    return _hf("ResNetModel", "ResNetConfig", _images(), embedding_size=16, hidden_sizes=[16, 32, 64, 64],
               depths=[1, 1, 1, 1], layer_type="basic")


def tiny_wav2vec2() -> Case:
    """Wav2Vec2 in eval mode (dropout off): a convolutional feature encoder, then a transformer."""
    torch.manual_seed(1)
    return _hf("Wav2Vec2Model", "Wav2Vec2Config", {"input_values": torch.randn(2, 4000)}, train=False,
               conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=4, **_SMALL)


class _TorchDecoder(nn.Module):
    """``nn.TransformerDecoder`` (self- and cross-attention over a memory input) between an embedding and a head."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, width)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(width, 4, 128, batch_first=True), layers)
        self.head = nn.Linear(width, 128)

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.embed(tokens), memory))


def torch_decoder() -> Case:
    torch.manual_seed(0)
    model = _TorchDecoder().train()
    return model, (_tokens(), torch.randn(4, 16, 64)), {}


class _TiedLM(nn.Module):
    """Embedding and output head sharing one weight, residual MLP blocks between them."""

    def __init__(self, width: int = 64, layers: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def tied_bf16_lm() -> Case:
    """The tied LM with bf16 weights (``model.to(torch.bfloat16)``): activations and gradients 2 B."""
    torch.manual_seed(0)
    return _TiedLM().to(torch.bfloat16).train(), (_tokens(512),), {}


CASES: dict[str, Callable[[], Case]] = {
    "residual-mlp": lambda: load_example("residual-mlp"),
    "gpt-lm": lambda: load_example("gpt-lm"),
    "transformer-lm": lambda: load_example("transformer-lm"),
    "branched": lambda: load_example("branched"),
    "gpt-lm-wide": wide_gpt_lm,
    "hf-gpt2": tiny_gpt2,
    "hf-llama": tiny_llama,
    "hf-bert": tiny_bert,
    "hf-vit": tiny_vit,
    "hf-t5": tiny_t5,
    "diffusers-unet": tiny_unet,
    "hf-mixtral": tiny_mixtral,
    "lstm": lstm_tagger,
    "hf-albert": tiny_albert,
    "hf-qwen2": tiny_qwen2,
    "hf-bart": tiny_bart,
    "hf-swin": tiny_swin,
    "hf-resnet": tiny_resnet,
    "hf-wav2vec2": tiny_wav2vec2,
    "torch-decoder": torch_decoder,
    "tied-bf16": tied_bf16_lm,
    "gpt-lm-gpu": gpu_gpt_lm,
    "gpt2-small": gpt2_small,
}
QUICK = ("residual-mlp", "gpt-lm", "transformer-lm")


def plan(model: nn.Module, k: int, args: tuple, kwargs: dict, **options: Any) -> autoshard.ShardedModel:
    """The plan without the verify pass (values are not this benchmark's subject, and it is slow)."""
    if options:
        return autoshard.shard_model(model, k, example_inputs=args, example_kwargs=kwargs, **options)
    pipeline = f"capture,shape-prop,build-dag,linearize,split{{stages={k}}},emit"
    return autoshard.shard_model(model, k, example_inputs=args, example_kwargs=kwargs, pipeline=pipeline)


def weights_only(stage: nn.Module) -> int:
    """accelerate's view: the bytes of the distinct parameters and buffers a stage holds."""
    return sum(t.nbytes for t in {id(t): t for t in [*stage.parameters(), *stage.buffers()]}.values())


def deepspeed_model_states(stage: nn.Module, optimizer: str) -> int:
    """DeepSpeed's model-state estimate without ZeRO: (4 + 4 + 4 x state tensors) B per parameter."""
    params = sum(p.numel() for p in {id(p): p for p in stage.parameters() if p.requires_grad}.values())
    return params * (4 + 4 + 4 * len(OPTIMIZER_STATE[optimizer]))


def case_on(name: str, device: str) -> Case:
    """The case's model and inputs on ``device``, where it is planned and measured: the plan's probe of
    what autograd saves runs that device's kernels (flash attention on a GPU saves no attention matrix)."""
    model, args, kwargs = CASES[name]()
    return model.to(device), *tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))


def rows(name: str, ks: tuple[int, ...], counts: tuple[int, ...], optimizers: tuple[str, ...],
         device: str = "cpu") -> list[dict]:
    model, args, kwargs = case_on(name, device)
    out = []
    for k in ks:
        try:
            sharded = plan(model, k, args, kwargs)
        except autoshard.errors.AutoshardError as exc:
            print(f"{name} k={k}: no plan ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        for optimizer in optimizers:
            for count in counts:  # measured for each count: the receive buffers grow with it, not only in flight
                report = autoshard.plan_report(sharded, memory=MemoryModel(microbatches=count, optimizer=optimizer))
                for j in range(k):
                    m = measure_stage_memory(sharded, j, args, kwargs, microbatches=count, optimizer=optimizer)
                    stage = sharded.stages[j]
                    out.append(dict(model=name, k=k, mb=count, opt=optimizer, stage=j, in_flight=m.in_flight,
                                    measured=m.peak, parts=m.parts, predicted=report.stages[j].memory.total,
                                    predicted_parts=_predicted_parts(report.stages[j].memory),
                                    weights=weights_only(stage), deepspeed=deepspeed_model_states(stage, optimizer)))
                    show(out[-1:], head=False)  # as it goes: the full grid is long
    return out


def _predicted_parts(memory: Any) -> tuple[float, ...]:
    """The prediction's parts beside the measured ones: saved activations of the microbatches in
    flight, the received buffers, and the larger of a forward's and a backward's transient."""
    return (memory.activation_bytes * memory.in_flight, memory.buffer_bytes,
            max(memory.forward_bytes, memory.backward_bytes))


def least(splits: ProgramOrderSplits, high: float, steps: int = 14) -> float:
    """The least fullest stage over every split of program order, to 2^-steps of ``high`` (which fits);
    NaN where the search gives up (past ``JUDGEMENT_LIMIT`` stages judged a halving: a tiny Mixtral)."""
    found = splits.least_scaled((high,) * splits.k, 0.0, 1.0, steps, limit=(steps + 1) * JUDGEMENT_LIMIT)
    return found.scale * high if found is not None and found.exact else math.nan


def budget_rows(name: str, k: int = 4, fractions: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9, 1.0),
                device: str = "cpu") -> list[dict]:
    """Plans under max_memory at ``fractions`` of the unconstrained plan's fullest stage, predicted and
    measured, beside the least fullest stage any split of program order reaches (``least``: a budget
    below it has no fitting split of that order, one above it has)."""
    model, args, kwargs = case_on(name, device)
    free = plan(model, k, args, kwargs)
    fullest = max(s.memory.total for s in autoshard.plan_report(free).stages)
    dag, memory = free.plan.dag, MemoryModel()
    count = training_memory(dag, k, memory, lambda apart: memory_parts(dag, apart, memory))
    lowest = least(ProgramOrderSplits(dag, program_order(dag), k, count), fullest) / fullest
    out = []
    for fraction in fractions:
        budget = fraction * fullest
        row = dict(model=name, fraction=fraction, budget=budget, least=lowest, predicted=None, peaks=None)
        try:
            sharded = plan(model, k, args, kwargs, max_memory=budget)
        except autoshard.errors.InfeasibleSplitError:
            out.append(row)
            continue
        row["predicted"] = [s.memory.total for s in autoshard.plan_report(sharded).stages]
        row["peaks"] = [measure_stage_memory(sharded, j, args, kwargs).peak for j in range(k)]
        out.append(row)
        show_budgets(out[-1:], head=False)
    return out


def show_budgets(table: list[dict], head: bool = True) -> None:
    if head:
        print(f"\n{'model':<15}{'budget':>8}{'bytes':>12}{'least':>7}  plan     max / budget: predicted, measured"
              "   measured peak per stage")
    for r in table:
        known = not math.isnan(r["least"])
        line = f"{r['model']:<15}{r['fraction']:>7.2f}x{r['budget']:>12,.0f}" + (
            f"{r['least']:>6.3f}x  " if known else "    n/a  ")
        if r["peaks"] is None:
            missed = r["fraction"] >= r["least"]
            print(line + ("refused, though a split fits" if missed else "refused (no split of program order fits)"
                          if known else "refused (the exact search gave up)"))
            continue
        predicted, measured = max(r["predicted"]) / r["budget"], max(r["peaks"]) / r["budget"]
        print(line + f"made     {predicted:.3f}, {measured:.3f}{' OVER' if measured > 1 else ''}   "
              f"{' '.join(f'{p:,}' for p in r['peaks'])}", flush=True)
    if not head:
        return
    made = [r for r in table if r["peaks"] is not None]
    over = sum(max(r["peaks"]) > r["budget"] for r in made)
    missed = sum(r["peaks"] is None and r["fraction"] >= r["least"] for r in table)
    print(f"{len(made)}/{len(table)} budgets returned a plan ({missed} refused where a split of program order fits); "
          f"{over} of the plans with a stage measured over its budget")


def show(table: list[dict], head: bool = True) -> None:
    title = (f"{'model':<15}{'k':>2}{'mb':>3} {'opt':<5}{'st':>3}{'fl':>3}{'measured':>11}{'predicted':>11}"
             f"{'pred/meas':>10}{'weights/meas':>13}{'deepspeed/meas':>15}   measured parts (kB: w g o act recv tmp)"
             "   predicted (kB: act recv transient)")
    if head:
        print(title)
        print("-" * len(title))
    for r in table:
        parts = " ".join(f"{v / 1e3:.0f}" for v in r["parts"].values())
        print(f"{r['model']:<15}{r['k']:>2}{r['mb']:>3} {r['opt']:<5}{r['stage']:>3}{r['in_flight']:>3}"
              f"{r['measured']:>11,}{r['predicted']:>11,.0f}{r['predicted'] / r['measured']:>10.2f}"
              f"{r['weights'] / r['measured']:>13.2f}{r['deepspeed'] / r['measured']:>15.2f}   {parts}   "
              + " ".join(f"{v / 1e3:.0f}" for v in r["predicted_parts"]), flush=True)


def summary(table: list[dict]) -> None:
    print("\nratio estimate / measured over every stage (min / median / max); predicted within 0.9-1.1:")
    by_model: dict[str, list[dict]] = {}
    for r in table:
        by_model.setdefault(r["model"], []).append(r)
    for name, group in [*by_model.items(), ("all", table)]:
        line = f"  {name:<15}"
        for key in ("predicted", "weights", "deepspeed"):
            ratios = [r[key] / r["measured"] for r in group]
            line += f"  {key} {min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"
        within = sum(0.9 <= r["predicted"] / r["measured"] <= 1.1 for r in group)
        print(f"{line}  ({within}/{len(group)} within 10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="k = 4, 4 microbatches, Adam, the built-in examples")
    parser.add_argument("--models", help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--budgets", action="store_true", help="the budget table only (k = 4, Adam, 4 microbatches)")
    parser.add_argument("--device", default="cpu",
                        help="where the models are planned and measured; on cuda the peak is "
                        "torch.cuda.max_memory_allocated")
    options = parser.parse_args()
    names = options.models.split(",") if options.models else list(QUICK if options.quick else CASES)
    ks, counts, optimizers = ((4,), (4,), ("adam",)) if options.quick else ((2, 4, 8), (1, 4, 8), ("adam", "sgd"))
    if not options.budgets:
        start = time.perf_counter()
        table = [r for name in names for r in rows(name, ks, counts, optimizers, options.device)]
        show(table)
        summary(table)
        print(f"\n{len(table)} stage rows in {time.perf_counter() - start:.0f} s; 1F1B; fp32; "
              f"measured on {options.device}, torch {torch.__version__}; "
              f"in-flight (fl) = min(k - stage, microbatches)")
    if options.budgets or not options.quick:
        start = time.perf_counter()
        budgets = [r for name in names for r in budget_rows(name, device=options.device)]
        show_budgets(budgets)
        print(f"budget table in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
