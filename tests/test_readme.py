"""The README is a short front door: its Python runs as written, it opens with the setup commands
CI runs, and it stays under 12,000 characters (the manual lives in docs/, see tests/test_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_README_CHARS = 12_000


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_quickstart_runs_verbatim_and_matches_the_model(tmp_path, monkeypatch):
    """All Python blocks, in order, in one namespace, in an empty folder (the quickstart saves a plan)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in python_blocks():
        exec(compile(block, str(README), "exec", dont_inherit=True), namespace)
    model, src, mask = namespace["model"], namespace["src"], namespace["causal_mask"](12)
    assert len(namespace["sharded"].stages) == 4
    assert torch.equal(namespace["out"], model(src, mask))
    assert torch.equal(namespace["sharded"](src, mask), model(src, mask))
    assert (tmp_path / "plan.json").is_file()


def test_readme_is_a_front_door_of_at_most_12000_characters():
    size = len(README.read_text(encoding="utf-8"))
    assert size <= MAX_README_CHARS, f"README.md has {size} characters; move the detail into docs/"


def test_readme_opens_with_the_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    commands = re.findall(r"^python3 -m venv .*$", text, flags=re.M)
    assert len(commands) == 2 and "autoshard split" in commands[0] and "pytest" in commands[1]
    assert all("torch==2.13.0" in c for c in commands)
    assert commands[1] in (README.parent / ".ci" / "run").read_text()
