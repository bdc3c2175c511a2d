"""``calibrate_runtime``: what the pipeline runtime itself costs on this machine, measured with it.

A step is more than its stages' compute. Each message between ranks waits for the link
(``link_latency + bytes / link_bandwidth``) and also keeps both ranks busy: ``PipelineStage``'s
bookkeeping for the op and the transport's own CPU work. On this project's 2-core machine that
was about 1 ms a message against 0.15-0.2 ms of plain send/receive latency, and it made
predictions 20-60% short (``benchmarks/RESULTS.md``, "Step time"). So the runtime is measured
as it runs: two gloo processes ping-pong a small and a large tensor (the link), then run steps of
a model too small to compute anything under PyTorch's ``Schedule1F1B``; the time per message is
what the step simulation (``autoshard.costs.step_time``) must add for its step to last what the
real one did. The result is cached per machine with the device calibration (refresh as there:
``refresh=True`` or ``AUTOSHARD_RECALIBRATE=1``).

Only the CPU and gloo are calibrated this way: two ranks on one GPU do not make a pipeline. On
GPUs give the interconnect's numbers to ``StepTimeModel``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.api import shard_model
from autoshard.costs.estimate import cached_calibration, machine_key
from autoshard.costs.step_time import StepTimeModel, step_time
from autoshard.errors import LaunchError
from autoshard.runtime.launch import run_local
from autoshard.runtime.schedule import build_schedule
from autoshard.runtime.stage import pipeline_stage
from autoshard.runtime.stage_time import measure_stage_time
from autoshard.sharded import ShardedModel

STEPS = 20
"""Timed steps of the calibration pipeline (after ``WARMUP_STEPS``); the median counts."""
WARMUP_STEPS = 3
MICROBATCHES = 8
WIDTH, ROWS, LAYERS = 16, 4, 4
"""The calibration model: ``LAYERS`` linear layers of ``WIDTH``, ``ROWS`` rows a microbatch."""
LARGE_MESSAGE = 8 * 1024 * 1024
"""Bytes of the ping-pong that measures bandwidth."""
TIMEOUT = 300.0


@dataclass(frozen=True)
class RuntimeCalibration:
    """This machine's link between two ranks (bytes/s, seconds per message) and the time each
    message keeps a rank busy in the runtime; ``StepTimeModel``'s fields of the same names."""

    link_bandwidth: float
    link_latency: float
    message_seconds: float

    def __post_init__(self) -> None:
        StepTimeModel(link_bandwidth=self.link_bandwidth, link_latency=self.link_latency,
                      message_seconds=self.message_seconds)  # the same checks, the same typed errors

    def applied_to(self, step: StepTimeModel) -> StepTimeModel:
        """``step`` with this machine's link and time per message."""
        return dataclasses.replace(step, **dataclasses.asdict(self))

    def describe(self) -> str:
        return (f"link {self.link_bandwidth / 1e9:.3g} GB/s, {self.link_latency * 1e6:.0f} µs a message; "
                f"runtime {self.message_seconds * 1e6:.0f} µs of each rank's time per message")


