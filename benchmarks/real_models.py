"""Real models: how each family captures and splits, per front end.

    python benchmarks/real_models.py            # every family and front end, about two minutes
    python benchmarks/real_models.py --quick    # the 12-layer GPT-2 target only

One table per model (the tiny families of ``tests/test_real_models_zoo.py`` plus a 12-layer
GPT-2 of width 64), one row per front end: graph nodes, leaves wrapped (names), capture time,
split time (shape propagation, DAG, order and split into 4 stages by parameter bytes), stages,
the costliest stage against the lower bound max(total / k, largest node), and the bytes and the
number of the values crossing stage boundaries (each counted once per boundary it crosses: one
message per microbatch).

Target: capture plus split of the 12-layer GPT-2 in under 2 s. Timings are the best of three
runs, with torch on one thread (tiny ops on two shared cores are slower with more).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_real_models_zoo import EXAMPLE, FAMILIES, Family, text  # noqa: E402  (sets HF offline first)
import transformers  # noqa: E402, I001

from autoshard.costs.models import param_costs  # noqa: E402
from autoshard.graph import boundary_values  # noqa: E402
from autoshard.passes import Pipeline  # noqa: E402
from autoshard.passes.base import ExampleInputs, ShardProgram  # noqa: E402
from autoshard.passes.capture import CapturePass  # noqa: E402
from autoshard.passes.dag import BuildDagPass  # noqa: E402
from autoshard.passes.export import ExportPass  # noqa: E402
from autoshard.passes.linearize import LinearizePass  # noqa: E402
from autoshard.passes.shapes import ShapePropPass  # noqa: E402
from autoshard.passes.split import SplitPass  # noqa: E402
from autoshard.passes.trace import TracePass  # noqa: E402

STAGES = 4
#: Each front end's capture pass: captured in a pipeline, as ``shard_model`` does (the pipeline keeps
#: the objects alive before it out of the cycle collector's passes, 0.3-0.4 s each here).
FRONT_ENDS = {"fx": TracePass, "export": ExportPass, "auto": CapturePass}
TARGET_SECONDS = 2.0
GPT2_12 = Family(
    "gpt2-12-layers",
    lambda: transformers.GPT2Model(transformers.GPT2Config(
        n_layer=12, n_embd=64, n_head=4, n_positions=64, vocab_size=100)).eval(),
    text)


def best_of(runs: int, fn):
    """(fastest wall time, last result) of ``runs`` calls."""
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def measure(family: Family, front_end: str, runs: int) -> dict:
    torch.manual_seed(0)
    model = family.build()
    inputs = family.inputs(*EXAMPLE)
    given = ShardProgram(model=model, example_inputs=ExampleInputs((), inputs))
    capture_s, program = best_of(runs, lambda: Pipeline([FRONT_ENDS[front_end]()]).run(given).program)
    traced = program.traced
    split = Pipeline([ShapePropPass(), BuildDagPass(), LinearizePass(), SplitPass(stages=STAGES)])
    split_s, result = best_of(runs, lambda: split.run(program).program)
    dag, partition = result.dag, result.partition
    costs = list(param_costs(dag).values())  # what split{cost=params} balances: parameter bytes
    lower_bound = max(sum(costs) / STAGES, max(costs))
    return {"nodes": len(traced.graph_module.graph.nodes), "wrapped": [w.name for w in traced.wrapped],
            "front_end": traced.front_end, "capture": capture_s, "split": split_s,
            "stages": partition.num_stages, "ratio": partition.info.bottleneck / lower_bound,
            "bytes": partition.info.boundary_bytes,
            "values": sum(map(len, boundary_values(dag, partition.assignment, STAGES)))}


def family_table(family: Family, front_ends: tuple[str, ...], runs: int) -> tuple[Table, dict[str, dict]]:
    table = Table(title=f"{family.name} ({STAGES} stages)")
    for column in ("front end", "fx nodes", "leaves wrapped", "trace (s)", "split (s)", "stages",
                   "bottleneck / LB", "boundary bytes", "values crossing"):
        table.add_column(column, justify="left" if column in ("front end", "leaves wrapped") else "right")
    rows = {}
    for front_end in front_ends:
        try:
            row = measure(family, front_end, runs)
        except Exception as exc:  # noqa: BLE001 - a failing front end is a result worth printing
            table.add_row(front_end, "-", f"failed: {type(exc).__name__}", "-", "-", "-", "-", "-", "-")
            continue
        rows[front_end] = row
        label = front_end if front_end != "auto" else f"auto ({row['front_end']})"
        table.add_row(label, str(row["nodes"]), ", ".join(row["wrapped"]) or "none", f"{row['capture']:.2f}",
                      f"{row['split']:.2f}", str(row["stages"]), f"{row['ratio']:.2f}",
                      f"{row['bytes']:,.0f}", str(row["values"]))
    return table, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 12-layer GPT-2 target only")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per measurement (best is kept)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=150)
    families = (GPT2_12,) if args.quick else (GPT2_12, *FAMILIES)
    target = None
    for family in families:
        table, rows = family_table(family, ("fx",) if args.quick else tuple(FRONT_ENDS), args.runs)
        console.print(table)
        if family is GPT2_12:
            target = rows.get("fx")
    total = target["capture"] + target["split"] if target else float("inf")
    verdict = "met" if total < TARGET_SECONDS else "MISSED"
    console.print(f"target: capture + split of the 12-layer GPT-2 with fx in {total:.2f} s "
                  f"(< {TARGET_SECONDS:.0f} s): {verdict}")


if __name__ == "__main__":
    main()
