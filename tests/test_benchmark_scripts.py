"""The benchmark scripts' own bookkeeping, where it runs on the CPU in a moment (their numbers are
in ``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import collections
import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is no package; its dataclasses look their module
    up in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_call_overhead_syncs_builds_no_pipeline_split(monkeypatch, capsys):
    """``--syncs`` never runs ``pipeline()``'s split, yet built it for every row (seconds each)."""
    overhead = script("call_overhead")
    on_device = overhead._sharded_on

    def built(*_):
        raise AssertionError("--syncs built pipeline()'s split")

    monkeypatch.setattr(overhead, "_pipeline_split", built)
    monkeypatch.setattr(overhead, "_sharded_on", lambda row, _: on_device(row, "cpu"))
    monkeypatch.setattr(overhead, "_syncs", lambda fn: [])  # CUDA's sync debug mode and profiler: not here
    monkeypatch.setattr(overhead, "_kernels", lambda fn: collections.Counter(["a kernel"]))
    overhead.syncs(overhead._mlp())
    printed = [line.split(": ")[0] for line in capsys.readouterr().out.splitlines() if "kernels" in line]
    assert printed == [f"MLP 8x64, batch 4, k=4, {name}" for name in ("eager", "sharded", "chained")]