def link_time(rank: int, nbytes: int, repeats: int = 20) -> float:
    """Half the median round trip of ``nbytes`` between ranks 0 and 1 (send, then receive back)."""
    buffer = torch.zeros(max(1, nbytes // 4))
    trips = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        if i >= 2:
            trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def measure_link(rank: int) -> tuple[float, float]:
    """(bytes per second, seconds per message) between ranks 0 and 1 of the current process group."""
    latency = link_time(rank, 4)
    return LARGE_MESSAGE / max(link_time(rank, LARGE_MESSAGE) - latency, 1e-9), latency


def _calibration_plan() -> ShardedModel:
    """The model every calibration process splits alike: too small for its compute to matter."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    return shard_model(model, 2, example_inputs=(torch.randn(ROWS, WIDTH),))


def _worker(rank: int, world: int) -> tuple[tuple[float, float], list[float]]:
    """This rank's link measurement and the wall seconds of each timed step."""
    torch.set_num_threads(1)
    link = measure_link(rank)
    stage = pipeline_stage(_calibration_plan(), rank, 2, "cpu")
    runner = build_schedule(stage, "1f1b", MICROBATCHES, loss_fn=nn.functional.mse_loss)
    rows = torch.randn(ROWS * MICROBATCHES, WIDTH)
    seconds = []
    for i in range(WARMUP_STEPS + STEPS):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            runner.step(rows, return_outputs=False)
        else:
            runner.step(target=rows, return_outputs=False)
        if i >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - start)
    return link, seconds


def fitted_message_seconds(measured: float, forward: list[float], backward: list[float], sent: list[float],
                           step: StepTimeModel) -> float:
    """The time per message for which the simulated ``step`` lasts ``measured`` seconds (0 when
    the stages and links alone already take that long)."""
    def simulated(message: float) -> float:
        return step_time(forward, backward, sent, dataclasses.replace(step, message_seconds=message)).seconds

    low, high = 0.0, measured
    if simulated(low) >= measured:
        return 0.0
    for _ in range(40):  # the step grows with the time per message; bisect to well under a microsecond
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < measured else (low, middle)
    return high


def _measured_here() -> RuntimeCalibration:
    """The calibration, from this process: it must be one that may start others (``__main__`` guarded)."""
    ranks = run_local(_worker, 2, timeout=TIMEOUT)
    (bandwidth, latency), _ = ranks[0]
    measured = statistics.median(max(both) for both in zip(*(seconds for _, seconds in ranks)))
    plan = _calibration_plan()
    stages = [measure_stage_time(plan, j, (torch.randn(ROWS, WIDTH),)) for j in range(2)]
    step = StepTimeModel("1f1b", MICROBATCHES, link_bandwidth=bandwidth, link_latency=latency)
    message = fitted_message_seconds(measured, [s.forward for s in stages], [s.backward for s in stages],
                                     plan.plan.boundary_bytes(), step)
    return RuntimeCalibration(bandwidth, latency, message)


def measure_runtime() -> RuntimeCalibration:
    """Measure the runtime on two local gloo processes now (about 15 s), without the cache. It runs
    in a fresh interpreter (``python -m autoshard.runtime.calibrate``), so the caller's script needs
    no ``if __name__ == "__main__"`` guard for the processes it starts."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, check=True,
                              timeout=TIMEOUT + 60)
        found = _parse(json.loads(done.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as failure:
        details = getattr(failure, "stderr", None) or str(failure)
        raise LaunchError(f"calibrating the pipeline runtime on two local processes failed:\n{details[-4000:]}"
                          ) from failure
    if found is None:
        raise LaunchError(f"calibrating the pipeline runtime gave an unreadable result: {done.stdout[-2000:]!r}")
    return found


def _parse(entry: Any) -> RuntimeCalibration | None:
    try:
        return RuntimeCalibration(float(entry["link_bandwidth"]), float(entry["link_latency"]),
                                  float(entry["message_seconds"]))
    except (KeyError, TypeError, ValueError):
        return None


def calibrate_runtime(refresh: bool = False) -> RuntimeCalibration:
    """This machine's ``RuntimeCalibration`` for gloo between local processes: cached, else measured
    (``measure_runtime``) and cached. ``refresh=True`` or ``AUTOSHARD_RECALIBRATE=1`` measures again."""
    return cached_calibration(f"{machine_key()}|runtime=gloo", measure_runtime, _parse, dataclasses.asdict, refresh)


if __name__ == "__main__":
    print(json.dumps(dataclasses.asdict(_measured_here())))


__all__ = ["RuntimeCalibration", "calibrate_runtime", "fitted_message_seconds", "measure_link", "measure_runtime"]
