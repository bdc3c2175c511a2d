"""The CLI, run as a subprocess the way users run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def autoshard(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_examples_lists_the_built_ins():
    out = autoshard("examples")
    assert out.returncode == 0
    for name in ("branched", "transformer-lm", "residual-mlp", "long-skip"):
        assert name in out.stdout


def test_passes_lists_every_default_pass_with_options():
    out = autoshard("passes")
    assert out.returncode == 0
    for name in ("trace", "build-dag", "linearize", "split", "emit", "verify"):
        assert name in out.stdout
    assert "tolerance" in out.stdout


def _table_rows(stdout: str) -> list[list[str]]:
    rows = []
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0].isdigit():
            rows.append(cells)
    return rows


@pytest.mark.parametrize("target,k", [("residual-mlp", 4), ("long-skip", 2), ("branched", 5)])
def test_split_prints_one_row_per_stage_with_boundary_values(target, k):
    out = autoshard("split", target, "--stages", str(k))
    assert out.returncode == 0, out.stderr
    rows = _table_rows(out.stdout)
    assert [r[0] for r in rows] == [str(i) for i in range(k)]
    assert "verified" in out.stdout
    if target == "long-skip":
        assert "x" in rows[0][5].split(", ")  # the input crosses the boundary
    if target == "branched":
        assert "wrapped module blocks.0" in out.stdout


def test_split_transformer_shows_module_ranges():
    out = autoshard("split", "transformer-lm", "--stages", "2")
    assert out.returncode == 0, out.stderr
    assert "transformer_encoder.layers." in out.stdout


def test_factory_target(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)]), (torch.randn(2, 4),)\n")
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "split", "mymodels:build", "--stages", "3"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert [r[0] for r in _table_rows(out.stdout)] == ["0", "1", "2"]


@pytest.mark.parametrize("args,message", [
    (("split", "no_such_module:build", "--stages", "2"), "cannot import 'no_such_module'"),
    (("split", "residual-mlp", "--stages", "0"), "at least 1"),
    (("split", "branched", "--stages", "11"), "maximum is 10"),
    (("split", "residual-mlp", "--stages", "2", "--pipeline", "trace,split"), "build-dag"),
])
def test_errors_exit_nonzero_with_a_message_and_no_traceback(args, message):
    out = autoshard(*args)
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
