"""``calibrate_runtime``: what the pipeline runtime itself costs on this machine, measured with it.

A step is more than its stages' compute timed alone. Each message between ranks waits for the
link (``link_latency + bytes / link_bandwidth``) and also keeps both ranks busy:
``PipelineStage``'s bookkeeping for the op and the transport's own CPU work. On this project's
2-core machine that was 0.4-1 ms a message against 0.1-0.2 ms of plain send/receive latency. And
the stages' own ops run longer inside the pipeline than alone: ranks sharing one machine's cores,
caches and memory bandwidth (and the transport's threads) slow each other down, 0-50% on that
machine. Left out, each made predictions 10-60% short (``benchmarks/RESULTS.md``, "Step time").
So the runtime is measured as it runs: two gloo processes ping-pong a small and a large tensor
(the link), then run steps of two models under each of PyTorch's schedules the step model knows
(GPipe, 1F1B, interleaved 1F1B: each runs its ops through different runtime code), one too small
to compute anything and one whose stages compute for milliseconds, each stage also timed alone
between the steps, and each op (a stage's forward or backward of a microbatch) timed inside
them. The compute scale is how much longer the computing model's ops ran inside than alone (less
the small one's: the runtime's own work in an op), one for all schedules (theirs, measured apart,
differed by no more than their noise); per schedule, the time per message is the one for which
the step simulation (``autoshard.costs.step_time``) lasts what the small model's steps did. The
result is cached per machine with the device calibration (refresh as there: ``refresh=True`` or
``AUTOSHARD_RECALIBRATE=1``).

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
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autoshard.api import shard_model
from autoshard.costs.estimate import cached_calibration, machine_key
from autoshard.costs.step_time import SCHEDULES, StepTimeModel, is_default, step_time
from autoshard.errors import InvalidArgumentError, LaunchError
from autoshard.runtime.launch import run_local, run_module
from autoshard.runtime.machine_load import LoadMeter
from autoshard.runtime.schedule import build_schedule, local_stage_indices
from autoshard.runtime.stage import pipeline_stage
from autoshard.runtime.stage_time import measure_stage_time
from autoshard.sharded import ShardedModel

STEPS = 20
"""Timed steps of each calibration pipeline (after ``WARMUP_STEPS``); the median counts."""
WARMUP_STEPS = 3
MICROBATCHES = 8
TIMEOUT = 300.0
LARGE_MESSAGE = 8 * 1024 * 1024
"""Bytes of the ping-pong that measures bandwidth."""
SCALE_RANGE = (0.5, 5.0)
"""The compute scales the calibration accepts (a measurement outside is clamped)."""


@dataclass(frozen=True)
class CalibrationModel:
    """A model the calibration runs: ``blocks`` feed-forward blocks (``width`` -> ``hidden`` ->
    ``width``), ``rows`` rows a microbatch."""

    width: int
    hidden: int
    blocks: int
    rows: int

    def plan(self, schedule: str) -> ShardedModel:
        """The plan every calibration process makes alike: 2 stages, or 4 for ``interleaved-1f1b``
        (2 per rank)."""
        torch.manual_seed(0)
        layers = [layer for _ in range(self.blocks)
                  for layer in (nn.Linear(self.width, self.hidden), nn.GELU(), nn.Linear(self.hidden, self.width))]
        return shard_model(nn.Sequential(*layers), _stages(schedule), example_inputs=(self.microbatch(),))

    def microbatch(self) -> torch.Tensor:
        return torch.randn(self.rows, self.width)


MESSAGES = CalibrationModel(width=16, hidden=16, blocks=2, rows=4)
"""Too small for its compute to matter: its steps measure the time per message, its ops the
runtime's own work in one."""
COMPUTE = CalibrationModel(width=256, hidden=1024, blocks=4, rows=64)
"""Stages of milliseconds (about 2.5 ms forward each on this project's 2-core VM): its ops
measure the compute scale."""


@dataclass(frozen=True)
class RuntimeCalibration:
    """This machine's link between two ranks (bytes/s, seconds per message); per schedule of
    ``SCHEDULES``, the time each message keeps a rank busy in the runtime (each schedule runs its
    ops through different runtime code); and how much longer a stage's ops run inside the pipeline
    than alone. ``StepTimeModel``'s fields of the same names."""

    link_bandwidth: float
    link_latency: float
    message_seconds: Mapping[str, float]
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.message_seconds, Mapping) or set(self.message_seconds) != set(SCHEDULES):
            raise InvalidArgumentError(f"message_seconds must give seconds for each of {', '.join(SCHEDULES)}; got "
                                       f"{self.message_seconds!r}")
        for seconds in self.message_seconds.values():  # the same checks, the same typed errors
            StepTimeModel(link_bandwidth=self.link_bandwidth, link_latency=self.link_latency, message_seconds=seconds,
                          compute_scale=self.compute_scale)

    def applied_to(self, step: StepTimeModel) -> StepTimeModel:
        """``step`` with this machine's link, its schedule's time per message and the compute scale,
        each where ``step`` leaves it at ``StepTimeModel``'s default (``calibrated_fields``): a value
        the caller gives is theirs, and the rest still measured here (an interconnect of their own
        does not make the runtime's work per message free)."""
        measured = {"link_bandwidth": self.link_bandwidth, "link_latency": self.link_latency,
                    "message_seconds": self.message_seconds[step.schedule], "compute_scale": self.compute_scale}
        return dataclasses.replace(step, **{name: measured[name] for name in calibrated_fields(step)})

    def describe(self) -> str:
        per_schedule = ", ".join(f"{name} {seconds * 1e6:.0f}" for name, seconds in self.message_seconds.items())
        return (f"link {self.link_bandwidth / 1e9:.3g} GB/s, {self.link_latency * 1e6:.0f} µs a message; "
                f"runtime µs of each rank's time per message: {per_schedule}; stages compute "
                f"x{self.compute_scale:.2f} their time alone")


