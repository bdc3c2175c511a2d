"""Split time against graph size, k = 8: the strategies and the anchors that scale, side by side.

Synthetic graphs of 1,000 to 100,000 nodes of each shape (chain, ResNet-like, transformer-like
with a mask and rotary tables read by every layer, random layered with long skips). Besides the
quality columns of ``split_quality.py`` the table shows microseconds per node, so near-linear
growth reads as a flat column, and the process CPU time, which other work on a shared machine
inflates less than wall time. ``pippy-milp`` and ``exact`` are left out: they cannot model
these sizes (see ``split_quality.py`` up to 5,000 nodes).

    python benchmarks/split_scaling.py            # up to 100,000 nodes
    python benchmarks/split_scaling.py --quick    # up to 10,000 nodes (< 60 s)
"""

from __future__ import annotations

import argparse
import time

from anchors import ANCHORS, AnchorFailed
from autoshard.testing.graphs import GRAPHS
from split_quality import Row, format_row, ours, score, timed, warm_up

K = 8
SIZES = (1_000, 3_000, 10_000, 30_000, 100_000)
METHODS = {
    "min-cut (tol 0.02)": ours(0.02, "min-cut"),
    "min-cut (tol 0)": ours(0.0, "min-cut"),
    "fixed-order (tol 0)": ours(0.0, "fixed-order"),
    "greedy": ours(0.0, "greedy"),
    **{name: (lambda dag, k, anchor=anchor: (anchor(dag, k), ""))
       for name, anchor in ANCHORS.items() if name != "pippy-milp"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 10,000 nodes")
    args = parser.parse_args()
    sizes = [n for n in SIZES if n <= 10_000] if args.quick else SIZES
    warm_up()
    print(f"{'graph':<26} {'nodes':>6} {'k':>2}  {'method':<20} {'stages':>6} {'bottleneck/LB':>13} "
          f"{'total bytes':>14} {'largest':>13} {'time s':>8}  wall us/node, process CPU time")
    slowest: dict[int, float] = {}
    for kind, make in GRAPHS.items():
        for n in sizes:
            dag = make(n)
            for method, fn in METHODS.items():
                row = Row(kind, dag.number_of_nodes(), K, method)
                cpu = time.process_time()
                try:
                    (assignment, row.note), row.seconds = timed(lambda: fn(dag, K))
                    row.stages, row.ratio, row.total, row.largest = score(dag, assignment, K)
                except AnchorFailed as failed:
                    row.note = f"failed: {failed}"
                cpu = time.process_time() - cpu
                row.note = row.note or f"{1e6 * row.seconds / row.nodes:.1f} us/node, cpu {cpu:.2f} s"
                if method == "min-cut (tol 0.02)":
                    slowest[n] = max(slowest.get(n, 0.0), row.seconds)
                print(format_row(row), flush=True)
    print()
    for n, seconds in slowest.items():
        print(f"min-cut (tol 0.02), slowest graph of ~{n:,} nodes: {seconds:.2f} s "
              f"({1e6 * seconds / n:.1f} us/node); target < 10 s at 100,000 nodes")


if __name__ == "__main__":
    main()
