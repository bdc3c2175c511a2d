"""``calibrate_runtime``: what the pipeline runtime itself costs on this machine, measured with it.

A step is more than its stages' compute. Each message between ranks waits for the link
(``link_latency + bytes / link_bandwidth``) and also keeps both ranks busy: ``PipelineStage``'s
bookkeeping for the op and the transport's own CPU work. On this project's 2-core machine that
was 0.6-1 ms a message against 0.1-0.2 ms of plain send/receive latency, and it made
predictions 20-60% short (``benchmarks/RESULTS.md``, "Step time"). So the runtime is measured
as it runs: two gloo processes ping-pong a small and a large tensor (the link), then run steps of
a model too small to compute anything under each of PyTorch's schedules the step model knows
(GPipe, 1F1B, interleaved 1F1B: each runs its ops through different runtime code); the time per
message is what the step simulation (``autoshard.costs.step_time``) must add for its step to
last what the real one did. The result is cached per machine with the device calibration
(refresh as there: ``refresh=True`` or ``AUTOSHARD_RECALIBRATE=1``).

Only the CPU and gloo are calibrated this way: two ranks on one GPU do not make a pipeline. On
GPUs give the interconnect's numbers to ``StepTimeModel``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from autoshard.api import shard_model
from autoshard.costs.estimate import cached_calibration, machine_key
from autoshard.costs.step_time import SCHEDULES, StepTimeModel, step_time
from autoshard.errors import InvalidArgumentError, LaunchError
from autoshard.runtime.launch import run_local, run_module
from autoshard.runtime.schedule import build_schedule, local_stage_indices
from autoshard.runtime.stage import pipeline_stage
from autoshard.runtime.stage_time import measure_stage_time
from autoshard.sharded import ShardedModel

STEPS = 30
"""Timed steps of each calibration pipeline (after ``WARMUP_STEPS``); the median counts."""
WARMUP_STEPS = 3
MICROBATCHES = 8
WIDTH, ROWS, LAYERS = 16, 4, 4
"""The calibration model: ``LAYERS`` linear layers of ``WIDTH``, ``ROWS`` rows a microbatch."""
LARGE_MESSAGE = 8 * 1024 * 1024
"""Bytes of the ping-pong that measures bandwidth."""
TIMEOUT = 300.0


@dataclass(frozen=True)
class RuntimeCalibration:
    """This machine's link between two ranks (bytes/s, seconds per message) and, per schedule of
    ``SCHEDULES``, the time each message keeps a rank busy in the runtime (each schedule runs its
    ops through different runtime code); ``StepTimeModel``'s fields of the same names."""

    link_bandwidth: float
    link_latency: float
    message_seconds: Mapping[str, float]

    def __post_init__(self) -> None:
        if not isinstance(self.message_seconds, Mapping) or set(self.message_seconds) != set(SCHEDULES):
            raise InvalidArgumentError(f"message_seconds must give seconds for each of {', '.join(SCHEDULES)}; got "
                                       f"{self.message_seconds!r}")
        for seconds in self.message_seconds.values():  # the same checks, the same typed errors
            StepTimeModel(link_bandwidth=self.link_bandwidth, link_latency=self.link_latency, message_seconds=seconds)

    def applied_to(self, step: StepTimeModel) -> StepTimeModel:
        """``step`` with this machine's link and its schedule's time per message."""
        return dataclasses.replace(step, link_bandwidth=self.link_bandwidth, link_latency=self.link_latency,
                                   message_seconds=self.message_seconds[step.schedule])

    def describe(self) -> str:
        per_schedule = ", ".join(f"{name} {seconds * 1e6:.0f}" for name, seconds in self.message_seconds.items())
        return (f"link {self.link_bandwidth / 1e9:.3g} GB/s, {self.link_latency * 1e6:.0f} µs a message; "
                f"runtime µs of each rank's time per message: {per_schedule}")


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