RUNTIME_FIELDS = ("link_bandwidth", "link_latency", "message_seconds", "compute_scale")
"""The ``StepTimeModel`` fields a ``RuntimeCalibration`` measures."""


def calibrated_fields(step: StepTimeModel) -> list[str]:
    """The fields of ``RUNTIME_FIELDS`` that ``step`` leaves at their defaults, which the calibration
    fills: not given, as opposed to given equal to the default (``is_default``)."""
    return [name for name in RUNTIME_FIELDS if is_default(getattr(step, name))]


def link_time(rank: int, nbytes: int, repeats: int = 20) -> float:
    """Half the quickest round trip of ``nbytes`` between ranks 0 and 1 (send, then receive back):
    the link itself; a machine busy for a while (a median of 2 ms against 0.1 ms once on this
    project's VM) would otherwise move the latency tenfold, and what a step's messages wait
    beyond it is the fitted time per message's."""
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
    return min(trips) / 2


def measure_link(rank: int) -> tuple[float, float]:
    """(bytes per second, seconds per message) between ranks 0 and 1 of the current process group."""
    latency = link_time(rank, 4)
    return LARGE_MESSAGE / max(link_time(rank, LARGE_MESSAGE) - latency, 1e-9), latency


def _stages(schedule: str) -> int:
    return 4 if schedule == "interleaved-1f1b" else 2


