"""The CLI as users run it, in a subprocess, on the built-in examples.

Each start imports torch (about 2 s), so this file keeps to the acceptance cases; the options
are tested in-process in test_cli_options.py.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)  # generous: a loaded 2-core CI machine starts torch slowly

FACTORIES = '''
import torch

def build():
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)]), (torch.randn(2, 4),)

def broken():
    raise RuntimeError("weights file [missing.bin] not found")

def mismatched():
    return torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4), torch.randn(2, 4))

def wrong_shape():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), (torch.randn(2, 5),)

def bare():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
'''


def autoshard(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "COLUMNS": "200"})


def stage_rows(stdout: str) -> list[list[str]]:
    """The rows of the first table (the stage table), cells folded over several lines joined."""
    rows: list[list[str]] = []
    for line in stdout.splitlines():
        if line.startswith("└") and rows:
            break
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0].isdigit():
            rows.append(cells)
        elif rows and cells[0] == "" and len(cells) == len(rows[-1]):
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows


def modules(cell: str) -> str:
    """A stage's module ranges without ``(root)``: how many top-level operations (input checks,
    unpacking) the capture adds in stage 0 is the front end's business, not the table's."""
    return cell.replace(", (root)", "").replace("(root)", "")


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("factories")
    (folder / "mymodels.py").write_text(FACTORIES)
    return folder


def test_split_transformer_shows_layer_ranges_and_boundary_values():
    out = autoshard("split", "transformer-lm", "--stages", "2")
    assert out.returncode == 0, out.stderr
    rows = stage_rows(out.stdout)
    assert [r[0] for r in rows] == ["0", "1"]
    assert rows[0][1].startswith("encoder, pos_encoder")
    assert "transformer_encoder.layers." in rows[1][1] and rows[1][1].endswith("decoder")
    assert "the lower bound" in out.stdout and "boundaries: " in out.stdout
    assert "values crossing each boundary" in out.stdout and "0 → 1" in out.stdout
    assert "verified: 2 stages match" in out.stdout
    assert "inputs served: src: int64 of shape (any, any), src_mask: float32 of shape (any, any)" in out.stdout
    heading = next(line for line in out.stdout.splitlines() if line.startswith("┃"))
    assert "time (est.)" in heading and "train mem" in heading
    assert out.stderr == ""  # no progress bar when stderr is not a terminal


def test_split_tables_contain_the_expected_stages(saved):
    first = saved[1]
    assert first.returncode == 0, first.stderr
    rows = stage_rows(first.stdout)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[1] for r in rows] == [f"linears.{i}-{i + 1}, (root)" for i in (0, 2, 4, 6)]
    assert "= 1.000× the lower bound" in first.stdout
    assert "verified: 4 stages match" in first.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("plans")
    first = autoshard("split", "residual-mlp", "-k", "4", "--out", "plan.json", "--svg", "plan.svg",
                      "--png", "plan.png", cwd=folder)
    again = autoshard("split", "residual-mlp", "--plan", "plan.json", "--out", "again.json", cwd=folder)
    return folder, first, again


def test_a_json_plan_round_trips_to_identical_stages(saved):
    folder, first, again = saved
    assert first.returncode == 0, first.stderr
    assert again.returncode == 0, again.stderr
    plan = json.loads((folder / "plan.json").read_text())
    assert [n["stage"] for n in plan["nodes"] if n["module"].startswith("linears.")] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (folder / "again.json").read_text() == (folder / "plan.json").read_text()
    assert stage_rows(again.stdout) == stage_rows(first.stdout)
    assert "verified: 4 stages match" in again.stdout


def test_png_and_svg_are_written_as_non_trivial_images_of_the_right_size(saved):
    folder, first, _ = saved
    png = (folder / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1400, 600)  # render.figure_size: 14 x 6 inches at 100 dpi
    assert len(png) > 20_000
    svg = ET.parse(folder / "plan.svg").getroot()
    assert (svg.get("width"), svg.get("height")) == ("1008pt", "432pt")
    text = (folder / "plan.svg").read_text()
    assert all(f"linears.{i}" in text for i in range(8)) and "stage 3" in text
    assert "wrote the picture plan.svg" in first.stdout


def test_custom_pipeline_with_timing_and_dump_dir(tmp_path):
    spec = "capture,shape-prop,build-dag,linearize{order=live-bytes},split{cost=flops},emit,verify"
    out = autoshard("split", "long-skip", "-k", "2", "--pipeline", spec, "--timing", "--dump-dir", "dump", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "flops (split)" in out.stdout and "split{stages=2 cost=flops}" in " ".join(out.stdout.split())
    timing = out.stdout.split("autoshard pass timing")[1]
    assert all(name in timing for name in ("capture", "shape-prop", "split", "verify", "total"))
    assert [p.name for p in sorted((tmp_path / "dump").iterdir())] == [
        "000-capture.txt", "001-shape-prop.txt", "002-build-dag.txt", "003-linearize.txt", "004-split.txt",
        "005-emit.txt", "006-verify.txt"]
    assert out.stderr == ""


def on_a_terminal(*args: str) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; return its exit code and what it drew there."""
    import pty
    import threading

    main, child = pty.openpty()
    drawn: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            drawn.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-m", "autoshard", *args], stdout=subprocess.DEVNULL, stderr=child,
                          timeout=300, env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(child)
    reader.join(timeout=10)
    os.close(main)
    return proc.returncode, b"".join(drawn).decode(errors="replace")


