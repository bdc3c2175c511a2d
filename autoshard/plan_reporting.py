"""The plan report: per stage, its cost under each cost model, its time (measured, or estimated
under a device model), its training memory, the weights it holds, and the values it receives and
sends with their shape, dtype and bytes; plus the shared (tied) weights, the stages that must
synchronise their gradients, what the splitter said about its split, and the predicted time of
one pipeline training step (``autoshard.costs.step_time``).

Plain frozen data with ``to_dict()`` (JSON-ready) that shows itself as the CLI's tables:
``print(report)``, ``rich.print(report)`` and a notebook render what ``autoshard split`` prints,
with the same code (``autoshard.report.plan_renderables``)::

    report = plan_report(sharded)
    print(report)
    report.stages[1].costs["flops"], report.stages[1].values_in[0].meta.shape
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from typing import Any, Mapping

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.text import Text

from autoshard.arguments import real_number
from autoshard.capture.result import WrappedLeaf
from autoshard.costs.estimate import DeviceModel, NodeTimes, node_times
from autoshard.costs.memory import StageMemory, stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.models import DAG_COST_MODELS, measured, summed_per_stage
from autoshard.costs.step_time import StepTime, StepTimeModel, checked_step, predicted_step, run_of
from autoshard.costs.ties import SharedWeight
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, first_few, plural, shown
from autoshard.graph import SplitInfo
from autoshard.graph.partition import also_run
from autoshard.plan_io import PlanNode, SavedPlan
from autoshard.report import PIPED_WIDTH, plan_renderables, served_line
from autoshard.sharded import BoundaryValue, ShardedModel, StagePlan


@dataclass(frozen=True)
class StageReport:
    """One stage of a plan."""

    index: int
    modules: tuple[str, ...]
    nodes: int
    weights: tuple[str, ...]
    param_count: int
    param_bytes: int
    costs: Mapping[str, float]
    values_in: tuple[BoundaryValue, ...]
    values_out: tuple[BoundaryValue, ...]
    memory: StageMemory | None
    seconds: float | None
    """Measured or estimated (see ``PlanReport.time_estimate``); None without FLOPs or a profile."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "modules": list(self.modules), "nodes": self.nodes, "weights": list(self.weights),
            "param_count": self.param_count, "param_bytes": self.param_bytes, "costs": dict(self.costs),
            "seconds": self.seconds,
            "values_in": [v.to_dict() for v in self.values_in], "values_out": [v.to_dict() for v in self.values_out],
            "memory": None if self.memory is None else {  # every part the total is made of, as the tables add them
                **{k: v for k, v in dataclasses.asdict(self.memory).items() if k != "stage"},
                "optimizer_bytes": self.memory.optimizer_bytes, "total": self.memory.total},
        }


#: What a report of stages that record no origin shows instead of the tables.
NO_TABLES = ("no tables: these stages record no pipeline spec or split cost model (they were made by running a "
             "pipeline directly, or a StagePlan was given); make them with autoshard.shard_model or "
             "autoshard.load_plan to see the tables; the report's data (.stages, .to_dict()) is all there")


