"""Measured time per graph node, and the JSON profile that makes a time-balanced plan repeatable.

Each compute node runs on the real values it receives: a few warm-up runs, then ``repeats``
timed runs, of which the fastest counts: load from elsewhere only ever adds time, so the fastest
run is the closest to the node's own cost (the median of five runs read the same layers 30%
apart between two runs under load; the machine calibration keeps its fastest run too). With ``backward`` each run
also computes the gradients of the node's outputs with respect to its floating-point inputs and
parameters (``torch.autograd.grad``, so no ``.grad`` of the model is touched). Timings vary from
run to run; saving them to a profile and loading it later gives exactly the same costs, hence
exactly the same plan. A profile records what it was measured on, the graph (``graph_signature``)
and the sizes of the example inputs and weights (``measured_sizes``), and is refused for a model
where either differs: a wider copy of the same graph, or a larger batch, would otherwise be
balanced and reported with times that are not its own.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map_only

from autoshard import progress
from autoshard.costs.execution import COMPUTE_OPS, NodeCall, on_threads, placeholder_values, run_graph
from autoshard.costs.values import describe_value
from autoshard.errors import InvalidArgumentError
from autoshard.fx_helpers import target_name

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    from autoshard.inputs import ExampleInputs

PROFILE_FORMAT = "autoshard-time-profile"


@dataclass(frozen=True)
class TimingSettings:
    """How each node is timed."""

    warmup: int = 2
    repeats: int = 5
    backward: bool = False
    threads: int | None = None  # torch's intra-op threads to time on (None: the caller's)

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1 or (self.threads is not None and self.threads < 1):
            raise InvalidArgumentError(
                f"timing needs warmup >= 0, repeats >= 1 and threads >= 1 (or none: the caller's), got "
                f"warmup={self.warmup} repeats={self.repeats} threads={self.threads}")


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else t


def _forward_backward(call: NodeCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = tree_map_only(torch.Tensor, _grad_leaf, (args, kwargs))
    with torch.enable_grad():
        out = call.run(args, kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if call.node.op == "call_module":
            leaves += [p for p in call.interpreter.fetch_attr(call.node.target).parameters() if p.requires_grad]
        if outputs and leaves:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)
    return out


def _fastest_seconds(call: NodeCall, settings: TimingSettings) -> float:
    """Each run takes fresh copies of the node's tensor inputs, made before its clock starts: a
    node that writes to its inputs in place (T5's ``relative_buckets += ...``) would otherwise
    drift them run after run (out-of-range indices) and hand the rest of the graph the drift."""
    def seconds() -> float:
        args, kwargs = tree_map_only(torch.Tensor, torch.Tensor.clone, (call.args, call.kwargs))
        start = time.perf_counter()
        _forward_backward(call, args, kwargs) if settings.backward else call.run(args, kwargs)
        return time.perf_counter() - start

    for _ in range(settings.warmup):
        seconds()
    return min(seconds() for _ in range(settings.repeats))


def measure_node_seconds(
    gm: fx.GraphModule, inputs: "ExampleInputs", settings: TimingSettings = TimingSettings(), seed: int = 0,
) -> dict[str, float]:
    """The fastest seconds of every compute node of ``gm`` on ``inputs``, on ``settings.threads``
    (the caller's are set back after); draws a progress bar on a terminal."""
    compute = sum(1 for n in gm.graph.nodes if n.op in COMPUTE_OPS)
    seconds: dict[str, float] = {}
    with on_threads(settings.threads), progress.task("profiling node times", total=compute) as advance:
        def hook(call: NodeCall) -> Any:
            value = call.run()
            if call.node.op in COMPUTE_OPS:
                seconds[call.node.name] = _fastest_seconds(call, settings)
                advance(1)
            return value

        run_graph(gm, inputs, "real", hook, seed)
    return seconds


def graph_signature(gm: fx.GraphModule) -> str:
    """A digest of the compute nodes' names, kinds and targets: which graph a profile belongs to."""
    # by name: a function's repr holds its address, which differs from one process to the next
    text = "\n".join(f"{n.name} {n.op} {target_name(n)}" for n in gm.graph.nodes if n.op in COMPUTE_OPS)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measured_sizes(gm: fx.GraphModule, inputs: "ExampleInputs") -> dict[str, str]:
    """What the times depend on besides the graph: each example input's and each weight's shape,
    dtype and device type (``input x``: ``float32[4, 16] cpu``), by name."""
    sizes = {}
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), placeholder_values(gm, inputs)):
        devices = sorted({t.device.type for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)})
        sizes[f"input {node.target}"] = f"{describe_value(value)} {','.join(devices)}".rstrip()
    for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        sizes[f"weight {name}"] = f"{describe_value(tensor)} {tensor.device.type}"
    return sizes


@dataclass(frozen=True)
class TimeProfile:
    """Seconds per compute node, the settings they were measured with, the graph's signature and
    the sizes it ran with (``measured_sizes``; None in a profile saved before they were recorded)."""

    seconds: dict[str, float]
    settings: TimingSettings
    graph: str
    torch_version: str = torch.__version__
    sizes: dict[str, str] | None = None

    def save(self, path: str | Path) -> None:
        data = {"format": PROFILE_FORMAT, "version": 1, "graph": self.graph, "torch": self.torch_version,
                "settings": asdict(self.settings), "seconds": self.seconds}
        if self.sizes is not None:
            data["sizes"] = self.sizes
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> "TimeProfile":
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != PROFILE_FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {PROFILE_FORMAT!r}")
            seconds = {str(k): float(v) for k, v in data["seconds"].items()}
            sizes = data.get("sizes")
            sizes = None if sizes is None else {str(k): str(v) for k, v in sizes.items()}
            return cls(seconds, TimingSettings(**data["settings"]), str(data["graph"]), str(data.get("torch", "")),
                       sizes)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"cannot read the time profile {str(path)!r}: {exc}") from None

    def check_matches(self, gm: fx.GraphModule, path: str | Path, inputs: "ExampleInputs | None" = None) -> None:
        """Refuse a profile measured on another graph, naming the nodes that differ, or (given the
        example ``inputs``) with other input or weight sizes, naming the first that differ."""
        names = {n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS}
        if self.graph != graph_signature(gm) or self.seconds.keys() != names:
            missing = sorted(names - self.seconds.keys())[:5]
            extra = sorted(self.seconds.keys() - names)[:5]
            raise InvalidArgumentError(
                f"the time profile {str(path)!r} was measured on another graph (graph {self.graph}, this one "
                f"{graph_signature(gm)}; missing nodes {missing}, unknown nodes {extra}); delete it to measure again")
        if self.sizes is None or inputs is None:
            return  # a profile saved before sizes were recorded: nothing to compare
        here = measured_sizes(gm, inputs)
        differ = [f"{key}: {self.sizes.get(key, 'absent')} there, {here.get(key, 'absent')} here"
                  for key in dict.fromkeys([*self.sizes, *here]) if self.sizes.get(key) != here.get(key)]
        if differ:
            raise InvalidArgumentError(
                f"the time profile {str(path)!r} was measured on other sizes than this model and its example "
                f"inputs ({'; '.join(differ[:3])}{'; ...' if len(differ) > 3 else ''}), so its times are not this "
                "model's; delete it to measure again")
