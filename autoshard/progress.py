"""Progress bars for long steps (trace retries, profiling, shape propagation, pipeline passes).

Shown on stderr only when it is a terminal and progress is not silenced (``--quiet``), so logs,
pipes and CI stay clean.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

_silenced = False


def set_quiet(quiet: bool) -> None:
    """Silence (or re-enable) every progress bar in this process."""
    global _silenced
    _silenced = quiet


@contextlib.contextmanager
def silenced(quiet: bool = True) -> Iterator[None]:
    """Silence progress bars inside the block (when ``quiet``), restoring the setting after it."""
    before = _silenced
    set_quiet(quiet or before)
    try:
        yield
    finally:
        set_quiet(before)


def enabled() -> bool:
    return not _silenced and sys.stderr.isatty()


class Advance:
    """What ``task`` yields: call it to advance the bar; ``describe`` relabels the step under way."""

    def __init__(self, advance: Callable[[int], None], describe: Callable[[str], None]) -> None:
        self._advance = advance
        self._describe = describe

    def __call__(self, n: int = 1) -> None:
        self._advance(n)

    def describe(self, description: str) -> None:
        self._describe(description)


_active: Progress | None = None
"""The display drawing now; a task started inside another joins it, since two live displays on one
terminal overwrite each other's lines."""


def _on(bar: Progress, handle: TaskID) -> Advance:
    return Advance(lambda n=1: bar.advance(handle, n), lambda text: bar.update(handle, description=text))


@contextlib.contextmanager
def task(description: str, total: int | None = None) -> Iterator[Advance]:
    """Yield an ``Advance``; draws a bar only when ``enabled()``, otherwise does nothing.

    A task started while another is drawing (profiling inside a pipeline's pass bar) is shown as
    one more line of the same display and removed when it ends.
    """
    global _active
    if not enabled():
        yield Advance(lambda n=1: None, lambda text: None)
        return
    if _active is not None:
        bar = _active
        handle = bar.add_task(description, total=total)
        try:
            yield _on(bar, handle)
        finally:
            bar.remove_task(handle)
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        _active = bar
        try:
            yield _on(bar, bar.add_task(description, total=total))
        finally:
            _active = None
