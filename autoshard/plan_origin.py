"""Plans made from a run: from a program that ran up to its split, with the costs worth showing,
and from the ``PlanOrigin`` a ``ShardedModel`` keeps, so that it can write its own plan file.

A plan file records what the stages alone do not know: the pipeline spec that made the split, its
cost model, the model's class name and the device model of the time column. ``shard_model`` and
``load_plan`` hand the stages a ``PlanOrigin`` with these (``sharded.plan_origin``), and
``ShardedModel.save_plan`` hands itself to it: ``autoshard.sharded`` sits below this module, so
the file format reaches the stages this way rather than by an import from below. Everything else
is read from the stages' ``StagePlan`` when the file is written, with the functions the CLI uses,
so ``sharded.save_plan(path)`` writes the file ``autoshard split TARGET --stages K --out`` writes.

The costs come from the passes' cost models, so this module sits in the api layer, above them;
the file format itself (``autoshard.plan_format``) sits below the passes, which read plan files.
The passes are imported where they are used: ``autoshard.plan_io``, which the reports import to
read plan files, imports this module and does not load them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import networkx as nx

from autoshard.capture.result import WrappedLeaf
from autoshard.costs.estimate import DeviceModel, node_times
from autoshard.costs.memory_model import MemoryModel
from autoshard.errors import AutoshardError, InvalidArgumentError
from autoshard.graph import Partition
from autoshard.plan_format.files import save_plan
from autoshard.plan_format.model import PlanNode, SavedPlan, SplitRecord, assignment_digest, optional_float, versions
from autoshard.sharded import ShardedModel

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.passes.base import PassContext, ShardProgram
    from autoshard.passes.pipeline import Pipeline


def _value_of(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The node's measured value structure as plain JSON data, when ``shape-prop`` ran."""
    meta = data.get("value_meta")
    return meta.to_dict() if hasattr(meta, "to_dict") else None


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
    measured or not shown); one note per cost that could not be computed, saying why; and whether
    the measured ``time`` is each node's forward and backward (``NodeTimes.backward``)."""

    costs: dict[str, dict[str, float]]
    time_estimate: DeviceModel | None
    notes: tuple[str, ...]
    time_backward: bool = False


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
    estimate, backward = None, False
    try:
        times = node_times(program.dag, device)
        costs["time"], estimate, backward = times.seconds, times.estimate, times.backward
    except AutoshardError as exc:
        notes.append(f"time: not shown ({exc})")
    return ReportedCosts(costs, estimate, tuple(notes), backward)


def split_record(partition: Partition) -> SplitRecord | None:
    """What the splitter said about ``partition`` (None when it came from elsewhere, e.g. a plan file)."""
    if partition.info is None:
        return None
    digest = assignment_digest((str(name), stage) for name, stage in partition.assignment.items())
    return SplitRecord(partition.info, digest)


def plan_from_program(
    program: "ShardProgram", pipeline: str, cost_model: str, costs: Mapping[str, Mapping[str, float]],
    *, time_estimate: DeviceModel | None = None, time_backward: bool = False, split: SplitRecord | None = None,
    memory_model: MemoryModel = MemoryModel(),
) -> SavedPlan:
    """The plan of a program that has a DAG and a partition.

    ``costs`` maps each cost model to report (the split's ``cost_model`` among them) to its
    per-node costs; ``pipeline`` is the spec that made the split. ``time_estimate`` is the device
    model ``costs["time"]`` was estimated with (None: measured), ``time_backward`` whether the
    measured times include each node's backward. ``split`` describes how the split
    was made; by default the splitter's own record on the partition (a split rebuilt from a plan
    file passes that file's record on). ``memory_model`` is the one ``costs["memory"]`` was
    computed with.
    """
    if program.dag is None or program.partition is None:
        raise InvalidArgumentError("a plan needs a program with a DAG and a partition: run up to the split")
    return plan_of_split(
        program.dag, program.partition, program.traced.wrapped if program.traced is not None else (),
        type(program.model).__qualname__, pipeline, cost_model, costs, time_estimate=time_estimate,
        time_backward=time_backward, split=split, memory_model=memory_model)


