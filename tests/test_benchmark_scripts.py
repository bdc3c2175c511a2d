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


def test_call_overhead_compares_every_gradient_of_a_training_row():
    """A forward + backward row's ``bit-exact`` is every parameter's gradient after one step of
    each; a model whose dropout is active has none to compare."""
    import torch
    from torch import nn

    import autoshard

    overhead = script("call_overhead")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).train()
    x = torch.randn(3, 8)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
    assert overhead._same_gradients(model, lambda: model(x).sum().backward(), lambda: sharded(x).sum().backward())
    assert not overhead._same_gradients(model, lambda: model(x).sum().backward(),
                                        lambda: (2 * sharded(x)).sum().backward())
    assert all(p.grad is None for p in model.parameters())  # left as it found them
    dropped = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).train()
    assert overhead._same_gradients(dropped, lambda: None, lambda: None) is None
