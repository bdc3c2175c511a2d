"""Time per node without measuring it: a roofline device model, for reports when nothing was profiled.

A node takes ``max(flops / peak_flops, bytes_moved / bandwidth)`` seconds: it is limited either by
arithmetic or by memory traffic, whichever is slower (the roofline model). ``bytes_moved`` is what
the node reads (the tensors it receives and the weights it uses) plus the new memory its output
allocates. A node that computes nothing and allocates nothing (a view, ``getitem``, a size query)
costs nothing. There is no launch overhead and no overlap between nodes, so the estimate is a
floor for small nodes and a guide, not a measurement: use ``cost=time`` (the ``profile`` pass)
when the numbers must be real.

The peaks come from the user (``DeviceModel(peak_flops, bandwidth)``; ``autoshard split
--device-tflops --device-bandwidth``) or from ``calibrated_device()``: a short micro-benchmark of
the planning machine (a matrix product for FLOP/s, a copy for bytes/s). One timing on a shared
machine reads whatever load it met (280 GFLOP/s on one run, 22 on the next), so each is repeated
for a fixed time and the fastest run kept, on all threads and on one (see ``measure_device``),
and the result is cached per machine (CPU, thread count, torch version) under the user's cache
directory (``$XDG_CACHE_HOME/autoshard``, else ``~/.cache/autoshard``): identical commands then
estimate identical times. ``refresh=True`` or ``AUTOSHARD_RECALIBRATE=1`` measures again and
replaces the cached numbers.
Measured times, when the DAG has them, always win (``node_times``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import networkx as nx

from autoshard.costs.models import measured, time_costs
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError

try:
    import fcntl
except ImportError:  # Windows: no flock, so concurrent calibrations are not serialised there
    fcntl = None  # type: ignore[assignment]

CALIBRATION_MATMUL = 512
"""Side of the square float32 matrices multiplied to measure FLOP/s (2 x 512^3 = 268 MFLOP)."""

CALIBRATION_COPY_BYTES = 32 * 1024 * 1024
"""Bytes copied to measure memory bandwidth: larger than the caches, small enough to be quick."""

CALIBRATION_METHOD = 2
"""Part of the cache key, raised when a benchmark changes what it measures: entries measured the
old way are measured again (2: the copy's source is written memory, not the zero page)."""

CALIBRATION_REPEATS = 5
"""Fewest timed runs of each micro-benchmark (after one warm-up)."""

CALIBRATION_SECONDS = 1.0
"""Each micro-benchmark repeats for at least this long, so that a burst of load from elsewhere
leaves some runs untouched; the fastest run is the machine's speed. This project's VM slows for
stretches of a few tenths of a second: fresh processes kept 65-96 GFLOP/s from 0.2 s and 0.5 s
windows, 95-96 from 1 s ones (about 4 s a calibration, once per machine)."""

CALIBRATION_MAX_REPEATS = 1000

RECALIBRATE_ENV = "AUTOSHARD_RECALIBRATE"
"""Set to 1 to measure this machine again instead of reading the cached calibration."""


def _flop_rate(flops_per_second: float) -> str:
    """In TFLOP/s from 1e12 up, as a GPU's peak is quoted: ``--device-tflops 989`` read 9.89e+05 GFLOP/s."""
    if flops_per_second >= 1e12:
        return f"{flops_per_second / 1e12:.4g} TFLOP/s"
    return f"{flops_per_second / 1e9:.4g} GFLOP/s"


@dataclass(frozen=True)
class DeviceModel:
    """Peak arithmetic (FLOP/s) and memory bandwidth (bytes/s) of the device that runs a stage.

    ``calibrated`` says the numbers were measured on the planning machine rather than given.
    """

    peak_flops: float
    bandwidth: float
    calibrated: bool = False

    def __post_init__(self) -> None:
        for name in ("peak_flops", "bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"a device model's {name} must be a finite number > 0, got {value!r}")

    def seconds(self, flops: float, moved: float) -> float:
        """The roofline time of ``flops`` operations touching ``moved`` bytes."""
        return max(flops / self.peak_flops, moved / self.bandwidth)

    def describe(self) -> str:
        source = "calibrated on this machine" if self.calibrated else "given"
        return f"{_flop_rate(self.peak_flops)}, {self.bandwidth / 1e9:.4g} GB/s ({source})"

    def to_dict(self) -> dict[str, Any]:
        return {"model": "roofline", "peak_flops": self.peak_flops, "bandwidth": self.bandwidth,
                "calibrated": self.calibrated}


def _two_digits(x: float) -> float:
    """Round to two significant digits: calibration jitters by more than that from run to run."""
    return round(x, -int(math.floor(math.log10(x))) + 1)


def _best_seconds(step: Callable[[], Any]) -> float:
    """The fastest of runs repeated for ``CALIBRATION_SECONDS`` after one warm-up: the machine's
    peak, not the load it met."""
    step()
    best, spent, runs = math.inf, 0.0, 0
    while (runs < CALIBRATION_REPEATS or spent < CALIBRATION_SECONDS) and runs < CALIBRATION_MAX_REPEATS:
        start = time.perf_counter()
        step()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return max(best, 1e-9)


def measure_device() -> DeviceModel:
    """Measure this machine's CPU now (about 4 s), without the cache.

    Each benchmark is also timed on one thread: one thread finds a quiet moment where all of them
    rarely do (on two shared cores under load 6: 72-78 GFLOP/s on one thread, 8-24 on two). The
    peak is the larger of all threads' rate and one thread's times the thread count; bandwidth,
    which does not grow with threads, the larger of the two rates."""
    import torch

    threads = torch.get_num_threads()
    with torch.no_grad():
        n = CALIBRATION_MATMUL
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        flops, one_thread_flops = _rates(2 * n**3, lambda: torch.mm(a, b, out=out))
        # Both written first: pages never written all map the kernel's one zero page, which reads
        # from the cache (an unwritten source read 26-35 GB/s where a written one reads 16-18).
        source = torch.ones(CALIBRATION_COPY_BYTES // 4)
        target = torch.zeros_like(source)
        bandwidth, one_thread_bandwidth = _rates(2 * CALIBRATION_COPY_BYTES, lambda: target.copy_(source))  # r + w
    return DeviceModel(_two_digits(max(flops, one_thread_flops * threads)),
                       _two_digits(max(bandwidth, one_thread_bandwidth)), calibrated=True)


def _rates(work: float, step: Callable[[], Any]) -> tuple[float, float]:
    """``work`` per second of ``step`` on torch's threads, and on one."""
    from autoshard.costs.execution import on_threads

    everyone = work / _best_seconds(step)
    with on_threads(1):
        return everyone, work / _best_seconds(step)


def calibration_cache() -> Path:
    """The file holding this user's calibrations, one per machine key."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "autoshard" / "calibration.json"


def machine_key(threads: bool = True) -> str:
    """What the calibrated speed depends on: the CPU, how many threads torch runs (unless
    ``threads`` is False: for what does not compute), torch's version, and how it was measured."""
    import torch

    counted = f"|threads={torch.get_num_threads()}" if threads else ""
    return (f"{platform.node()}|{platform.machine()}|{_cpu_name()}|cpus={os.cpu_count()}"
            f"{counted}|torch={torch.__version__}|device=cpu|method={CALIBRATION_METHOD}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _read_calibrations(path: Path) -> dict[str, Any]:
    """The cached calibrations, or none when the file is missing or unreadable (then it is rewritten)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cached_device(entry: Any) -> DeviceModel | None:
    try:
        return DeviceModel(float(entry["peak_flops"]), float(entry["bandwidth"]), calibrated=True)
    except (KeyError, TypeError, ValueError):  # InvalidArgumentError is a ValueError
        return None


def _write_calibration(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` under ``key``, replacing the file whole so a concurrent reader never sees half of it,
    under the file's lock so a concurrent writer's entry is not lost. A cache that cannot be
    written (read-only home) only costs a calibration per process."""
    with _locked(path.with_name(f"{path.name}.lock")):
        data = _read_calibrations(path)
        data[key] = {**entry, "measured_at": time.time()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(partial, path)
        except OSError:
            pass


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` across processes (``flock``: the system drops it
    when its holder dies); without one where the platform or the file system has no ``flock``, or the
    file cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - closed below, after the lock
    except OSError:
        handle = None
    try:
        if fcntl is not None and handle is not None:
            with contextlib.suppress(OSError):  # a file system without flock (some network mounts)
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        if handle is not None:
            handle.close()


T = TypeVar("T")

_THIS_PROCESS: dict[str, Any] = {}


def cached_calibration(key: str, measure: Callable[[], T], parse: Callable[[Any], T | None],
                       entry: Callable[[T], dict[str, Any]], refresh: bool = False) -> T:
    """The calibration stored under ``key`` (``parse`` of its entry; None: unusable), else
    ``measure()`` stored as ``entry`` of it; kept for the process. ``refresh``, or
    ``AUTOSHARD_RECALIBRATE=1`` for the first call of a process, measures again. Every
    calibration of this machine shares the one file."""
    if not isinstance(refresh, bool):  # a truthy 'no' would measure again and replace the cached numbers
        raise InvalidArgumentTypeError(f"refresh must be True or False, got {refresh!r}")
    if not refresh and key in _THIS_PROCESS:
        return _THIS_PROCESS[key]
    path = calibration_cache()
    again = refresh or os.environ.get(RECALIBRATE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    found = None if again else parse(_read_calibrations(path).get(key))
    if found is None:
        # One process measures a key at a time: concurrent ones (torchrun's ranks, test workers)
        # would contend for the cores they measure. The next one reads what the first stored, even
        # when told to measure again: that measurement is newer than its call.
        asked = time.time()
        with _locked(path.with_name(f"{path.name}.{hashlib.sha1(key.encode()).hexdigest()[:16]}.lock")):
            stored = _read_calibrations(path).get(key)
            fresh = isinstance(stored, dict) and isinstance(stored.get("measured_at"), (int, float)) and (
                stored["measured_at"] >= asked)
            found = parse(stored) if fresh or not again else None
            if found is None:
                found = measure()
                _write_calibration(path, key, entry(found))
    _THIS_PROCESS[key] = found
    return found


def calibrated_device(refresh: bool = False) -> DeviceModel:
    """This machine's CPU as a ``DeviceModel``: from the cache when this machine key was measured
    before, else measured and cached (``cached_calibration``)."""
    return cached_calibration(machine_key(), measure_device, _cached_device,
                              lambda d: {"peak_flops": d.peak_flops, "bandwidth": d.bandwidth}, refresh)


def device_model(peak_tflops: float | None = None, bandwidth_gbs: float | None = None) -> DeviceModel:
    """The user's peaks (TFLOP/s, GB/s) where given; this machine's calibrated ones for the rest."""
    if peak_tflops is not None and bandwidth_gbs is not None:
        return DeviceModel(peak_tflops * 1e12, bandwidth_gbs * 1e9)
    here = calibrated_device()
    return DeviceModel(here.peak_flops if peak_tflops is None else peak_tflops * 1e12,
                       here.bandwidth if bandwidth_gbs is None else bandwidth_gbs * 1e9,
                       calibrated=peak_tflops is None and bandwidth_gbs is None)


def bytes_moved(dag: nx.DiGraph, node: str) -> float:
    """Bytes ``node`` reads (values it receives, weights it uses) and allocates for its output."""
    data = dag.nodes[node]
    if data.get("input") or (not data.get("flops") and not data.get("allocated")):
        return 0.0
    received = sum(float(dag.nodes[p]["bytes"]) for p in dag.predecessors(node))
    infos = dag.graph.get("weights")
    weights = sum(infos[w].nbytes for w in data.get("weights", ())) if infos else float(data.get("param_bytes", 0))
    return received + float(weights) + float(data.get("allocated") or 0)


def _require_sizes(dag: nx.DiGraph) -> None:
    if not measured(dag, "flops"):
        raise InvalidArgumentError(
            "estimating time needs the FLOPs and sizes that 'shape-prop' measures on example inputs; "
            "give example inputs (a factory returning (model, args)), or measure time with cost=time")


def estimated_seconds(dag: nx.DiGraph, device: DeviceModel) -> dict[str, float]:
    """The roofline time of every node of ``dag`` (inputs: 0); needs ``shape-prop``'s FLOPs and sizes."""
    _require_sizes(dag)
    return {node: 0.0 if data.get("input") else device.seconds(float(data["flops"] or 0), bytes_moved(dag, node))
            for node, data in dag.nodes(data=True)}


@dataclass(frozen=True)
class NodeTimes:
    """Seconds per node, the device model they were estimated with (None: measured), and whether
    each is the node's forward and backward together (a ``profile{backward=true}``; an estimate is
    a forward's)."""

    seconds: dict[str, float]
    estimate: DeviceModel | None
    backward: bool = False

    @property
    def measured(self) -> bool:
        return self.estimate is None


def node_times(dag: nx.DiGraph, device: DeviceModel | None = None) -> NodeTimes:
    """Measured seconds when the ``profile`` pass ran, else the roofline estimate under ``device``
    (default: this machine, calibrated)."""
    if measured(dag, "time"):
        return NodeTimes(time_costs(dag), None, any(bool(b) for _, b in dag.nodes(data="timed_backward")))
    _require_sizes(dag)  # before calibrating: no point measuring the machine for nothing
    chosen = device or calibrated_device()
    return NodeTimes(estimated_seconds(dag, chosen), chosen)
