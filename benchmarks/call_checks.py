"""What autoshard's own work in a sharded call costs, each piece timed alone.

    python benchmarks/call_checks.py                      # every row of call_overhead.py, ~4 minutes
    python benchmarks/call_checks.py --only "HF" --repeats 15
    python benchmarks/call_checks.py --hook-registered     # each call after a hook was registered somewhere

``call_overhead.py`` compares the sharded call with the model's own. On a real model the sharded
call is often the faster (the capture leaves the model's Python behind: output dataclasses, config
reads, mask helpers), which hides what autoshard adds. This times what it adds, piece by piece,
each alone (best of ``--repeats`` runs of many calls, in this thread's CPU time, which leaves out
the time other processes hold the core): binding the call and checking the modes of the model's
modules and the plain attributes its traced code read (``fit_call``), the first stage's input guard
(``check_inputs``), each stage's check of the modules it calls (``HeldState``), the stages' reads
of their device from their inputs
(``stage_device``), the conditions the capture fixed (``check_condition``), and at each boundary
the probe of where the next stage's weights are and the check that the values are there
(``moved_to``). Left out: ``run_stages``'s own loop (a hook test per stage) and the module-path
reads fx writes for weights, which the model's own code makes too. The sum against the model's
own forward call (eager) is the share of a call spent in autoshard's checks.
"""

from __future__ import annotations

import argparse
import inspect
import time
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils.hooks import RemovableHandle

import autoshard
from autoshard.capture.guard import check_condition, check_inputs
from autoshard.emit import stage_device as device_read
from autoshard.sharded import moved_to, stage_device
from call_overhead import ROWS, Row

#: The pieces, in the order of the table's columns.
KINDS = ("binding + model state", "input guard", "stage checks", "device reads", "conditions", "boundaries")


def _pieces(row: Row, hook_registered: bool = False) -> list[tuple[str, Callable[[], Any]]]:
    """Each piece of autoshard's work in one call of ``row``'s sharded model, by kind, callable alone
    with the values it sees in that call. ``hook_registered``: as in a call after a hook was registered
    somewhere (a module with full backward hooks, FSDP, register one on every call), which the first
    stage checks in full (``capture.hooks_since``): each check moves the hook id counter first."""
    sharded = autoshard.shard_model(row.model, row.stages, example_inputs=row.args)
    binding = ("binding + model state", lambda: sharded.fit_call(row.args, {}))
    pieces: list[tuple[str, Callable[[], Any]]] = [binding]
    values, keywords = sharded.fit_call(row.args, {})
    for index, stage in enumerate(sharded.stages):
        if index:
            pieces.append(("boundaries", lambda stage=stage, values=values: moved_to(stage_device(stage), values)))
        state = stage._autoshard_held_state
        moved = hook_registered and index == 0
        pieces.append(("stage checks", lambda state=state, training=stage.training, moved=moved:
                       (moved and _move_hook_counter(), state.check(training))))
        named = inspect.signature(stage.forward).bind(*values, **keywords).arguments
        pieces += _guard_calls(stage, named)
        values, keywords = stage.forward(*values, **keywords), {}
    return pieces


def _move_hook_counter() -> None:
    """What registering a hook does to the counter the first stage compares (nothing else)."""
    RemovableHandle.next_id += 1


def _guard_calls(stage: fx.GraphModule, named: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """The stage's calls of its input guard, device reads and fixed conditions, with their arguments
    (a condition with the value it was fixed to, as a passing call gives it)."""
    calls: list[tuple[str, Callable[[], Any]]] = []
    for node in stage.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is check_condition:
            calls.append(("conditions", lambda args=(node.args[1], *node.args[1:]): check_condition(*args)))
            continue
        kind = {check_inputs: "input guard", device_read: "device reads"}.get(node.target)
        if kind is not None:
            args = tuple(named[a.target] if isinstance(a, fx.Node) and a.op == "placeholder"
                         else getattr(stage, a.target) if isinstance(a, fx.Node) else a for a in node.args)
            calls.append((kind, lambda target=node.target, args=args: target(*args)))
    return calls


def _best(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Seconds of this thread's CPU time per call: the best of ``repeats`` runs of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per piece, best kept")
    parser.add_argument("--only", default="", help="run only the rows whose name contains this (e.g. HF)")
    parser.add_argument("--hook-registered", action="store_true",
                        help="time each call as one made after a hook was registered somewhere (the first stage "
                             "checks the model's hook dicts in full)")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")  # transformers' notices would break the table
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"| row | k | eager (us) | checks (us) | checks / eager | {' | '.join(f'{k} (us)' for k in KINDS)} |")
    print(f"| --- | ---: | ---: | ---: | ---: | {' | '.join('---:' for _ in KINDS)} |")
    for name, make in ROWS.items():
        row = make() if options.only in name else None
        if row is None:
            continue
        with torch.enable_grad() if row.backward else torch.no_grad():
            pieces = _pieces(row, options.hook_registered)
            model_call = lambda: row.model(*row.args)  # noqa: E731
            eager = _best(model_call, max(3, int(0.05 / _best(model_call, 1, 2))), options.repeats)
            spent = dict.fromkeys(KINDS, 0.0)
            for kind, piece in pieces:
                spent[kind] += _best(piece, 500, options.repeats)
        total = sum(spent.values())
        print(f"| {row.name} | {row.stages} | {eager * 1e6:.1f} | {total * 1e6:.1f} | {total / eager:.2%} | "
              + " | ".join(f"{spent[k] * 1e6:.1f}" for k in KINDS) + " |", flush=True)


if __name__ == "__main__":
    main()