@dataclass(frozen=True, repr=False)
class PlanReport:
    """Every stage's report, the shared weights, the cost models shown, the wrapped leaves, what the
    splitter said about its split (None if it came from elsewhere) and the device model the stage
    times were estimated with (None: measured, or no times). ``plan`` is the plan as the CLI shows
    (and ``--out`` saves) it, which ``print`` renders; None for stages that record no origin.

    ``repr`` is one line (the tables are ``str``, the data ``to_dict()``), so a list of reports or
    a debugger stays readable."""

    stages: tuple[StageReport, ...]
    shared_weights: tuple[SharedWeight, ...]
    cost_models: tuple[str, ...]
    wrapped: tuple[WrappedLeaf, ...]
    split: SplitInfo | None = None
    time_estimate: DeviceModel | None = None
    plan: SavedPlan | None = None
    step_time: StepTime | None = None
    """One training step's predicted time; None when the stages have no times, or when the memory
    model's schedule (the default step) is one PyTorch refuses for these stages: the tables say why."""
    inputs: str | None = None
    """What a call must pass to be served by these stages (``ShardedModel.served_inputs``); None for a
    plan alone or stages that check nothing."""

    def renderables(self) -> list[RenderableType]:
        """The CLI's tables and lines for this plan (``autoshard.report.plan_renderables``)."""
        if self.plan is None:
            return [Text(NO_TABLES)]
        title = f"{self.plan.model}: {plural(self.plan.num_stages, 'stage')} ({self.plan.pipeline})"
        shown = plan_renderables(self.plan, title, step=self.step_time.model if self.step_time else None)
        return shown + ([Text(served_line(self.inputs))] if self.inputs else [])

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.renderables()

    def _rendered(self, console: Console) -> Console:
        for renderable in self.renderables():
            console.print(renderable)
        return console

    def __str__(self) -> str:
        """The tables as plain text, as ``autoshard split`` writes them to a pipe."""
        out = io.StringIO()
        self._rendered(Console(file=out, width=PIPED_WIDTH, color_system=None, highlight=False))
        return out.getvalue().rstrip("\n")

    def _repr_html_(self) -> str:
        """The tables in a notebook, with the CLI's styles."""
        console = Console(file=io.StringIO(), record=True, width=PIPED_WIDTH, highlight=False)
        return self._rendered(console).export_html(inline_styles=True)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython's text display: the tables, not the one-line repr."""
        printer.text(str(self))

    def __repr__(self) -> str:
        return (f"<PlanReport: {plural(len(self.stages), 'stage')}, cost models {', '.join(self.cost_models)}; "
                "print() it for the tables, .to_dict() for the data>")

    @property
    def gradient_sync(self) -> tuple[SharedWeight, ...]:
        """Shared trainable parameters whose stages must sum their gradients."""
        return tuple(w for w in self.shared_weights if w.needs_gradient_sync)

    def bottleneck(self, cost: str) -> float:
        """The costliest stage under ``cost``."""
        return max(stage.costs[cost] for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cost_models": list(self.cost_models),
            "stages": [s.to_dict() for s in self.stages],
            "shared_weights": [w.to_dict() for w in self.shared_weights],
            "wrapped": [{"kind": w.kind, "name": w.name, "reason": w.reason} for w in self.wrapped],
            "split": None if self.split is None else dataclasses.asdict(self.split),
            "time_estimate": None if self.time_estimate is None else self.time_estimate.to_dict(),
            "step_time": None if self.step_time is None else self.step_time.to_dict(),
            "inputs": self.inputs,
        }


def _times(plan: StagePlan, device: DeviceModel | None) -> NodeTimes | None:
    """Measured times when profiled, else estimated when FLOPs were measured, else none."""
    return node_times(plan.dag, device) if measured(plan.dag, "time") or measured(plan.dag, "flops") else None


def plan_report(
    sharded: ShardedModel | StagePlan,
    extra_costs: Mapping[str, Mapping[str, float]] | None = None,
    memory: MemoryModel | None = None,
    device: DeviceModel | None = None,
    step: StepTimeModel | None = None,
) -> PlanReport:
    """Describe a plan under every cost model its DAG has measurements for.

    ``extra_costs`` adds columns from per-node costs computed elsewhere (a user's cost function,
    ``node_costs(program, ctx, name)``); they are summed per stage. Stage times are the profile's
    when the plan was made with ``cost=time`` or a time profile, else estimated under ``device``
    (default: this machine, calibrated; see ``autoshard.costs.estimate``). Training memory is
    modelled with ``memory``, by default the model the plan was made for (``shard_model``'s
    ``memory_model``). One training step's time is predicted from the stage times under ``step``
    (default: the memory model's schedule, microbatches and stages per rank, and
    ``StepTimeModel``'s link); a ``step`` PyTorch's schedule refuses for these stages is refused
    (``StepTimeModel.refusal``), the default one is left out. Whether measured times include the
    backward is the profile's own record, carried on the DAG (``NodeTimes.backward``), so a plan
    and its ``ShardedModel`` predict the same step.
    """
    _check_report_arguments(sharded, extra_costs, memory, device, step)
    plan = sharded.plan if isinstance(sharded, ShardedModel) else sharded
    extra_costs = _extra_columns(plan, extra_costs or {})
    memory = memory or plan.memory_model
    k = plan.num_stages
    models = plan.cost_models()
    per_model = {name: plan.stage_costs(name, memory) for name in models}
    per_model.update({name: plan.stage_costs(costs) for name, costs in extra_costs.items()})
    memories = stage_memory(plan.dag, plan.assignment, k, memory) if "memory" in models else None
    times = _times(plan, device)
    seconds = None  # counted where each stage runs it: a mask made again in every stage reading it costs each
    if times is not None:
        seconds = summed_per_stage(times.seconds, plan.assignment, k, also_run(plan.dag, plan.assignment))
    infos = plan.dag.graph.get("weights", {})
    stages = []
    for j in range(k):
        held = plan.weights(j)
        stages.append(StageReport(
            index=j,
            modules=tuple(plan.modules(j)),
            nodes=len(plan.stage_nodes(j)),
            weights=held,
            param_count=sum(infos[w].numel for w in held if w in infos),
            param_bytes=plan.param_bytes(j),
            costs={name: totals[j] for name, totals in per_model.items()},
            values_in=plan.boundary_values(j - 1) if j > 0 else (),
            values_out=plan.boundary_values(j) if j < k - 1 else (),
            memory=memories[j] if memories is not None else None,
            seconds=seconds[j] if seconds is not None else None,
        ))
    model = step or run_of(memory)
    predicted = None
    if times is not None and seconds is not None and (step is not None or model.refusal(k) is None):
        predicted = predicted_step(seconds, plan.boundary_bytes(), model, times.estimate, times.backward)
    return PlanReport(tuple(stages), plan.shared_weights, tuple(per_model), plan.wrapped, plan.split_info,
                      times.estimate if times is not None else None, _shown_plan(sharded, extra_costs, memory, device),
                      predicted, sharded.served_inputs() if isinstance(sharded, ShardedModel) else None)


