"""Progress as the CLI uses it: nested bars share one display, and --quiet lasts for one command."""

from __future__ import annotations

import io
import sys

from rich.progress import Progress

from autoshard import progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def on_terminal(monkeypatch) -> FakeTTY:
    """Patched in the test body: pytest resets ``sys.stderr`` between fixture setup and the call."""
    stream = FakeTTY()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def test_a_task_inside_another_joins_its_display(monkeypatch):
    """Two live displays on one terminal overwrite each other: profiling inside a pass's bar joins it."""
    terminal = on_terminal(monkeypatch)
    displays: list[Progress] = []

    class Counted(Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            displays.append(self)

    monkeypatch.setattr(progress, "Progress", Counted)
    with progress.task("pipeline", total=2) as outer:
        outer.describe("pipeline: profile")
        with progress.task("profiling node times", total=3) as inner:
            assert [t.description for t in displays[0].tasks] == ["pipeline: profile", "profiling node times"]
            inner(3)
        assert [t.description for t in displays[0].tasks] == ["pipeline: profile"]
        outer(2)
    assert len(displays) == 1
    with progress.task("afterwards", total=1) as advance:  # the display was released
        advance(1)
    assert len(displays) == 2 and "afterwards" in terminal.getvalue()


def test_silenced_lasts_for_its_block_only(monkeypatch):
    terminal = on_terminal(monkeypatch)
    assert progress.enabled()
    with progress.silenced(True):
        assert not progress.enabled()
        with progress.task("hidden", total=1) as advance:
            advance(1)
    assert progress.enabled()
    assert "hidden" not in terminal.getvalue()
