"""The plan as data: nodes with their stage, module and costs, and the views derived from them.

The ``stage`` of each node is what a plan *is*; boundaries, stage costs, training memory, shared
weights and the module summary are computed from the nodes with the splitter's and the cost
models' own functions, so they always agree with them. The split record says how the splitter made
the split; its digest of the assignment tells when a person has moved nodes since.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping

import networkx as nx

from autoshard.capture.result import WrappedLeaf
from autoshard.costs.estimate import DeviceModel
from autoshard.costs.memory import SavedFacts, StageMemory, stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.models import held_weight_bytes, summed_per_stage
from autoshard.costs.ties import SharedWeight, shared_weights
from autoshard.graph import SplitInfo, boundary_bytes, boundary_values, stage_costs, total_boundary_bytes
from autoshard.graph.partition import also_run
from autoshard.lowering.from_fx import WeightInfo

FORMAT = "autoshard-plan"
#: 2: a tensor read only for its shape crosses as a zero-byte carrier (``lowering.shape_carriers``) and a
#: value each reader recomputes has no edges of its own: the graphs of version 1 are no longer made.
FORMAT_VERSION = 2


def versions() -> dict[str, str]:
    """The library versions a plan is made with; a graph mismatch on load reports them."""
    import torch

    import autoshard

    return {"autoshard": autoshard.__version__, "torch": torch.__version__, "python": platform.python_version()}


@dataclass(frozen=True)
class PlanNode:
    """One DAG node: where it runs, what it belongs to and what it costs under each cost model."""

    name: str
    stage: int
    op: str
    target: str
    module: str
    costs: Mapping[str, float]
    bytes: float
    param_bytes: float
    input: bool = False
    output: bool = False
    value: Mapping[str, Any] | None = None
    """The output's structure as ``shape-prop`` measured it (``ValueMeta.to_dict()``); None if unknown."""
    weights: tuple[str, ...] = ()
    """Canonical names of the parameters and buffers the node reads (described in ``SavedPlan.weights``)."""
    allocated: float | None = None
    """Bytes of new memory the output holds (0 for a view) as ``shape-prop`` measured; None if unknown."""
    training: SavedFacts | None = None
    """What training keeps of the node (``costs.saved``'s probe); None if unknown."""
    readers: tuple[str, ...] = ()
    """The nodes whose stages compute the node again, a size or a mask (``graph.partition.also_run``)."""


def assignment_digest(stages: Iterable[tuple[str, int]]) -> str:
    """A short fingerprint of ``(node, stage)`` pairs in program order: tells a hand-edited plan from
    the split it was saved from."""
    text = "\n".join(f"{name}={stage}" for name, stage in stages)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class SplitRecord:
    """How the splitter made a plan's split: its ``SplitInfo`` and the digest of the assignment it
    returned, so that later hand edits are noticed."""

    info: SplitInfo
    assignment_digest: str

    @property
    def tolerance(self) -> float | None:
        """The tolerance the split was asked for (None for strategies without a bound)."""
        return self.info.tolerance

    def to_dict(self) -> dict[str, Any]:
        info = self.info
        return {"strategy": info.strategy, "tolerance": info.tolerance,
                "bound": None if info.bound is None else _number(info.bound), "bottleneck": _number(info.bottleneck),
                "boundary_bytes": _number(info.boundary_bytes), "proven_optimal": info.proven_optimal,
                "separated": list(info.separated), "assignment_digest": self.assignment_digest}