def _check_report_arguments(sharded: Any, extra_costs: Any, memory: Any, device: Any, step: Any) -> None:
    """A wrong type named with what to pass, before it fails deep in the report (``step="gpipe"`` was
    an ``AttributeError`` on ``backward_ratio``)."""
    if isinstance(sharded, SavedPlan):
        raise InvalidArgumentTypeError(
            "plan_report takes a ShardedModel (shard_model's result) or its plan, got a SavedPlan (read_plan's), "
            "which holds no stages: report the stages it makes, plan_report(autoshard.load_plan(path, model, "
            "example_inputs)), or show the file: autoshard inspect PATH")
    if not isinstance(sharded, (ShardedModel, StagePlan)):
        raise InvalidArgumentTypeError(f"plan_report takes a ShardedModel (shard_model's result) or its plan, got "
                                       f"{type(sharded).__name__}")
    if extra_costs is not None and not isinstance(extra_costs, Mapping):
        raise InvalidArgumentTypeError(f"extra_costs must map a column name to per-node costs, got "
                                       f"{type(extra_costs).__name__}")
    for name, value, kind in (("memory", memory, MemoryModel), ("device", device, DeviceModel)):
        if value is not None and not isinstance(value, kind):
            raise InvalidArgumentTypeError(f"{name} must be a {kind.__name__}, got {shown(value)}")
    if step is not None:
        checked_step(step)


def _extra_columns(plan: StagePlan, extra_costs: Mapping[Any, Any]) -> dict[str, dict[str, float]]:
    """``extra_costs`` checked against ``plan``: each a column of a name of its own (a built-in one's
    numbers would be replaced), with a finite cost >= 0 for every node of the DAG and no other."""
    nodes = set(plan.dag.nodes)
    columns: dict[str, dict[str, float]] = {}
    for name, costs in extra_costs.items():
        if not isinstance(name, str) or not name or name in DAG_COST_MODELS:
            raise InvalidArgumentError(f"extra_costs names a column {name!r}; name it otherwise than the built-in "
                                       f"columns ({', '.join(DAG_COST_MODELS)})")
        if not isinstance(costs, Mapping):
            raise InvalidArgumentTypeError(f"extra_costs[{name!r}] must map each node's name to its cost, got "
                                           f"{shown(costs)}")
        missing = [repr(n) for n in sorted(nodes - costs.keys(), key=str)]
        unknown = [repr(n) for n in sorted(costs.keys() - nodes, key=str)]
        if missing or unknown:
            raise InvalidArgumentError(
                f"extra_costs[{name!r}] must give a cost for each node of the plan's DAG and no other"
                + (f"; it leaves out {first_few(missing)}" if missing else "")
                + (f"; the DAG has no {first_few(unknown)}" if unknown else "")
                + " (node_costs(program, ctx, name) gives one for each)")
        column = {node: real_number(cost) for node, cost in costs.items()}
        bad = [node for node, cost in column.items() if cost is None or not math.isfinite(cost) or cost < 0]
        if bad:
            raise InvalidArgumentError(f"extra_costs[{name!r}][{bad[0]!r}] is {shown(costs[bad[0]])}; each cost must "
                                       "be a finite number >= 0")
        columns[name] = column
    return columns


def _shown_plan(
    sharded: ShardedModel | StagePlan, extra_costs: Mapping[str, Mapping[str, float]],
    memory: MemoryModel | None, device: DeviceModel | None,
) -> SavedPlan | None:
    """The plan file the stages write (``sharded.save_plan``), under the report's device and memory
    models and with its extra cost columns, so the tables show what the report's data says."""
    origin = getattr(sharded, "plan_origin", None)
    if origin is None:
        return None
    shown = dataclasses.replace(origin, device=device or origin.device).saved_plan(sharded)
    return dataclasses.replace(
        shown, memory_model=memory or shown.memory_model,
        nodes=tuple(_with_costs(node, extra_costs) for node in shown.nodes))


def _with_costs(node: PlanNode, extra: Mapping[str, Mapping[str, float]]) -> PlanNode:
    return dataclasses.replace(node, costs={**node.costs, **{name: float(c[node.name]) for name, c in extra.items()}})
