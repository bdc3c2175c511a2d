"""How much of this machine other processes used while autoshard measured it.

The runtime calibration (``calibrate.measure_runtime``) times pipeline steps, whose medians take
whatever the machine gives them: measured under load, its time per message and compute scale
read long, and cached they stay so for every later prediction. It keeps what load cannot move
(the quickest round trips), and tells the user when it met a busy machine, with how to measure
again. (The device calibration keeps the fastest run of one thread, which finds a quiet moment
under load; it is not checked.)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from autoshard.errors import user_stacklevel

BUSY_SHARE = 0.25
"""The share of the machine's CPU time other processes may take while it is measured before the
user is warned (half a core of two; one thread of a 64-core machine passes)."""

SHORTEST_WINDOW = 1.0
"""CPU seconds of the whole machine (all cores) below which no share is judged: ``/proc/stat``
counts in ticks of 10 ms, so a few of them say nothing."""


class CalibrationLoadWarning(UserWarning):
    """The runtime calibrated while other processes kept the machine busy: its numbers may read
    slow, and they are cached as they are."""


def machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, all) CPU seconds of the whole machine since boot, from ``/proc/stat`` (idle and iowait
    are not busy; time the hypervisor gave elsewhere is); None where there is none (not Linux)."""
    try:
        with open("/proc/stat", encoding="utf-8") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (sum(ticks) - ticks[3] - ticks[4]) / per_second, sum(ticks) / per_second


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (a measurement's workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@dataclass(frozen=True)
class LoadMeter:
    """The machine's and this process's CPU time when a measurement started."""

    machine: tuple[float, float] | None
    own: float

    @classmethod
    def start(cls) -> "LoadMeter":
        return cls(machine_cpu_seconds(), own_cpu_seconds())

    def others_share(self) -> float | None:
        """The share of the machine's CPU time since ``start`` that other processes used; None where
        it cannot be read or the window is too short to judge."""
        now = machine_cpu_seconds()
        if self.machine is None or now is None:
            return None
        busy, total = now[0] - self.machine[0], now[1] - self.machine[1]
        if total < SHORTEST_WINDOW:
            return None
        return min(max(busy - (own_cpu_seconds() - self.own), 0.0) / total, 1.0)

    def warn_if_busy(self, what: str) -> None:
        """Warn (``CalibrationLoadWarning``) when other processes took more than ``BUSY_SHARE`` of
        the machine since ``start``: ``what`` was measured then."""
        others = self.others_share()
        if others is not None and others > BUSY_SHARE:
            warnings.warn(
                f"other processes used {others:.0%} of this machine's CPU time while autoshard measured {what}: "
                "its numbers may read slow, and they are cached as measured; measure again on a quiet machine "
                "(AUTOSHARD_RECALIBRATE=1, or refresh=True)", CalibrationLoadWarning, stacklevel=user_stacklevel())


__all__ = ["BUSY_SHARE", "CalibrationLoadWarning", "LoadMeter", "machine_cpu_seconds", "own_cpu_seconds"]
