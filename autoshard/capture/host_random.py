"""Draws from Python's or numpy's global random generator while a model is captured.

A graph records torch operations; ``random.random() < p`` or ``np.random.rand()`` in a forward runs
once, while tracing, and the branch it chose is fixed for every later call (x-transformers'
``layer_dropout`` then never drops a layer). Verification catches this only when its own run of
the model happens to draw differently, so capture says so itself: ``watching_host_random`` warns
when the capture drew from either generator, and sets both back, so capturing never moves the
user's generators. A module kept whole draws anew on every call; the warning cannot tell its
draws from traced ones, so it warns and does not refuse.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from typing import Any, Iterator


class HostRandomnessWarning(UserWarning):
    """The model drew from Python's or numpy's random generator while it was captured."""


def _states() -> tuple[Any, Any]:
    numpy = sys.modules.get("numpy")  # not imported: the model cannot have used it
    return random.getstate(), numpy.random.get_state(legacy=False) if numpy is not None else None


def _same(first: Any, second: Any) -> bool:
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    if numpy is not None and isinstance(first, numpy.ndarray):
        return bool(numpy.array_equal(first, second))
    return bool(first == second)


@contextlib.contextmanager
def host_draws() -> Iterator[list[str]]:
    """The global generators ("Python's random", "numpy's random") the code inside drew from,
    listed on exit; both are set back, so the caller's generators do not move."""
    python_before, numpy_before = _states()
    drew: list[str] = []
    try:
        yield drew
    finally:
        python_after, numpy_after = _states()
        drew.extend(name for name, same in (
            ("Python's random", python_before == python_after),
            ("numpy's random", numpy_before is None or _same(numpy_before, numpy_after))) if not same)
        random.setstate(python_before)
        if numpy_before is not None:
            sys.modules["numpy"].random.set_state(numpy_before)


#: What to do about a draw from a host generator, for the warning and for verification.
DRAW_WITH_TORCH = "Draw with torch (torch.rand) to keep the randomness in the graph"


@contextlib.contextmanager
def watching_host_random(model_name: str) -> Iterator[None]:
    """Warn if the code inside drew from Python's or numpy's global generator; set both back."""
    with host_draws() as drew:
        yield
    if drew:
        warnings.warn(
            f"{model_name} drew from {' and '.join(drew)} while it was captured: a draw in code the graph "
            "traced (random() < p deciding a branch) is fixed to the example's for every later call; "
            f"modules kept whole draw anew. {DRAW_WITH_TORCH}", HostRandomnessWarning, stacklevel=3)
