"""Predicted training memory per stage against what the stage really holds (issue 20).

    python benchmarks/memory_accuracy.py            # every case, a few minutes on two cores
    python benchmarks/memory_accuracy.py --quick    # k = 4, 4 microbatches, Adam only

For each model, k and microbatch count (1F1B) and optimizer, one row per stage:
* measured: ``autoshard.runtime.measure_stage_memory``, the peak of live tensor storages while the
  stage runs its microbatches in flight forward and one backward, with gradients and fp32
  optimizer state materialised;
* predicted: ``plan_report(sharded, memory=MemoryModel(bytes, microbatches)).stages[j].memory.total``,
  the model ``max_memory`` plans with (``autoshard/costs/memory.py``);
* weights only: what accelerate's ``compute_module_sizes`` / ``infer_auto_device_map`` count, the
  bytes of the stage's parameters and buffers (re-implemented: two lines, no install);
* DeepSpeed: its model-state formula without ZeRO, 16 B per parameter for fp32 Adam (4 weights +
  4 gradients + 8 optimizer); for plain SGD the same formula with no optimizer state, 8 B.
Ratios are estimate / measured; the issue's target is the predicted one within 0.9-1.1.

Models: the built-in examples (residual MLP, GPT-style LM, TransformerLM), a tiny Hugging Face
GPT-2 LM in training mode (random weights from a config, nothing downloaded) and, without
``--quick``, the activation-heavy GPT-style LM of the issue (width 64, batch 16 x 256).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autoshard  # noqa: E402
from autoshard.costs.memory import MemoryModel  # noqa: E402
from autoshard.examples import GPTStyleLM, load_example  # noqa: E402
from autoshard.runtime import measure_stage_memory  # noqa: E402
from autoshard.runtime.memory import OPTIMIZER_STATE  # noqa: E402

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


CASES: dict[str, Callable[[], Case]] = {
    "residual-mlp": lambda: load_example("residual-mlp"),
    "gpt-lm": lambda: load_example("gpt-lm"),
    "transformer-lm": lambda: load_example("transformer-lm"),
    "hf-gpt2": tiny_gpt2,
    "gpt-lm-wide": wide_gpt_lm,
}


def weights_only(stage: nn.Module) -> int:
    """accelerate's view: the bytes of the distinct parameters and buffers a stage holds."""
    return sum(t.nbytes for t in {id(t): t for t in [*stage.parameters(), *stage.buffers()]}.values())


def deepspeed_model_states(stage: nn.Module, optimizer: str) -> int:
    """DeepSpeed's model-state estimate without ZeRO: (4 + 4 + 4 x state tensors) B per parameter."""
    params = sum(p.numel() for p in {id(p): p for p in stage.parameters() if p.requires_grad}.values())
    return params * (4 + 4 + 4 * len(OPTIMIZER_STATE[optimizer]))


def rows(name: str, ks: tuple[int, ...], counts: tuple[int, ...], optimizers: tuple[str, ...]) -> list[dict]:
    model, args, kwargs = CASES[name]()
    out = []
    for k in ks:
        sharded = autoshard.shard_model(model, k, example_inputs=args, example_kwargs=kwargs)
        for optimizer in optimizers:
            state_bytes = 4.0 * len(OPTIMIZER_STATE[optimizer])
            for count in counts:
                report = autoshard.plan_report(sharded, memory=MemoryModel(state_bytes, count))
                for j in range(k):
                    measured = measure_stage_memory(sharded, j, args, kwargs, microbatches=count, optimizer=optimizer)
                    stage = sharded.stages[j]
                    out.append(dict(model=name, k=k, mb=count, opt=optimizer, stage=j, in_flight=measured.in_flight,
                                    measured=measured.peak, parts=measured.parts,
                                    predicted=report.stages[j].memory.total, weights=weights_only(stage),
                                    deepspeed=deepspeed_model_states(stage, optimizer)))
    return out


def show(table: list[dict]) -> None:
    head = (f"{'model':<15}{'k':>2}{'mb':>3} {'opt':<5}{'st':>3}{'fl':>3}{'measured':>11}{'predicted':>11}"
            f"{'pred/meas':>10}{'weights/meas':>13}{'deepspeed/meas':>15}   measured parts (kB: w g o act recv tmp)")
    print(head)
    print("-" * len(head))
    for r in table:
        parts = " ".join(f"{v / 1e3:.0f}" for v in r["parts"].values())
        print(f"{r['model']:<15}{r['k']:>2}{r['mb']:>3} {r['opt']:<5}{r['stage']:>3}{r['in_flight']:>3}"
              f"{r['measured']:>11,}{r['predicted']:>11,.0f}{r['predicted'] / r['measured']:>10.2f}"
              f"{r['weights'] / r['measured']:>13.2f}{r['deepspeed'] / r['measured']:>15.2f}   {parts}")


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
    parser.add_argument("--quick", action="store_true", help="k = 4, 4 microbatches, Adam, no wide GPT-style LM")
    options = parser.parse_args()
    names = [n for n in CASES if not (options.quick and n == "gpt-lm-wide")]
    ks, counts, optimizers = ((4,), (4,), ("adam",)) if options.quick else ((2, 4), (1, 4), ("adam", "sgd"))
    start = time.perf_counter()
    table = [r for name in names for r in rows(name, ks, counts, optimizers)]
    show(table)
    summary(table)
    print(f"\n{len(table)} stage measurements in {time.perf_counter() - start:.0f} s; 1F1B; fp32; "
          f"in-flight (fl) = min(k - stage, microbatches)")


if __name__ == "__main__":
    main()
