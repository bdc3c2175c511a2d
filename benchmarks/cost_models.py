"""Cost models: planning GPT-2-style LMs on the meta device, and what FLOPs-aware balance buys.

    python benchmarks/cost_models.py           # about a minute on 2 cores
    python benchmarks/cost_models.py --quick   # the two smaller meta models only

Table 1, per meta-device LM (weights never allocated): weight size, graph nodes, wall time of
``shard_model(cost=params)`` and of ``cost=flops`` (trace + fake shape propagation + split +
emit), and the peak resident memory of the process that planned it (each in a fresh process).

Table 2, GPT-2 small and medium shapes on the meta device (vocabulary 50,257, sequence 1024;
parameters at the ends, compute in the blocks): the slowest stage's FLOPs under the params plan
and under the flops plan. Their ratio is the throughput a FLOPs-balanced pipeline gains when
stage time follows FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import autoshard  # noqa: E402
from gpt_style import GPTStyleLM  # noqa: E402

META_SIZES = [  # (width, layers, heads)
    (1024, 12, 16),
    (4096, 6, 32),
    (6144, 12, 48),
]

PLAN_ON_META = textwrap.dedent("""
    import json, resource, sys, time, torch
    sys.path.insert(0, {tests!r})
    import autoshard
    from gpt_style import GPTStyleLM
    with torch.device("meta"):
        model = GPTStyleLM(vocab=50257, width={width}, layers={layers}, heads={heads}, max_seq=128)
    idx = torch.randint(0, 50257, (1, 128))
    out = {{"weights": sum(p.numel() * p.element_size() for p in model.parameters())}}
    for cost in ("params", "flops"):
        start = time.perf_counter()
        sharded = autoshard.shard_model(model, 4, example_inputs=(idx,), cost=cost)
        out[cost] = time.perf_counter() - start
    out["nodes"] = len(sharded.plan.assignment)
    out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))
""")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def meta_table(sizes: list[tuple[int, int, int]]) -> Table:
    table = Table(title="planning on the meta device (4 stages, sequence 128)")
    for column in ("width x layers", "weights", "nodes", "params plan (s)", "flops plan (s)", "peak RSS"):
        table.add_column(column, justify="right")
    for width, layers, heads in sizes:
        script = PLAN_ON_META.format(tests=str(ROOT / "tests"), width=width, layers=layers, heads=heads)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        row = json.loads(result.stdout.strip().splitlines()[-1])
        table.add_row(f"{width} x {layers}", gib(row["weights"]), str(row["nodes"]), f"{row['params']:.2f}",
                      f"{row['flops']:.2f}", gib(row["peak"]))
    return table


BALANCE_CASES = [  # (width, layers, heads, stages)
    (768, 12, 12, 4),
    (1024, 24, 16, 8),
]


def balance_table() -> Table:
    table = Table(title="slowest stage GFLOPs: params plan vs flops plan (GPT-2 shapes, batch 1 x 1024)")
    for column in ("width x layers", "head", "stages", "params plan", "flops plan", "params / flops"):
        table.add_column(column, justify="right")
    idx = torch.randint(0, 50257, (1, 1024))
    for width, layers, heads, k in BALANCE_CASES:
        for tied in (False, True):
            with torch.device("meta"):
                model = GPTStyleLM(vocab=50257, width=width, layers=layers, heads=heads, max_seq=1024, tied=tied)
            worst = {}
            for cost in ("params", "flops"):
                sharded = autoshard.shard_model(model, k, example_inputs=(idx,), cost=cost)
                worst[cost] = max(sharded.plan.stage_costs("flops"))
            table.add_row(f"{width} x {layers}", "tied" if tied else "untied", str(k), f"{worst['params'] / 1e9:.1f}",
                          f"{worst['flops'] / 1e9:.1f}", f"{worst['params'] / worst['flops']:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the largest meta model")
    args = parser.parse_args()
    console = Console()
    console.print(meta_table(META_SIZES[:2] if args.quick else META_SIZES))
    console.print(balance_table())


if __name__ == "__main__":
    main()
