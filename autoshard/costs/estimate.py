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
the planning machine (a matrix product for FLOP/s, a copy for bytes/s), run once per process.
Measured times, when the DAG has them, always win (``node_times``).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import networkx as nx

from autoshard.costs.models import measured, time_costs
from autoshard.errors import InvalidArgumentError

CALIBRATION_MATMUL = 512
"""Side of the square float32 matrices multiplied to measure FLOP/s (2 x 512^3 = 268 MFLOP)."""

CALIBRATION_COPY_BYTES = 32 * 1024 * 1024
"""Bytes copied to measure memory bandwidth: larger than the caches, small enough to be quick."""

CALIBRATION_REPEATS = 5


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
        return f"{self.peak_flops / 1e9:.4g} GFLOP/s, {self.bandwidth / 1e9:.4g} GB/s ({source})"

    def to_dict(self) -> dict[str, Any]:
        return {"model": "roofline", "peak_flops": self.peak_flops, "bandwidth": self.bandwidth,
                "calibrated": self.calibrated}


def _two_digits(x: float) -> float:
    """Round to two significant digits: calibration jitters by more than that from run to run."""
    return round(x, -int(math.floor(math.log10(x))) + 1)


def _best_seconds(step: Callable[[], Any]) -> float:
    """The fastest of a few runs after one warm-up: the machine's peak, not its noise."""
    step()
    best = math.inf
    for _ in range(CALIBRATION_REPEATS):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


@functools.cache
def calibrated_device() -> DeviceModel:
    """This machine's CPU as a ``DeviceModel``, measured once per process (well under a second)."""
    import torch

    with torch.no_grad():
        n = CALIBRATION_MATMUL
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        flops = 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out))
        source = torch.empty(CALIBRATION_COPY_BYTES // 4)
        target = torch.empty_like(source)
        bandwidth = 2 * CALIBRATION_COPY_BYTES / _best_seconds(lambda: target.copy_(source))  # read + write
    return DeviceModel(_two_digits(flops), _two_digits(bandwidth), calibrated=True)


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
    """Seconds per node, and the device model they were estimated with (None: measured)."""

    seconds: dict[str, float]
    estimate: DeviceModel | None

    @property
    def measured(self) -> bool:
        return self.estimate is None


def node_times(dag: nx.DiGraph, device: DeviceModel | None = None) -> NodeTimes:
    """Measured seconds when the ``profile`` pass ran, else the roofline estimate under ``device``
    (default: this machine, calibrated)."""
    if measured(dag, "time"):
        return NodeTimes(time_costs(dag), None)
    _require_sizes(dag)  # before calibrating: no point measuring the machine for nothing
    chosen = device or calibrated_device()
    return NodeTimes(estimated_seconds(dag, chosen), chosen)