def plan_of_split(
    dag: nx.DiGraph, partition: Partition, wrapped: Sequence[WrappedLeaf], model: str, pipeline: str,
    cost_model: str, costs: Mapping[str, Mapping[str, float]], *, time_estimate: DeviceModel | None = None,
    time_backward: bool = False, split: SplitRecord | None = None, memory_model: MemoryModel = MemoryModel(),
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
            training=data.get("training"), readers=tuple(map(str, data.get("readers") or ())),
        ))
    return SavedPlan(
        num_stages=partition.num_stages, cost_model=cost_model, pipeline=pipeline,
        model=model, versions=versions(), nodes=tuple(nodes),
        edges=tuple((str(u), str(v)) for u, v in dag.edges), wrapped=tuple(wrapped),
        weights=dict(dag.graph.get("weights", {})), time_estimate=time_estimate, time_backward=time_backward,
        split=split or split_record(partition), memory_model=memory_model,
    )


@dataclass(frozen=True)
class PlanOrigin:
    """What a plan file of these stages records beyond their ``StagePlan``.

    ``costs`` holds the per-node costs of cost models that exist only for the run that made the
    stages (a user's ``cost(node)`` function, a file's cost model not registered here); the others
    are computed again from the DAG when the file is written. ``split`` is the split record of
    the file the stages were rebuilt from (None: the splitter's own, on the stages); ``device`` the
    device model its time column was estimated with (None: this machine's, calibrated).
    """

    pipeline: str
    cost_model: str
    model: str
    costs: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    split: SplitRecord | None = None
    device: DeviceModel | None = None

    @classmethod
    def made(cls, program: "ShardProgram", pipeline: "Pipeline",
             cost_models: Mapping[str, Callable[["ShardProgram"], dict[str, float]]]) -> PlanOrigin:
        """Of the stages ``pipeline`` made from ``program``'s model; ``cost_models`` are the run's own
        (a user's cost function), recorded now: after the run nothing knows them."""
        cost_model = next((getattr(step, "cost", "params") for step in pipeline if "partition" in step.provides),
                          "params")
        return cls(str(pipeline), cost_model, type(program.model).__qualname__,
                   {name: model(program) for name, model in cost_models.items()})

    @classmethod
    def rebuilt(cls, saved: SavedPlan, program: "ShardProgram", split: SplitRecord | None) -> PlanOrigin:
        """Of the stages rebuilt from ``saved``, as ``autoshard split --plan`` records them: the file's
        pipeline, cost model and device model, and ``split`` (the file's record, unless the weights
        have other sizes now)."""
        from autoshard.passes.analyses import COST_MODELS  # not at load: see the module's docstring

        costs = {} if saved.cost_model in COST_MODELS else {
            saved.cost_model: {n.name: n.costs[saved.cost_model] for n in saved.nodes}}
        return cls(saved.pipeline, saved.cost_model, type(program.model).__qualname__, costs, split,
                   saved.time_estimate)

    def saved_plan(self, sharded: ShardedModel) -> SavedPlan:
        """The plan of ``sharded``, with the costs the CLI shows (``report_costs``). Cost models read
        the DAG, so the stages stand in for the model in the program they are given."""
        from autoshard.passes.analyses import use_cost_model, use_memory_model  # as in ``rebuilt``
        from autoshard.passes.base import PassContext, ShardProgram

        plan = sharded.plan
        partition = Partition(dict(plan.assignment), plan.num_stages, plan.split_info)
        ctx = PassContext()
        use_memory_model(ctx, plan.memory_model)
        for name, costs in self.costs.items():
            use_cost_model(ctx, name, lambda _program, recorded=costs: dict(recorded))
        reported = report_costs(ShardProgram(model=sharded, dag=plan.dag, partition=partition), ctx,
                                self.cost_model, self.device)
        return plan_of_split(plan.dag, partition, plan.wrapped, self.model, self.pipeline, self.cost_model,
                             reported.costs, time_estimate=reported.time_estimate,
                             time_backward=reported.time_backward, split=self.split, memory_model=plan.memory_model)

    def save(self, sharded: ShardedModel, path: str | os.PathLike[str]) -> Path:
        """Write the plan of ``sharded`` to ``path`` (``ShardedModel.save_plan`` calls this)."""
        return save_plan(self.saved_plan(sharded), path)