def _calibration_plan(schedule: str) -> ShardedModel:
    """The model every calibration process splits alike, too small for its compute to matter: in
    2 stages, or 4 for ``interleaved-1f1b`` (2 per rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    return shard_model(model, _stages(schedule), example_inputs=(torch.randn(ROWS, WIDTH),))


def _stages(schedule: str) -> int:
    return 4 if schedule == "interleaved-1f1b" else 2


def _worker(rank: int, world: int) -> tuple[tuple[float, float], dict[str, list[float]]]:
    """This rank's link measurement and, per schedule, the wall seconds of each timed step. The
    schedules take turns step by step, so a change in the machine's speed meets them all alike."""
    torch.set_num_threads(1)
    link = measure_link(rank)
    runners = {}
    for schedule in SCHEDULES:
        k = _stages(schedule)
        stages = [pipeline_stage(_calibration_plan(schedule), j, k, "cpu") for j in local_stage_indices(k, rank, 2)]
        runners[schedule] = build_schedule(stages, schedule, MICROBATCHES, loss_fn=nn.functional.mse_loss)
    rows = torch.randn(ROWS * MICROBATCHES, WIDTH)
    seconds: dict[str, list[float]] = {schedule: [] for schedule in SCHEDULES}
    for i in range(WARMUP_STEPS + STEPS):
        for schedule, runner in runners.items():
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                runner.step(rows, return_outputs=False)
            else:
                runner.step(target=rows, return_outputs=False)
            if i >= WARMUP_STEPS:
                seconds[schedule].append(time.perf_counter() - start)
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
    message = {}
    for schedule in SCHEDULES:
        measured = statistics.median(max(both) for both in zip(*(seconds[schedule] for _, seconds in ranks)))
        plan = _calibration_plan(schedule)
        stages = [measure_stage_time(plan, j, (torch.randn(ROWS, WIDTH),)) for j in range(plan.num_stages)]
        step = StepTimeModel(schedule, MICROBATCHES, link_bandwidth=bandwidth, link_latency=latency)
        message[schedule] = fitted_message_seconds(measured, [s.forward for s in stages],
                                                   [s.backward for s in stages], plan.plan.boundary_bytes(), step)
    return RuntimeCalibration(bandwidth, latency, message)


def measure_runtime() -> RuntimeCalibration:
    """Measure the runtime on two local gloo processes now (about 20 s), without the cache. It runs
    in a fresh interpreter (``python -m autoshard.runtime.calibrate``), so the caller's script needs
    no ``if __name__ == "__main__"`` guard for the processes it starts."""
    try:
        done = run_module(__name__, TIMEOUT + 60)
    except (subprocess.SubprocessError, OSError) as failure:
        raise LaunchError(f"calibrating the pipeline runtime on two local processes failed: {failure}\n"
                          f"{(getattr(failure, 'stderr', None) or '')[-4000:]}") from failure
    lines = done.stdout.strip().splitlines()
    try:
        found = _parse(json.loads(lines[-1])) if lines else None
    except ValueError:
        found = None
    if found is None:
        raise LaunchError(f"calibrating the pipeline runtime gave no readable result; its output:\n"
                          f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return found


def _parse(entry: Any) -> RuntimeCalibration | None:
    try:
        message = {str(name): float(seconds) for name, seconds in entry["message_seconds"].items()}
        return RuntimeCalibration(float(entry["link_bandwidth"]), float(entry["link_latency"]), message)
    except (KeyError, TypeError, ValueError, AttributeError):  # AttributeError: an older entry's one float
        return None


def calibrate_runtime(refresh: bool = False) -> RuntimeCalibration:
    """This machine's ``RuntimeCalibration`` for gloo between local processes: cached, else measured
    (``measure_runtime``) and cached. ``refresh=True`` or ``AUTOSHARD_RECALIBRATE=1`` measures again."""
    return cached_calibration(runtime_cache_key(), measure_runtime, _parse, dataclasses.asdict, refresh)


def runtime_cache_key() -> str:
    """The calibration's key in the cache: the machine, whatever threads the caller runs (its
    workers run one each)."""
    return f"{machine_key(threads=False)}|runtime=gloo"


if __name__ == "__main__":
    print(json.dumps(dataclasses.asdict(_measured_here())))


__all__ = ["RuntimeCalibration", "calibrate_runtime", "fitted_message_seconds", "measure_link", "measure_runtime"]
