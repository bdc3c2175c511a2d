"""Checks for the number arguments of the public API: whole numbers (stage counts, indices,
microbatches) and real numbers (capacities, budgets, a cost function's answers), and the
quantities with units users write (bytes, rates, durations)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, shown


def whole_number(value: Any, name: str, at_least: int | None = None) -> int:
    """``value`` as a plain int: an int or a numpy integer (what ``np.arange`` and array maths
    give), not a bool or a float; at least ``at_least`` when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentTypeError(f"{name} must be an int, got {shown(value)}")
    value = int(value)
    if at_least is not None and value < at_least:
        raise InvalidArgumentError(f"{name} must be at least {at_least}, got {value}")
    return value


def real_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (a Python or numpy number, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_count(text: str, name: str) -> float:
    """``40GiB``, ``1.5e9``, ``512MB`` or ``22.3 MiB`` (as the tables print it) as a number of bytes."""
    value = _with_unit(text.strip())
    if value is None or value < 0:
        raise InvalidArgumentError(f"{name} takes bytes per stage, such as 40GiB, 512MB or 1.5e9; got {text!r}")
    return value


def bytes_per_second(text: str, name: str, bare_unit: str) -> float:
    """``25GB/s``, ``900 GiB/s``, bits as ``100Gbit/s``, ``100Gbps`` or ``100Gb/s``, or a bare number,
    read in ``bare_unit`` (``GB/s``, ``B/s``: each flag keeps the unit it always had), as bytes per
    second, > 0. A lowercase ``b`` means bits only after an uppercase prefix: ``25gb/s`` is refused
    as ambiguous, since ``--max-memory 40gb`` reads gigabytes."""
    stripped = text.strip()
    per_second = stripped.upper().endswith("/S")
    amount = stripped[:-2].rstrip() if per_second else stripped
    bits = stripped.endswith("bps") or per_second and amount.lower().endswith("bit")  # 100Gbps, 100Gbit/s
    if bits:
        per_second, amount = True, stripped[:-3] if stripped.endswith("bps") else amount[:-3]
    elif per_second and amount.endswith("b"):
        prefix = amount[len(amount.rstrip("BbKkMmGgTtIi")):-1]
        if not prefix[:1].isupper():  # 25gb/s, 25b/s: bits or bytes?
            number, unit = amount[:len(amount) - len(prefix) - 1].strip(), prefix.capitalize()
            raise InvalidArgumentError(f"{name} got {text!r}, which could mean bytes or bits: write "
                                       f"{number}{unit}B/s for bytes or {number}{unit}bit/s for bits")
        bits, amount = True, amount[:-1]  # 25Gb/s: gigabits, as links are rated
    value = _with_unit(amount + "B" if bits else amount)
    if bits and value is not None:
        value /= 8
    if value is not None and not per_second:
        bare = _UNITS[bare_unit[:-2].upper()]
        value = value * bare if is_bare_number(stripped) else None  # a unit needs its "/s"
    if value is None or value <= 0:
        raise InvalidArgumentError(f"{name} takes a rate > 0 such as 25GB/s, 900GiB/s, 200Gbit/s or a bare "
                                   f"number (in {bare_unit}); got {text!r}")
    return value


def is_bare_number(text: str) -> bool:
    """Whether ``text`` is a number written without a unit (``25``, ``2.5e10``), read in a flag's bare unit."""
    return text.strip().rstrip("0123456789.eE+-") == ""


def _with_unit(text: str) -> float | None:
    """A finite number of bytes from ``512MB``-like text; None where it is not one."""
    number = text.rstrip("BbKkMmGgTtIi")
    unit = text[len(number):].upper()
    try:
        value = float(number)
    except ValueError:
        return None
    return value * _UNITS[unit] if unit in _UNITS and math.isfinite(value) else None


_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "\u00b5s": 1e6, "\u03bcs": 1e6, "ns": 1e9}
"""Each unit's count in a second (divided by: ``5us`` is 5e-6 exactly as written). Both micro signs:
the micro sign the tables print (U+00B5) and the Greek mu (U+03BC) that Greek keyboards type and
Unicode normalisation (NFKC) turns the micro sign into."""


def duration(text: str, name: str) -> float:
    """``5us``, ``0.1 ms``, ``2s`` or a bare number of seconds, as seconds >= 0."""
    stripped = text.strip()
    number = stripped.rstrip("smun\u00b5\u03bc ")
    unit = stripped[len(number):].strip()
    try:
        value = float(number) / _PER_SECOND[unit]
    except (ValueError, KeyError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(f"{name} takes a time >= 0 such as 5us, 0.1ms or a bare number of seconds; got "
                                   f"{text!r}")
    return value
