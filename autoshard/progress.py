"""Progress bars for long steps (trace retries, profiling, shape propagation).

Shown on stderr only when it is a terminal and progress is not silenced (``--quiet``), so logs,
pipes and CI stay clean.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_silenced = False


def set_quiet(quiet: bool) -> None:
    """Silence (or re-enable) every progress bar in this process."""
    global _silenced
    _silenced = quiet


def enabled() -> bool:
    return not _silenced and sys.stderr.isatty()


@contextlib.contextmanager
def task(description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; draws a bar only when ``enabled()``, otherwise does nothing."""
    if not enabled():
        yield lambda n=1: None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        handle = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(handle, n)
