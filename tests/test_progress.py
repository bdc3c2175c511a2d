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


def test_shape_propagation_and_trace_retries_report_progress(monkeypatch, restore_quiet):
    """The long steps of planning a model draw their own bars: a trace that has to keep modules
    whole says which, and shape propagation counts the nodes it has run."""
    import torch

    import autoshard
    from autoshard.examples import BranchedNetwork

    stream = FakeTTY()
    monkeypatch.setattr(sys, "stderr", stream)
    autoshard.shard_model(BranchedNetwork(), 2, example_inputs=(torch.randn(2, 10),),
                          pipeline="trace,shape-prop,build-dag,linearize,split,emit")
    drawn = stream.getvalue()
    assert "trace: retry" in drawn and "kept whole blocks." in drawn
    assert "shape propagation" in drawn
