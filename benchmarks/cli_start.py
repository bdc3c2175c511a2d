"""How long the autoshard command takes to answer without doing work: ``python -m autoshard ARGS``
for ``--help``, a command's help and a usage error, each in a fresh process, ``--repeats`` times
(the minimum and the median; the rest is this machine's load). ``autoshard examples`` is the
reference for a command that imports the library.

    python benchmarks/cli_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = (
    ("--help",),
    ("split", "--help"),
    ("split", "residual-mlp", "-k", "2", "--optimzer", "adam"),  # refused by the parser
    ("examples",),
)


def seconds(args: tuple[str, ...]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print("| command | min (s) | median (s) |\n| --- | ---: | ---: |")
    for args in CASES:
        times = [seconds(args) for _ in range(repeats)]
        print(f"| `autoshard {' '.join(args)}` | {min(times):.2f} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
