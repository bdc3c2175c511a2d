"""A plan from a program that ran up to its split, with the costs worth showing."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import networkx as nx

from autoshard.capture.result import WrappedLeaf
from autoshard.costs.estimate import DeviceModel, node_times
from autoshard.costs.memory import MemoryModel
from autoshard.errors import AutoshardError, InvalidArgumentError
from autoshard.graph import Partition
from autoshard.plan_io.model import PlanNode, SavedPlan, SplitRecord, assignment_digest, optional_float

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.passes.base import PassContext, ShardProgram


def _value_of(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The node's measured value structure as plain JSON data, when ``shape-prop`` ran."""
    meta = data.get("value_meta")
    return meta.to_dict() if hasattr(meta, "to_dict") else None


def versions() -> dict[str, str]:
    """The library versions a plan is made with; a graph mismatch on load reports them."""
    import torch

    import autoshard

    return {"autoshard": autoshard.__version__, "torch": torch.__version__, "python": platform.python_version()}


REPORTED_COSTS = ("params", "flops")
"""Cost models shown beside the split's own when they are registered and their inputs measured.

``activations`` is always shown from the nodes' sizes; ``time`` is measured when the pipeline
profiled (``cost=time`` or a time profile) and estimated from FLOPs and bytes otherwise
(``autoshard.costs.estimate``); training memory is not a sum over nodes, so the plan computes it
per stage from the nodes' weights and allocations.
"""


@dataclass(frozen=True)
class ReportedCosts:
    """Per cost model, per node costs for a plan; the device model ``time`` was estimated with (None:
    measured or not shown); and one note per cost that could not be computed, saying why."""

    costs: dict[str, dict[str, float]]
    time_estimate: DeviceModel | None
    notes: tuple[str, ...]


def report_costs(
    program: "ShardProgram", ctx: "PassContext", cost_model: str, device: DeviceModel | None = None,
) -> ReportedCosts:
    """Per-node costs under the split's model, each of ``REPORTED_COSTS`` and ``time``.

    ``time`` is the profile's when the DAG was profiled, else a roofline estimate under ``device``
    (default: this machine, calibrated once per process).
    """
    from autoshard.passes.analyses import COST_MODELS, node_costs

    costs = {cost_model: node_costs(program, ctx, cost_model)}
    notes = []
    for name in REPORTED_COSTS:
        if name in costs or name not in COST_MODELS:
            continue
        try:
            costs[name] = node_costs(program, ctx, name)
        except Exception as exc:  # noqa: BLE001 - a column we cannot fill is reported, not fatal
            notes.append(f"{name}: not shown ({type(exc).__name__}: {exc})")
    estimate = None
    try:
        times = node_times(program.dag, device)
        costs["time"], estimate = times.seconds, times.estimate
    except AutoshardError as exc:
        notes.append(f"time: not shown ({exc})")
    return ReportedCosts(costs, estimate, tuple(notes))


def split_record(partition: Partition) -> SplitRecord | None:
    """What the splitter said about ``partition`` (None when it came from elsewhere, e.g. a plan file)."""
    if partition.info is None:
        return None
    digest = assignment_digest((str(name), stage) for name, stage in partition.assignment.items())
    return SplitRecord(partition.info, digest)


def plan_from_program(
    program: "ShardProgram", pipeline: str, cost_model: str, costs: Mapping[str, Mapping[str, float]],
    *, time_estimate: DeviceModel | None = None, split: SplitRecord | None = None,
    memory_model: MemoryModel = MemoryModel(),
) -> SavedPlan:
    """The plan of a program that has a DAG and a partition.

    ``costs`` maps each cost model to report (the split's ``cost_model`` among them) to its
    per-node costs; ``pipeline`` is the spec that made the split. ``time_estimate`` is the device
    model ``costs["time"]`` was estimated with (None: measured). ``split`` describes how the split
    was made; by default the splitter's own record on the partition (a split rebuilt from a plan
    file passes that file's record on). ``memory_model`` is the one ``costs["memory"]`` was
    computed with.
    """
    if program.dag is None or program.partition is None:
        raise InvalidArgumentError("a plan needs a program with a DAG and a partition: run up to the split")
    return plan_of_split(
        program.dag, program.partition, program.traced.wrapped if program.traced is not None else (),
        type(program.model).__qualname__, pipeline, cost_model, costs, time_estimate=time_estimate, split=split,
        memory_model=memory_model)


def plan_of_split(
    dag: nx.DiGraph, partition: Partition, wrapped: Sequence[WrappedLeaf], model: str, pipeline: str,
    cost_model: str, costs: Mapping[str, Mapping[str, float]], *, time_estimate: DeviceModel | None = None,
    split: SplitRecord | None = None, memory_model: MemoryModel = MemoryModel(),
) -> SavedPlan:
    """``plan_from_program`` from the parts a plan is made of, which a ``ShardedModel`` keeps too
    (``model`` is the model's class name, ``wrapped`` the code its capture kept whole)."""
    if cost_model not in costs:
        raise InvalidArgumentError(f"the costs given do not include the split's cost model {cost_model!r}")
    nodes = []
    for name in partition.assignment:
        data = dag.nodes[name]
        nodes.append(PlanNode(
            name=str(name), stage=partition.assignment[name], op=str(data.get("op", "")),
            target=str(data.get("target", "")), module=str(data.get("module", "")),
            costs={m: float(c[name]) for m, c in costs.items()}, bytes=float(data["bytes"]),
            param_bytes=float(data.get("param_bytes", 0)), input=bool(data.get("input")),
            output=bool(data.get("output")), value=_value_of(data),
            weights=tuple(data.get("weights", ())), allocated=optional_float(data.get("allocated")),
            training=data.get("training"),
        ))
    return SavedPlan(
        num_stages=partition.num_stages, cost_model=cost_model, pipeline=pipeline,
        model=model, versions=versions(), nodes=tuple(nodes),
        edges=tuple((str(u), str(v)) for u, v in dag.edges), wrapped=tuple(wrapped),
        weights=dict(dag.graph.get("weights", {})), time_estimate=time_estimate,
        split=split or split_record(partition), memory_model=memory_model,
    )
