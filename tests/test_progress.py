"""Progress bars draw on a terminal and stay silent elsewhere or when quiet."""

from __future__ import annotations

import io
import sys

import pytest

from autoshard import progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_quiet():
    yield
    progress.set_quiet(False)


def run_task(stream: io.StringIO, monkeypatch) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    with progress.task("profiling", total=3) as advance:
        for _ in range(3):
            advance(1)
    return stream.getvalue()


def test_draws_on_a_terminal(monkeypatch, restore_quiet):
    assert "profiling" in run_task(FakeTTY(), monkeypatch)


def test_silent_when_not_a_terminal(monkeypatch, restore_quiet):
    assert run_task(io.StringIO(), monkeypatch) == ""


def test_silent_when_quiet(monkeypatch, restore_quiet):
    progress.set_quiet(True)
    assert run_task(FakeTTY(), monkeypatch) == ""