def timed_ops(stages: Sequence[Any]) -> dict[tuple[int, str], list[float]]:
    """Wrap each ``PipelineStage``'s ``forward_one_chunk`` and ``backward_one_chunk`` (the calls
    PyTorch's schedules make for one microbatch's op) to record how long each takes inside a step:
    ``{(stage index, "forward" or "backward"): [seconds, ...]}``."""
    ops: dict[tuple[int, str], list[float]] = {}
    for stage in stages:
        for kind in ("forward", "backward"):
            run, seconds = getattr(stage, f"{kind}_one_chunk"), ops.setdefault((stage.stage_index, kind), [])

            def timed(*args: Any, _run: Callable[..., Any] = run, _seconds: list[float] = seconds,
                      **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _run(*args, **kwargs)
                finally:
                    _seconds.append(time.perf_counter() - start)
            setattr(stage, f"{kind}_one_chunk", timed)
    return ops


@dataclass(frozen=True)
class TimedSteps:
    """Steps of one pipeline as they ran under ``step``'s schedule: ``measured``, the median step's
    seconds; ``inside``, the mean seconds of one op (a stage's forward or backward of a
    microbatch) within them; and its stages timed alone (seconds per microbatch) with the bytes
    each sends."""

    measured: float
    inside: float
    forward: list[float]
    backward: list[float]
    sent: list[int]
    step: StepTimeModel

    @property
    def alone(self) -> float:
        """The mean seconds of one op timed alone."""
        return (sum(self.forward) + sum(self.backward)) / (2 * len(self.forward))

    def simulated(self, message_seconds: float, compute_scale: float) -> float:
        runtime = dataclasses.replace(self.step, message_seconds=message_seconds, compute_scale=compute_scale)
        return step_time(self.forward, self.backward, self.sent, runtime).seconds


def _worker(rank: int, world: int) -> tuple[tuple[float, float], dict[tuple[str, str], Any]]:
    """This rank's link measurement and, per (model, schedule), the wall seconds of each timed
    step, its ops' seconds within them and (rank 0) each stage timed alone before every step while
    rank 1 waits. The pipelines take turns step by step, so a change in the machine's speed meets
    them all alike."""
    torch.set_num_threads(1)
    link = measure_link(rank)
    runs = {}
    for model_name, model in (("messages", MESSAGES), ("compute", COMPUTE)):
        for schedule in SCHEDULES:
            k, plan = _stages(schedule), model.plan(schedule)
            stages = [pipeline_stage(plan, j, k, "cpu") for j in local_stage_indices(k, rank, 2)]
            ops = timed_ops(stages)
            runner = build_schedule(stages, schedule, MICROBATCHES, loss_fn=nn.functional.mse_loss)
            runs[(model_name, schedule)] = (plan, runner, model, ops)
    found: dict[tuple[str, str], Any] = {key: ([], []) for key in runs}
    for i in range(WARMUP_STEPS + STEPS):
        for key, (plan, runner, model, ops) in runs.items():
            seconds, alone = found[key]
            if i == WARMUP_STEPS:
                for calls in ops.values():
                    calls.clear()
            if rank == 0 and i >= WARMUP_STEPS:
                alone.append([measure_stage_time(plan, j, (model.microbatch(),), repeats=1)
                              for j in range(plan.num_stages)])
            rows = torch.cat([model.microbatch() for _ in range(MICROBATCHES)])
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                runner.step(rows, return_outputs=False)
            else:
                runner.step(target=rows, return_outputs=False)
            if i >= WARMUP_STEPS:
                seconds.append(time.perf_counter() - start)
    return link, {key: (*found[key], [t for calls in runs[key][3].values() for t in calls]) for key in runs}


def _timed_steps(ranks: list, key: tuple[str, str], link: tuple[float, float]) -> TimedSteps:
    """Both ranks' steps of one pipeline (each step lasts until the later rank ends) and ops, and
    rank 0's stage timings, medians."""
    measured = statistics.median(max(both) for both in zip(*(found[key][0] for _, found in ranks)))
    inside = statistics.mean(t for _, found in ranks for t in found[key][2])
    alone = ranks[0][1][key][1]
    stages = range(len(alone[0]))
    return TimedSteps(measured, inside, [statistics.median(run[j].forward for run in alone) for j in stages],
                      [statistics.median(run[j].backward for run in alone) for j in stages],
                      [alone[0][j].sent_bytes for j in stages][:-1],
                      StepTimeModel(key[1], MICROBATCHES, link_bandwidth=link[0], link_latency=link[1]))


def fitted_runtime(runs: Mapping[str, tuple[TimedSteps, TimedSteps]]) -> tuple[dict[str, float], float]:
    """Per schedule the time per message, and one compute scale, from both pipelines of each
    schedule (``runs[schedule]``: the one whose compute is negligible, then the one whose compute
    counts). The scale is how much longer the second's ops ran inside the steps than alone, less
    the first's (the runtime's own work in an op, which the time per message counts), over all
    schedules together. The time per message then makes the first pipeline's simulated step last
    as long as it did."""
    scale = (sum(compute.inside - tiny.inside for tiny, compute in runs.values())
             / max(sum(compute.alone - tiny.alone for tiny, compute in runs.values()), 1e-12))
    scale = min(max(scale, SCALE_RANGE[0]), SCALE_RANGE[1])
    return {schedule: _message_seconds(tiny, scale) for schedule, (tiny, _) in runs.items()}, scale


def _message_seconds(run: TimedSteps, scale: float) -> float:
    """The time per message for which ``run``'s simulated step lasts as long as it did (0 when its
    stages and links alone already take that long)."""
    low, high = 0.0, run.measured
    if run.simulated(low, scale) >= run.measured:
        return 0.0
    for _ in range(40):  # the step grows with the time per message: bisect to well under a microsecond
        middle = (low + high) / 2
        low, high = (middle, high) if run.simulated(middle, scale) < run.measured else (low, middle)
    return high


def _measured_here() -> RuntimeCalibration:
    """The calibration, from this process: it must be one that may start others (``__main__`` guarded)."""
    ranks = run_local(_worker, 2, timeout=TIMEOUT)
    link = ranks[0][0]
    message, scale = fitted_runtime({schedule: (_timed_steps(ranks, ("messages", schedule), link),
                                                _timed_steps(ranks, ("compute", schedule), link))
                                     for schedule in SCHEDULES})
    return RuntimeCalibration(link[0], link[1], message, scale)


def measure_runtime() -> RuntimeCalibration:
    """Measure the runtime on two local gloo processes now (about 20 s), without the cache. It runs
    in a fresh interpreter (``python -m autoshard.runtime.calibrate``), so the caller's script needs
    no ``if __name__ == "__main__"`` guard for the processes it starts. Other processes busy
    meanwhile slow its steps: it warns then (``CalibrationLoadWarning``)."""
    load = LoadMeter.start()
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
    load.warn_if_busy("the pipeline runtime (calibrate_runtime)")
    return found


def _parse(entry: Any) -> RuntimeCalibration | None:
    try:
        message = {str(name): float(seconds) for name, seconds in entry["message_seconds"].items()}
        return RuntimeCalibration(float(entry["link_bandwidth"]), float(entry["link_latency"]), message,
                                  float(entry["compute_scale"]))
    except (KeyError, TypeError, ValueError, AttributeError):  # an older entry: one float, or no compute scale
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


__all__ = ["RUNTIME_FIELDS", "RuntimeCalibration", "TimedSteps", "calibrate_runtime", "calibrated_fields",
           "fitted_runtime", "measure_link", "measure_runtime", "timed_ops"]
