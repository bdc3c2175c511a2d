"""How far min-cut's boundary bytes are from the proven optimum on many small graphs.

Random layered DAGs of 40 to 200 nodes (``autoshard.testing.graphs.layered_graph``, seeds
0..N-1, sizes and k drawn from a seeded generator), each split by ``min-cut`` (with and without
its coarse graphs) and by ``exact``; cases ``exact`` does not prove optimal within its limit
are left out. Prints the geometric mean and the worst of min-cut bytes / optimal bytes.

    python benchmarks/split_optimality_gap.py             # 100 graphs (~5 min on 2 cores)
    python benchmarks/split_optimality_gap.py --graphs 20
"""

from __future__ import annotations

import argparse
import math
import random
import time

from autoshard.graph import split_dag
from autoshard.testing.graphs import layered_graph

KS = (2, 3, 4, 8)
METHODS = {"min-cut": {}, "min-cut (coarsen=False)": {"coarsen": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=100, help="number of random graphs")
    args = parser.parse_args()
    rng = random.Random(0)
    logs: dict[str, list[float]] = {name: [] for name in METHODS}
    worst = {name: 1.0 for name in METHODS}
    seconds = {name: 0.0 for name in METHODS}
    unproven = 0
    for seed in range(args.graphs):
        dag, k = layered_graph(rng.randint(40, 200), seed=seed), rng.choice(KS)
        optimum = split_dag(dag, k, "exact", time_limit=30.0, return_info=True).info
        if not optimum.proven_optimal:
            unproven += 1
            continue
        for name, options in METHODS.items():
            start = time.perf_counter()
            sent = split_dag(dag, k, return_info=True, **options).info.boundary_bytes
            seconds[name] += time.perf_counter() - start
            ratio = sent / optimum.boundary_bytes if optimum.boundary_bytes else 1.0
            logs[name].append(math.log(ratio))
            worst[name] = max(worst[name], ratio)
    print(f"{args.graphs} graphs, {unproven} not proven optimal by exact (left out)")
    for name in METHODS:
        mean = math.exp(sum(logs[name]) / len(logs[name])) if logs[name] else float("nan")
        print(f"{name:26s} bytes / optimum: geometric mean {mean:.3f}, worst {worst[name]:.2f}, "
              f"{seconds[name]:.1f} s in all")


if __name__ == "__main__":
    main()