def test_progress_is_drawn_on_a_terminal_and_quiet_silences_it():
    code, drawn = on_a_terminal("inspect", "residual-mlp", "-k", "2")
    assert code == 0 and "autoshard: " in drawn
    code, drawn = on_a_terminal("inspect", "residual-mlp", "-k", "2", "--quiet")
    assert code == 0 and drawn == ""


def test_a_factory_target_run_from_its_folder(factories):
    out = autoshard("split", "mymodels:build", "--stages", "3", cwd=factories)
    assert out.returncode == 0, out.stderr
    assert [modules(r[1]) for r in stage_rows(out.stdout)] == ["0-1", "2-3", "4-5"]


def test_a_factory_without_inputs_is_told_once_to_return_them(factories):
    """One line says what the missing inputs cost and what to return, in place of the library's note on
    each cost it could not measure (which speaks of shard_model, not of the factory)."""
    out = autoshard("split", "mymodels:bare", "--stages", "2", cwd=factories)
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert ("no example inputs: mymodels:bare returned the model alone, so value sizes, FLOPs and times are not "
            "measured and the stages are not verified; make it return (model, args) or (model, args, kwargs)") in flat
    assert "not shown" not in flat and "shard_model" not in flat
    verify = autoshard("split", "mymodels:bare", "--stages", "2",
                       "--pipeline", "trace,build-dag,linearize,split,emit,verify", cwd=factories)
    assert verify.returncode == 2
    assert "a factory returning (model, args) or (model, args, kwargs)" in " ".join(verify.stderr.split())


@pytest.mark.parametrize("args,message,hint", [
    (("split", "no_such_module:build", "-k", "2"), "cannot import 'no_such_module' from TARGET",
     "TARGET is a built-in example (see `autoshard examples`) or package.module:factory"),
    (("split", "mymodels:broken", "-k", "2"),
     "the factory 'mymodels:broken' failed: RuntimeError: "
     "weights file [missing.bin] not found",
     "or package.module:factory"),
    (("split", "mymodels:mismatched", "-k", "2"), "the example inputs do not match Sequential.forward(input)",
     None),  # a value refused: its message says what to do, no traceback to add
    (("split", "mymodels:wrong_shape", "-k", "2"),
     "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x5 and 4x4)",
     "the example inputs must be ones the model runs on"),
])
def test_errors_exit_nonzero_with_one_message_a_hint_and_no_traceback(factories, args, message, hint):
    out = autoshard(*args, cwd=factories)
    assert out.returncode == 2
    flat = " ".join(out.stderr.split())
    assert message in flat, out.stderr
    assert out.stderr.startswith("error: ") and ("\nhint: " in out.stderr and hint in flat if hint else
                                                 "hint:" not in out.stderr)
    assert "Traceback" not in out.stderr and "While executing" not in out.stderr and out.stdout == ""


def test_tables_written_to_a_pipe_are_wide_enough_to_read():
    """Without a terminal or COLUMNS, rich would wrap every column at 80 characters."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "split", "residual-mlp", "-k", "3"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if line.startswith("┃"))
    assert all(column in header for column in ("modules", "params", "time (est.)", "train mem", "sends"))
    assert [modules(row[1]) for row in stage_rows(out.stdout)] == ["linears.0-2", "linears.3-4", "linears.5-7"]


def test_version_prints_the_package_version():
    result = autoshard("--version")
    from autoshard import __version__

    assert result.returncode == 0 and result.stdout.strip() == f"autoshard {__version__}"
