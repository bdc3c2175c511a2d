"""The command answers ``--help``, ``--version`` and a usage error without importing torch (seconds:
``autoshard --help`` took 3.7 s when the parser's module imported the library), and its help still
states the library's values. Timings are in benchmarks/RESULTS.md ("Command-line start")."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from autoshard import cli, commands
from autoshard.runtime.stage_time import TIMING_REPEATS
from autoshard.targets import FACTORY_RETURNS


def imported_by(*args: str) -> set[str]:
    """The modules ``python -m autoshard ARGS`` imports, as ``-X importtime`` lists them."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "autoshard", *args],
                         capture_output=True, text=True, timeout=300)
    return {line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [
    ["--help"], ["split", "--help"], ["inspect", "--help"], ["--version"],
    ["split", "residual-mlp", "-k", "2", "--optimzer", "adam"],  # refused by the parser: a usage error
], ids=" ".join)
def test_help_and_usage_errors_import_no_torch(args):
    imported = imported_by(*args)
    assert "autoshard.cli" in imported  # (the listing is read right)
    assert not {name for name in imported if name.split(".")[0] == "torch"}


def test_a_command_imports_the_library_when_it_runs():
    """The check above can see torch: the commands that do work import it."""
    assert {"torch", "autoshard.commands"} <= imported_by("examples")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """The parser of each command ``autoshard`` takes, by name."""
    return next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def help_of(command: str) -> str:
    return " ".join(subcommands()[command].format_help().split())


def test_the_help_states_the_values_of_the_modules_it_does_not_import():
    """The help holds copies of ``FACTORY_RETURNS`` and ``TIMING_REPEATS`` (their modules import torch)."""
    for command in ("split", "inspect"):
        assert f"package.module:factory returning {FACTORY_RETURNS}" in help_of(command)
    assert f"(default {TIMING_REPEATS}; more on a busy machine)" in help_of("split")


def test_every_command_the_parser_takes_has_a_function_that_runs_it():
    assert set(subcommands()) == set(commands.COMMANDS)