def module_ancestors(path: str) -> list[str]:
    """``'a.b.c'`` -> ``['a', 'a.b', 'a.b.c']``; the root module ``''`` has none."""
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass(frozen=True)
class SavedPlan:
    """A split of one model's graph into ``num_stages`` stages, and how it was made."""

    num_stages: int
    cost_model: str
    pipeline: str
    model: str
    versions: Mapping[str, str]
    nodes: tuple[PlanNode, ...]
    edges: tuple[tuple[str, str], ...]
    wrapped: tuple[WrappedLeaf, ...] = ()
    weights: Mapping[str, WeightInfo] = field(default_factory=dict)
    """Every parameter and buffer under its canonical name: size, aliases (tied names), trainable."""
    time_estimate: DeviceModel | None = None
    """The device model the nodes' ``time`` costs were estimated with; None when they were measured."""
    time_backward: bool | None = None
    """Whether the measured ``time`` costs are each node's forward and backward together (the profile
    timed the backward); None in plans written before it was recorded, where the pipeline's
    ``profile`` options say (``autoshard.report.plan_step_time``)."""
    split: SplitRecord | None = None
    """What the splitter said about the split it made; None when the plan was not made by a splitter."""
    memory_model: MemoryModel = MemoryModel()
    """The optimizer and microbatch cap the plan's training memory is modelled with."""

    # -- derived views ----------------------------------------------------------------------
    def assignment(self) -> dict[str, int]:
        return dict(self._assignment)

    @cached_property
    def _assignment(self) -> dict[str, int]:
        return {n.name: n.stage for n in self.nodes}

    @cached_property
    def _graph(self) -> nx.DiGraph:
        return self.graph()

    def cost_models(self) -> list[str]:
        """Cost models every node has a cost under, the split's own first."""
        common = set.intersection(*(set(n.costs) for n in self.nodes)) if self.nodes else set()
        return [self.cost_model] + sorted(common - {self.cost_model})

    def graph(self, cost_model: str | None = None) -> nx.DiGraph:
        """The DAG in the splitter's contract, weighted by ``cost_model`` (default: the split's), with
        the weights each node reads and the memory it allocates, as ``autoshard.costs`` expects; each
        node's op and module scopes (its module's path and the paths above it), by which activation
        checkpointing finds the blocks it recomputes."""
        model = cost_model or self.cost_model
        dag = nx.DiGraph(weights=dict(self.weights))
        for n in self.nodes:
            dag.add_node(n.name, cost=n.costs[model], bytes=n.bytes, input=n.input, output=n.output, op=n.op,
                         weights=n.weights, allocated=n.allocated, training=n.training, readers=n.readers,
                         scopes=[(path, "") for path in module_ancestors(n.module)])
        dag.add_edges_from(self.edges)
        return dag

    def stage_costs(self, cost_model: str | None = None) -> list[float]:
        """Per stage, as the split counted it: ``params`` and ``memory`` count a tied weight once in
        every stage that holds it (and ``memory`` is training memory), the others sum the nodes."""
        name = cost_model or self.cost_model
        memory = self.training_memory() if name == "memory" else None
        if memory is not None:
            return [stage.total for stage in memory]
        if name == "params" and any(n.weights for n in self.nodes):  # the weights table says who holds what
            return held_weight_bytes(self._graph, self._assignment, self.num_stages)
        dag = self._graph if name == self.cost_model else self.graph(name)
        return stage_costs(dag, self._assignment, self.num_stages)

    def bottleneck(self) -> float:
        return max(self.stage_costs())

    def lower_bound(self) -> float:
        """No split can beat ``max(total / k, costliest node)``: the yardstick for the bottleneck."""
        costs = [n.costs[self.cost_model] for n in self.nodes]
        return max(sum(costs) / self.num_stages, max(costs, default=0.0))

    def boundaries(self) -> list[list[str]]:
        """Per boundary j (stage j to j+1), the values crossing it, carried values included."""
        return boundary_values(self._graph, self._assignment, self.num_stages)

    def boundary_bytes(self) -> list[float]:
        return boundary_bytes(self._graph, self._assignment, self.num_stages)

    def total_boundary_bytes(self) -> float:
        return total_boundary_bytes(self._graph, self._assignment, self.num_stages)

    @property
    def time_measured(self) -> bool:
        """Whether the nodes' ``time`` costs were measured (a profile) rather than estimated."""
        return self.time_estimate is None and "time" in self.cost_models()

    def stage_seconds(self) -> list[float] | None:
        """Per stage, its nodes' time (measured or estimated, see ``time_measured``), a node each stage reading
        it computes again (a mask) in each, as ``plan_report`` counts it; None if unknown."""
        if "time" not in self.cost_models():
            return None
        times = self.graph("time")
        return summed_per_stage(dict(times.nodes(data="cost")), self._assignment, self.num_stages,
                                also_run(times, self._assignment))

    def training_memory(self, memory: MemoryModel | None = None) -> list[StageMemory] | None:
        """Per stage, training memory as ``autoshard.costs.memory`` models it (with ``memory``,
        default: the plan's own model); None when the plan lacks the sizes (no ``shape-prop``) or
        the weight table it needs."""
        known = all(n.input or n.allocated is not None for n in self.nodes)
        if not known or any(w not in self.weights for n in self.nodes for w in n.weights):
            return None
        return stage_memory(self._graph, self._assignment, self.num_stages, memory or self.memory_model)

    def memory_unprobed(self) -> tuple[str, ...]:
        """The nodes whose saved activations were not measured (fake tensors could not run them, or
        the plan file predates the facts): ``training_memory`` counts their output bytes instead."""
        return tuple(n.name for n in self.nodes if not n.input and n.training is None)

    def shared_weights(self) -> tuple[SharedWeight, ...]:
        """Weights read by several nodes or tied under several names, with the stages holding them."""
        return shared_weights(self._graph, self._assignment)

    def gradient_sync(self) -> tuple[SharedWeight, ...]:
        """Trainable shared parameters held by several stages: those stages must sum their gradients."""
        return tuple(w for w in self.shared_weights() if w.needs_gradient_sync)

    @property
    def split_is_current(self) -> bool:
        """Whether the nodes are still where the splitter put them (False after a hand edit)."""
        return self.split is not None and self.split.assignment_digest == assignment_digest(
            (n.name, n.stage) for n in self.nodes)

    def module_stage_sets(self) -> dict[str, set[int]]:
        """Every module (and its ancestors) holding a compute node, with the stages it spans."""
        spans: dict[str, set[int]] = {}
        for n in self.nodes:
            if not n.input:
                for path in module_ancestors(n.module):
                    spans.setdefault(path, set()).add(n.stage)
        return spans

    def module_stages(self) -> dict[str, int | list[int]]:
        """Module path -> its stage, or the sorted stages it spans; what ``modules`` in the file says."""
        return {p: min(s) if len(s) == 1 else sorted(s) for p, s in self.module_stage_sets().items()}

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The file's content: the plan, then the derived sections for readers.

        ``split``, ``time_estimate``, ``time_backward`` and ``memory_model`` say how the plan was made;
        ``summary``, ``boundaries`` and ``modules`` are derived from the nodes and ignored when the file is read.
        """
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "versions": dict(self.versions),
            "model": self.model,
            "pipeline": self.pipeline,
            "num_stages": self.num_stages,
            "cost_model": self.cost_model,
        }
        if self.split is not None:
            out["split"] = self.split.to_dict()
        if self.time_estimate is not None:
            out["time_estimate"] = self.time_estimate.to_dict()
        if self.time_backward is not None:
            out["time_backward"] = self.time_backward
        out["memory_model"] = self.memory_model.to_dict()
        out["summary"] = self._summary()
        out["boundaries"] = self.boundaries()
        out["modules"] = self.module_stages()
        out["wrapped"] = [{"kind": w.kind, "name": w.name, "reason": w.reason} for w in self.wrapped]
        if self.weights:
            out["weights"] = {name: _weight_dict(info) for name, info in self.weights.items()}
        out["nodes"] = [_node_dict(n) for n in self.nodes]
        out["edges"] = [list(e) for e in self.edges]
        return out

    def _summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "stage_costs": [_number(c) for c in self.stage_costs()],
            "bottleneck": _number(self.bottleneck()),
            "lower_bound": _number(self.lower_bound()),
            "boundary_bytes": [_number(b) for b in self.boundary_bytes()],
            "total_boundary_bytes": _number(self.total_boundary_bytes()),
        }
        seconds = self.stage_seconds()
        if seconds is not None:
            summary["stage_seconds"] = {"source": "measured" if self.time_measured else "estimated",
                                        "seconds": [_number(s) for s in seconds]}
        memory = self.training_memory()
        if memory is not None:
            rule = f"{self.memory_model.in_flight_rule('stage')} ({self.memory_model.schedule})"
            summary["training_memory"] = {
                "model": {"optimizer_bytes_per_param": (None if self.memory_model.optimizer_bytes_per_param is None
                                                        else _number(self.memory_model.optimizer_bytes_per_param)),
                          "microbatches_in_flight": rule},
                "stages": [{"state_bytes": _number(m.state_bytes), "activation_bytes": _number(m.activation_bytes),
                            "received_bytes": _number(m.received_bytes), "sent_bytes": _number(m.sent_bytes),
                            "backward_bytes": _number(m.backward_bytes), "forward_bytes": _number(m.forward_bytes),
                            "in_flight": m.in_flight,
                            "total": _number(m.total)} for m in memory],
            }
        if self.weights:
            summary["gradient_sync"] = [{"weight": w.name, "aliases": list(w.aliases), "stages": list(w.stages)}
                                        for w in self.gradient_sync()]
        return summary


def _number(x: float) -> int | float:
    """Whole numbers as ints, so the file reads ``4096`` rather than ``4096.0``."""
    return int(x) if float(x).is_integer() else float(x)


def _node_dict(n: PlanNode) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": n.name, "stage": n.stage, "op": n.op, "target": n.target, "module": n.module,
        "costs": {k: _number(v) for k, v in n.costs.items()}, "bytes": _number(n.bytes),
        "param_bytes": _number(n.param_bytes),
    }
    for flag in ("input", "output"):
        if getattr(n, flag):
            out[flag] = True
    if n.weights:
        out["weights"] = list(n.weights)
    if n.readers:
        out["readers"] = list(n.readers)
    if n.allocated is not None:
        out["allocated"] = _number(n.allocated)
    if n.training is not None:
        grads = n.training.input_grads
        out["training"] = {**dataclasses.asdict(n.training), "releases": [list(r) for r in n.training.releases],
                           "input_grads": None if grads is None else [list(g) for g in grads],
                           "strided_grads": list(n.training.strided_grads),
                           "when_contiguous": _when_contiguous(n.training.when_contiguous),
                           "dense_order": None if n.training.dense_order is None else list(n.training.dense_order),
                           "weight_grads": None if n.training.weight_grads is None else list(n.training.weight_grads),
                           "holds": list(n.training.holds), "weights_first": n.training.weights_first,
                           "saves_from": None if n.training.saves_from is None else list(n.training.saves_from),
                           "writes": list(n.training.writes), "passes_on": list(n.training.passes_on),
                           "strided_when_sent": None if n.training.strided_when_sent is None
                           else list(n.training.strided_when_sent),
                           "parts": [list(p) for p in n.training.parts],
                           "part": None if n.training.part is None else list(n.training.part),
                           "backward_when_handed": [[list(order), nbytes]
                                                    for order, nbytes in n.training.backward_when_handed]}
    if n.value:
        out["value"] = dict(n.value)
    return out


def _when_contiguous(facts: tuple[int, int, int, tuple[str, ...]] | None) -> list | None:
    return None if facts is None else [*facts[:3], list(facts[3])]


def _weight_dict(info: WeightInfo) -> dict[str, Any]:
    return {"aliases": list(info.names), "numel": info.numel, "bytes": info.nbytes, "kind": info.kind,
            "trainable": info.trainable, "device": info.device,
            **({"storage": info.storage, "storage_bytes": info.storage_bytes} if info.storage is not None else {})}
