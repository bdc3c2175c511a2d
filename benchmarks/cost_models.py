"""Cost models: planning GPT-2-style LMs on the meta device, and what FLOPs-aware balance buys.

    python benchmarks/cost_models.py           # about a minute and a half on 2 cores
    python benchmarks/cost_models.py --quick   # table 1 without the largest meta model

Table 1, per meta-device LM (weights never allocated): weight size, graph nodes, wall time of
``shard_model(cost=params)`` and of ``cost=flops`` (trace + fake shape propagation + split +
emit), and the peak resident memory of the process that planned it (each in a fresh process).

Table 2, GPT-2 small and medium shapes on the meta device (vocabulary 50,257, sequence 1024;
parameters at the ends, compute in the blocks): the slowest stage's FLOPs under the params plan
and under the flops plan. Their ratio is the throughput a FLOPs-balanced pipeline gains when
stage time follows FLOPs.

Table 3, the same shapes with the head tied to the embedding: the parameter bytes the fullest
stage really holds when the split charges the tied weight to its first reader only
(``keep-tied=false``, what a tie-unaware splitter does) and when it counts it once per stage
holding it (the default), with the wall time of each ``shard_model`` call.

Table 4, GPT-2 small (tied, 4 stages) under ``max_memory``: every stage gets the same budget, a
fraction of the fullest stage's training memory in the unconstrained params plan (weights,
gradients, Adam state, and activations x the microbatches in flight under 1F1B). Per budget:
the fullest stage of the plan found, its params bottleneck, and the wall time, or "no plan".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import autoshard
from autoshard.costs.memory import stage_memory
from autoshard.errors import InfeasibleSplitError
from autoshard.examples import GPTStyleLM

ROOT = Path(__file__).resolve().parents[1]

META_SIZES = [  # (width, layers, heads)
    (1024, 12, 16),
    (4096, 6, 32),
    (6144, 12, 48),
]

PLAN_ON_META = textwrap.dedent("""
    import json, time, torch
    import autoshard
    from autoshard.examples import GPTStyleLM
    with torch.device("meta"):
        model = GPTStyleLM(vocab=50257, width={width}, layers={layers}, heads={heads}, max_seq=128)
    idx = torch.randint(0, 50257, (1, 128))
    out = {{"weights": sum(p.numel() * p.element_size() for p in model.parameters())}}
    for cost in ("params", "flops"):
        start = time.perf_counter()
        sharded = autoshard.shard_model(model, 4, example_inputs=(idx,), cost=cost)
        out[cost] = time.perf_counter() - start
    out["nodes"] = len(sharded.plan.assignment)
    # this process's own peak (VmHWM): ru_maxrss keeps the parent's, which Linux carries across exec
    out["peak"] = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps(out))
""")


def table_of(title: str, *columns: str) -> Table:
    """A rich table with right-aligned columns."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def gpt2_tokens() -> torch.Tensor:
    """One sequence of 1024 token ids (GPT-2's context) from a vocabulary of 50,257."""
    return torch.randint(0, 50257, (1, 1024))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def meta_table(sizes: list[tuple[int, int, int]]) -> Table:
    table = table_of("planning on the meta device (4 stages, sequence 128)",
                     "width x layers", "weights", "nodes", "params plan (s)", "flops plan (s)", "peak RSS")
    for width, layers, heads in sizes:
        script = PLAN_ON_META.format(width=width, layers=layers, heads=heads)
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


def meta_gpt2(width: int, layers: int, heads: int, tied: bool = True) -> GPTStyleLM:
    """A GPT-2-shaped LM on the meta device (no weights allocated), vocabulary 50,257, sequence 1024."""
    with torch.device("meta"):
        return GPTStyleLM(vocab=50257, width=width, layers=layers, heads=heads, max_seq=1024, tied=tied)


def balance_table() -> Table:
    table = table_of("slowest stage GFLOPs: params plan vs flops plan (GPT-2 shapes, batch 1 x 1024)",
                     "width x layers", "head", "stages", "params plan", "flops plan", "params / flops")
    idx = gpt2_tokens()
    for width, layers, heads, k in BALANCE_CASES:
        for tied in (False, True):
            model = meta_gpt2(width, layers, heads, tied)
            worst = {}
            for cost in ("params", "flops"):
                sharded = autoshard.shard_model(model, k, example_inputs=(idx,), cost=cost)
                worst[cost] = max(sharded.plan.stage_costs("flops"))
            table.add_row(f"{width} x {layers}", "tied" if tied else "untied", str(k), f"{worst['params'] / 1e9:.1f}",
                          f"{worst['flops'] / 1e9:.1f}", f"{worst['params'] / worst['flops']:.2f}")
    return table


FIRST_READER = "capture,shape-prop,build-dag,linearize,split{keep-tied=false},emit"


def timed_plan(model: torch.nn.Module, k: int, idx: torch.Tensor, **options) -> tuple[autoshard.ShardedModel, float]:
    start = time.perf_counter()
    sharded = autoshard.shard_model(model, k, example_inputs=(idx,), **options)
    return sharded, time.perf_counter() - start


def tied_table() -> Table:
    table = table_of("fullest stage's parameter MiB with a tied head (GPT-2 shapes, batch 1 x 1024)",
                     "width x layers", "stages", "first reader pays", "(s)", "once per stage", "(s)")
    idx = gpt2_tokens()
    for width, layers, heads, k in BALANCE_CASES:
        model = meta_gpt2(width, layers, heads)
        row = [f"{width} x {layers}", str(k)]
        for pipeline in (FIRST_READER, None):
            sharded, seconds = timed_plan(model, k, idx, pipeline=pipeline)
            row += [params_mib(sharded).removesuffix(" MiB"), f"{seconds:.2f}"]
        table.add_row(*row)
    return table


def params_mib(sharded: autoshard.ShardedModel) -> str:
    """The parameter bytes the fullest stage holds, in MiB."""
    return f"{max(sharded.plan.stage_costs('params')) / 2**20:.1f} MiB"


def peak_memory(sharded: autoshard.ShardedModel) -> float:
    plan = sharded.plan
    return max(s.total for s in stage_memory(plan.dag, plan.assignment, plan.num_stages))


def budget_table() -> Table:
    table = table_of("max_memory on GPT-2 small, tied (4 stages, batch 1 x 1024, Adam)",
                     "budget", "fullest stage", "params bottleneck", "plan (s)")
    idx = gpt2_tokens()
    model = meta_gpt2(768, 12, 12)
    unconstrained, seconds = timed_plan(model, 4, idx)
    peak = peak_memory(unconstrained)
    table.add_row("none", gib(peak), params_mib(unconstrained), f"{seconds:.2f}")
    for fraction in (0.9, 0.8, 0.7, 0.6):
        try:
            sharded, seconds = timed_plan(model, 4, idx, max_memory=fraction * peak)
        except InfeasibleSplitError:
            table.add_row(f"{fraction:.1f} x {gib(peak)}", "no plan", "", "")
            continue
        table.add_row(f"{fraction:.1f} x {gib(peak)}", gib(peak_memory(sharded)), params_mib(sharded), f"{seconds:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the largest meta model")
    args = parser.parse_args()
    console = Console()
    console.print(meta_table(META_SIZES[:2] if args.quick else META_SIZES))
    console.print(balance_table())
    console.print(tied_table())
    console.print(budget_table())


if __name__ == "__main__":
    main()
