"""The README's Python examples run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from autoshard.passes import default_registry

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run_and_match_the_model():
    namespace: dict = {}
    try:
        for block in python_blocks():
            exec(compile(block, str(README), "exec", dont_inherit=True), namespace)
    finally:
        if "name-order" in default_registry:
            default_registry.unregister("name-order")
    model, src, mask = namespace["model"], namespace["src"], namespace["causal_mask"](12)
    assert len(namespace["sharded"].stages) == 4
    assert torch.equal(namespace["out"], model(src, mask))
    assert torch.equal(namespace["sharded"](src, mask), model(src, mask))


def test_readme_opens_with_the_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    commands = re.findall(r"^python3 -m venv .*$", text, flags=re.M)
    assert len(commands) == 2 and "autoshard split" in commands[0] and "pytest" in commands[1]
    assert all("torch==2.13.0" in c for c in commands)
    assert commands[1] in (README.parent / ".ci" / "run").read_text()
