"""Human-readable descriptions of a plan: module ranges, per-stage rows and ``rich`` tables.

Everything here reads a ``SavedPlan``, so a plan just computed and a plan read from a file are
shown the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from autoshard.capture.export import CustomBackward
from autoshard.capture.meta import ModeRegion, RandomDraw
from autoshard.capture.opaque import OpaqueResult
from autoshard.capture.result import WrappedLeaf
from autoshard.capture.state import ScalarStateWrite, StateWrite
from autoshard.costs.memory import StageMemory
from autoshard.costs.split_search.request import per_stage
from autoshard.costs.step_time import StepTime, StepTimeModel, format_seconds, predicted_step, run_of
from autoshard.errors import first_few, plural
from autoshard.passes.spec import parse_spec
from autoshard.plan_io import PlanNode, SavedPlan, module_ancestors
from autoshard.plan_io.rebuild import saved_budgets
from autoshard.sharded import ROOT_LABEL

_LAST_INDEX = re.compile(r"^(?P<head>.*?)(?P<index>\d+)(?P<tail>(?:\.[^.\d][^.]*)*)$")

PART_LABEL = " (part)"
"""Marks a module some of whose operations run in another stage."""

#: Width of tables written to a file, a pipe or a string: rich's default there (80) wraps every column.
PIPED_WIDTH = 160

BYTE_COSTS = frozenset({"params", "activations", "memory"})
"""Cost models measured in bytes; ``flops`` is a count and ``time`` is in seconds."""


def compress_module_ranges(paths: Sequence[str]) -> list[str]:
    """``['layers.0', 'layers.1', 'layers.2', 'head']`` → ``['layers.0-2', 'head']``.

    Consecutive paths that differ only in their last numeric component, by one each, merge.
    """
    out: list[str] = []
    run: tuple[str, int, int, str] | None = None  # head, first, last, tail

    def flush() -> None:
        if run is not None:
            head, first, last, tail = run
            out.append(f"{head}{first}{tail}" if first == last else f"{head}{first}-{last}{tail}")

    for path in paths:
        match = _LAST_INDEX.match(path)
        if match is None:
            flush()
            run = None
            out.append(path)
            continue
        head, index, tail = match["head"], int(match["index"]), match["tail"]
        if run is not None and run[0] == head and run[3] == tail and index == run[2] + 1:
            run = (head, run[1], index, tail)
            continue
        flush()
        run = (head, index, index, tail)
    flush()
    return out


def numbered_lists(spans: Mapping[str, set[int]]) -> set[str]:
    """Modules whose children are all numbered (``ModuleList``, ``Sequential``): listed by child."""
    children: dict[str, list[str]] = {}
    for path in spans:
        parent, _, last = path.rpartition(".")
        children.setdefault(parent, []).append(last)
    return {parent for parent, names in children.items() if all(n.isdigit() for n in names)}


def node_label(node: PlanNode, spans: Mapping[str, set[int]], numbered: set[str]) -> str:
    """The outermost module holding ``node`` that lies wholly in its stage, else its own module, marked.

    A whole numbered list is named by its children (``layers.0``), so ranges read ``layers.0-5``.
    """
    for path in module_ancestors(node.module):
        if spans[path] == {node.stage}:
            if path in numbered and path != node.module:
                return f"{path}.{node.module[len(path) + 1:].split('.')[0]}"
            return path
    return f"{node.module}{PART_LABEL}" if node.module else ROOT_LABEL


def stage_modules(plan: SavedPlan, stage: int) -> list[str]:
    """The modules a stage runs, as coarse as possible and compressed: ``['encoder.layers.0-5', 'norm']``.

    A module whose every node is in this stage is listed whole instead of its children; a module
    spread over several stages shows up in each as ``name (part)``. Operations of the top-level
    forward itself come last as ``(root)``, so they do not break up the ranges.
    """
    spans = plan.module_stage_sets()
    numbered = numbered_lists(spans)
    members = (n for n in plan.nodes if n.stage == stage and not n.input)
    labels = list(dict.fromkeys(node_label(n, spans, numbered) for n in members))
    modules = compress_module_ranges([label for label in labels if label != ROOT_LABEL])
    return modules + [ROOT_LABEL] if ROOT_LABEL in labels else modules


@dataclass(frozen=True)
class StageRow:
    """One stage of a plan, as shown in tables."""

    index: int
    modules: list[str]
    nodes: int
    costs: dict[str, float]
    param_bytes: float
    activation_bytes: float
    values_in: tuple[str, ...]
    values_out: tuple[str, ...]
    bytes_out: float
    seconds: float | None
    """Measured or estimated (``SavedPlan.time_measured``); None when the plan has no times."""
    memory: StageMemory | None
    """Training memory (``autoshard.costs.memory``); None when the plan lacks the sizes."""


def stage_rows(plan: SavedPlan) -> list[StageRow]:
    boundaries = plan.boundaries()
    sent = plan.boundary_bytes()
    costs = {m: plan.stage_costs(m) for m in plan.cost_models()}
    held = plan.stage_costs("params")  # a tied weight once in every stage that holds it
    seconds = plan.stage_seconds()
    memory = plan.training_memory()
    rows = []
    for stage in range(plan.num_stages):
        members = [n for n in plan.nodes if n.stage == stage and not n.input]
        last = stage == plan.num_stages - 1
        rows.append(StageRow(
            index=stage,
            modules=stage_modules(plan, stage),
            nodes=len(members),
            costs={m: c[stage] for m, c in costs.items()},
            param_bytes=held[stage],
            activation_bytes=sum(n.bytes for n in members),
            values_in=tuple(boundaries[stage - 1]) if stage > 0 else (),
            values_out=() if last else tuple(boundaries[stage]),
            bytes_out=0.0 if last else sent[stage],
            seconds=None if seconds is None else seconds[stage],
            memory=None if memory is None else memory[stage],
        ))
    return rows


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------
def _scaled(n: float, base: float, units: Sequence[str]) -> str:
    """``n`` in the largest unit it reaches: the first unit plain, the others to one decimal."""
    for i, unit in enumerate(units):
        if abs(n) < base or i == len(units) - 1:
            return f"{n:.0f}{units[0]}" if i == 0 else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError("unreachable: the last unit always returns")


def human_bytes(n: float) -> str:
    """Binary units, named so (``MiB``): ``--max-memory`` reads ``MB`` as 10^6 bytes, so a budget
    read off a table labelled ``MB`` in 2^20 would have been 5% too small."""
    return _scaled(n, 1024, (" B", "KiB", "MiB", "GiB", "TiB"))


def human_count(n: float) -> str:
    return _scaled(n, 1000, ("", "K", "M", "G", "T"))


def format_cost(model: str, value: float) -> str:
    """A cost in its model's unit: bytes, seconds (``time``) or a plain count."""
    if model in BYTE_COSTS:
        return human_bytes(value)
    if model == "time":
        return format_seconds(value)
    return human_count(value)


def sizes_known(plan: SavedPlan) -> bool:
    """Whether value sizes were measured (shape propagation ran); otherwise every value weighs one."""
    return any(n.value for n in plan.nodes)


def format_size(plan: SavedPlan, value: float) -> str:
    if sizes_known(plan):
        return human_bytes(value)
    return plural(value, "value")


def _plain(text: str) -> Text:
    """User and model text as-is: square brackets in names must not be read as markup."""
    return Text(text)


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
def time_label(plan: SavedPlan) -> str:
    """The time column's heading: says whether the numbers were measured or estimated."""
    if plan.stage_seconds() is None:
        return "time"
    kind = "measured" if plan.time_measured else "est."
    return f"time (split, {kind})" if plan.cost_model == "time" else f"time ({kind})"


def stage_table(plan: SavedPlan, title: str) -> Table:
    """Per stage: modules, node count, cost under each model, time, training memory, activation
    size, and what it sends on. Time and training memory read ``?`` when the plan cannot tell."""
    table = Table(title=_plain(title))
    table.add_column("stage", justify="right")
    table.add_column("modules", overflow="fold")
    table.add_column("nodes", justify="right")
    models = [m for m in plan.cost_models() if m not in ("activations", "time")]
    for m in models:
        table.add_column(f"{m} (split)" if m == plan.cost_model else m, justify="right")
    if "params" not in models:
        table.add_column("params", justify="right")
    table.add_column(time_label(plan), justify="right")
    table.add_column("train mem", justify="right")
    table.add_column("activations (split)" if plan.cost_model == "activations" else "activations", justify="right")
    table.add_column("sends", overflow="fold")
    for row in stage_rows(plan):
        cells = [str(row.index), _plain(", ".join(row.modules)), str(row.nodes)]
        cells += [format_cost(m, row.costs[m]) for m in models]
        if "params" not in models:
            cells.append(human_bytes(row.param_bytes))
        cells.append("?" if row.seconds is None else format_seconds(row.seconds))
        cells.append("?" if row.memory is None else human_bytes(row.memory.total))
        cells.append(format_size(plan, row.activation_bytes))
        if row.index == plan.num_stages - 1:
            cells.append("(model output)")
        else:
            cells.append(_plain(f"{format_size(plan, row.bytes_out)}: {', '.join(row.values_out)}"))
        table.add_row(*cells)
    return table


def summary_lines(plan: SavedPlan) -> list[str]:
    """The bottleneck against its lower bound, and the traffic between stages."""
    costs = plan.stage_costs()
    worst = max(range(plan.num_stages), key=costs.__getitem__)
    bound = plan.lower_bound()
    total = sum(n.costs[plan.cost_model] for n in plan.nodes)
    largest = max((n.costs[plan.cost_model] for n in plan.nodes), default=0.0)
    ratio = f"{costs[worst] / bound:.3f}×" if bound > 0 else "n/a"
    fmt = lambda v: format_cost(plan.cost_model, v)  # noqa: E731 - a local shorthand
    crossing = sum(len(b) for b in plan.boundaries())
    sent = plan.boundary_bytes()
    columns = plan.cost_models()
    idle = [str(j) for j, stage in enumerate(zip(*(plan.stage_costs(m) for m in columns))) if not any(stage)]
    return [
        f"bottleneck ({plan.cost_model}): stage {worst} at {fmt(costs[worst])} = {ratio} the lower bound "
        f"{fmt(bound)} (max of total / {plan.num_stages} = {fmt(total / plan.num_stages)} "
        f"and the largest node = {fmt(largest)})",
        f"boundaries: {plural(crossing, 'value crossing')}, {format_size(plan, plan.total_boundary_bytes())} in total"
        + (f", largest boundary {format_size(plan, max(sent))}" if sent else ""),
    ] + ([f"{'stage' if len(idle) == 1 else 'stages'} {first_few(idle)} "
          f"{'computes' if len(idle) == 1 else 'compute'} nothing the costs count "
          f"({', '.join(columns)}: 0), so a rank running one only passes values on: fewer stages give each one work"]
         if idle else [])


def how_made_lines(plan: SavedPlan) -> list[str]:
    """How the split was made and what the time and memory columns mean."""
    lines = []
    if plan.split is not None:
        info, tolerance = plan.split.info, plan.split.tolerance
        made = f"split: {info.strategy}" + ("" if tolerance is None else f", tolerance {tolerance:g}")
        if info.bound is not None:
            made += f", bound {format_cost(plan.cost_model, info.bound)} per stage"
        if info.proven_optimal is not None:
            made += ", proven optimal" if info.proven_optimal else ", not proven optimal (the solver stopped early)"
        if info.separated:
            made += f"; tied weights it had to place apart: {', '.join(info.separated)}"
        if not plan.split_is_current:
            made += "; then edited by hand: the stages are no longer the splitter's"
        lines.append(made)
    if plan.stage_seconds() is not None:
        if plan.time_measured:
            lines.append("time: measured per node (profile) and summed per stage")
        elif plan.time_estimate is not None:
            lines.append("time (est.): per node max(FLOPs / peak, bytes moved / bandwidth) with "
                         f"{plan.time_estimate.describe()}, summed per stage")
    if plan.training_memory() is not None:
        lines.append(f"train mem: {plan.memory_model.describe()}")
        lines += budget_lines(plan)
        unprobed = plan.memory_unprobed()
        if unprobed:
            lines.append(f"train mem: {plural(len(unprobed), 'node')} not measured ({first_few(unprobed)}: fake "
                         "tensors could not run or size them, nor could a real run) count their output bytes as saved "
                         "and nothing for their backward; check a budget with autoshard.runtime.measure_stage_memory")
    return lines


def budget_lines(plan: SavedPlan, given: Sequence[float] = ()) -> list[str]:
    """The budget beside the train mem column, and the stage fullest against it: whether the plan fits
    was otherwise read off bytes in the pipeline spec (``max-memory=614400.0,...``). ``given`` (one
    per stage) judges the plan against other budgets than the ones it was made under."""
    budgets, memory = per_stage(tuple(given) or saved_budgets(plan), plan.num_stages), plan.training_memory()
    if not budgets or memory is None:
        return []
    fullest = max(range(plan.num_stages), key=lambda j: memory[j].total / budgets[j])
    share = memory[fullest].total / budgets[fullest]
    shown = (f"{human_bytes(budgets[0])} per stage" if len(set(budgets)) == 1
             else ", ".join(human_bytes(b) for b in budgets))
    percent = "under 0.1%" if share < 0.001 else f"{share:.1%}"  # not 0.0% of a device's whole memory
    label = "max memory (given)" if given else "max memory"
    return [f"{label}: {shown}; fullest stage {fullest} at {human_bytes(memory[fullest].total)}, "
            f"{percent} of its budget" + (": over it" if share > 1 else "")]


def plan_step_time(plan: SavedPlan, step: StepTimeModel | None = None) -> StepTime | None:
    """One training step predicted from the plan's stage times under ``step`` (default: the plan's
    memory model's schedule); None when the plan has no times. Whether measured times include the
    backward is the plan's record (``time_backward``), not its pipeline's text: a profile loaded
    from a file times what it timed."""
    seconds = plan.stage_seconds()
    if seconds is None:
        return None
    backward = plan.time_backward if plan.time_backward is not None else _profile_timed_backward(plan.pipeline)
    return predicted_step(seconds, plan.boundary_bytes(), step or run_of(plan.memory_model), plan.time_estimate,
                          backward)


def _profile_timed_backward(pipeline: str) -> bool:
    """For a plan file written before ``time_backward`` was recorded: whether its pipeline's ``profile``
    timed the backward (``profile{backward=true}``), which its times then include."""
    for element in parse_spec(pipeline):
        for option in element.options if element.name == "profile" else ():
            if option.key == "backward":
                return option.values is None or option.values[0].text == "true"
    return False


def plan_step_lines(plan: SavedPlan, step: StepTimeModel | None = None) -> list[str]:
    """``step_time_lines`` of ``plan_step_time``, or why PyTorch's schedule would refuse the step: a
    memory model counts steps PyTorch does not run (1F1B with fewer microbatches than stages, as a
    cap on what is in flight), and the tables of such a plan are still shown."""
    if plan.stage_seconds() is None:
        return []
    refused = (step or run_of(plan.memory_model)).refusal(plan.num_stages)
    if refused is not None:
        return [f"step time: not predicted: {refused}"]
    predicted = plan_step_time(plan, step)
    return step_time_lines(predicted) if predicted is not None else []


def step_time_lines(step: StepTime, label: str = "predicted") -> list[str]:
    """One training step's predicted time, its bubble and bottleneck, and where the stage times came from;
    ``label`` tells two predictions apart (the estimate, and the stages timed)."""
    model = step.model
    links = (f"; links {format_seconds(max(step.links))} per message at most ({model.link_bandwidth / 1e9:.3g} GB/s"
             f" + {format_seconds(model.link_latency)} each)" if any(step.links) else "")
    if any(step.links) and model.message_seconds:
        links += f", and {format_seconds(model.message_seconds)} of each rank's time per message"
    return [f"step time ({label}): {step}{links}", f"step time from: {step.source}"]


def shared_weights_table(plan: SavedPlan) -> Table:
    """Weights read by several nodes or tied under several names, and whether stages must sync them."""
    table = Table(title="shared weights (tied)")
    for column in ("weight", "also known as", "stages", "gradient sync"):
        table.add_column(column, overflow="fold")
    for weight in plan.shared_weights():
        sync = "yes: sum the gradient across these stages" if weight.needs_gradient_sync else "no"
        table.add_row(_plain(weight.name), _plain(", ".join(weight.aliases[1:]) or "-"),
                      ", ".join(map(str, weight.stages)), sync)
    return table


def value_columns(value: Mapping[str, Any] | None) -> tuple[str, str]:
    """(shape, dtype) as shown for a measured value: a tensor's, a constant's text and type, or a summary."""
    if not value:
        return "?", "?"
    kind = value.get("kind")
    if kind == "tensor":
        return str(list(value.get("shape", []))), str(value.get("dtype", "?"))
    if kind == "constant":
        return str(value.get("value", "?")), str(value.get("type", "?"))
    items = value.get("items", [])
    dtypes = sorted({str(i.get("dtype")) for i in items if i.get("kind") == "tensor"})
    return f"{kind} of {len(items)}", ", ".join(dtypes) or "-"


def boundary_table(plan: SavedPlan) -> Table:
    """Every value crossing every boundary, with its shape, dtype and size when known."""
    table = Table(title="values crossing each boundary")
    for column in ("boundary", "value", "shape", "dtype", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left", overflow="fold")
    nodes = {n.name: n for n in plan.nodes}
    for j, names in enumerate(plan.boundaries()):
        for name in names:
            shape, dtype = value_columns(nodes[name].value)
            table.add_row(f"{j} → {j + 1}", _plain(name), _plain(shape), _plain(dtype),
                          format_size(plan, nodes[name].bytes))
    return table


def _wrapped_stages(plan: SavedPlan, kind: str, name: str) -> list[int]:
    if kind == "module":
        hits = [n.stage for n in plan.nodes if n.module == name or n.module.startswith(name + ".")]
    else:
        hits = [n.stage for n in plan.nodes if n.target == name]
    return sorted(set(hits))


BY_DESIGN = "kept whole by design: "
"""How the capture's record begins for code it keeps whole on purpose (a fused inference path)."""

#: The capture's errors for code it keeps whole so that it runs as the model runs it, not because
#: tracing failed: their messages already say in words what the code does.
_RUNS_AS_WRITTEN = tuple(f"{cls.__name__}: " for cls in (
    ModeRegion, RandomDraw, StateWrite, ScalarStateWrite, OpaqueResult, CustomBackward))

PYTORCH_INTERNAL = ("PyTorch's own helper, run as one step as in the model (a trace cannot follow its checks of its "
                    "inputs); nothing to change")


def _without_location(reason: str) -> str:
    """``reason`` without its trailing ``(at file.py:12)``, which the plain words do not need."""
    return re.sub(r" \(at [^()]+:\d+\)$", "", reason)


def kept_whole_why(leaf: WrappedLeaf) -> tuple[bool, str]:
    """``(by design, why in plain words)`` for code the capture kept whole.

    By design: PyTorch's own helpers (``torch.nn.functional._none_or_dtype`` checks that its input
    is a tensor, which a traced value is not), fused paths, and code that changes modes, draws
    random numbers or keeps state, which run as written so the stages do what the model does. The
    rest could not be traced (``if x.sum() > 1000:``): a finer split needs that code rewritten.
    """
    if leaf.reason.startswith(BY_DESIGN):
        return True, leaf.reason[len(BY_DESIGN):]
    if leaf.kind == "function" and leaf.name.startswith("torch."):
        return True, PYTORCH_INTERNAL
    for prefix in _RUNS_AS_WRITTEN:
        if leaf.reason.startswith(prefix):
            return True, _without_location(leaf.reason[len(prefix):])
    if "cannot be used as inputs to control flow" in leaf.reason:
        return False, "a Python branch or loop on a tensor's value, which a graph cannot record"
    return False, "tracing it failed with the error beside"


def wrapped_tables(plan: SavedPlan) -> list[Table]:
    """The modules and functions kept opaque, where they landed and why: those kept whole by design
    (nothing to fix) apart from those that could not be traced (rewrite them for a finer split)."""
    design = Table(title="kept whole by design (each runs as one step, as in the model)")
    failed = Table(title="kept whole: could not be traced through (each runs as one step)")
    for column in ("kind", "name", "stage", "why"):
        design.add_column(column, overflow="fold")
        failed.add_column(column, overflow="fold")
    failed.add_column("error", overflow="fold")
    for leaf in plan.wrapped:
        stages = ", ".join(map(str, _wrapped_stages(plan, leaf.kind, leaf.name))) or "-"
        by_design, why = kept_whole_why(leaf)
        if by_design:
            design.add_row(leaf.kind, _plain(leaf.name), stages, _plain(why))
        else:
            failed.add_row(leaf.kind, _plain(leaf.name), stages, _plain(why), _plain(leaf.reason))
    return [table for table in (design, failed) if table.row_count]


def module_legend(plan: SavedPlan) -> str | None:
    """What ``(part)`` and ``(root)`` in the modules column mean, for those the table shows."""
    shown = {label for stage in range(plan.num_stages) for label in stage_modules(plan, stage)}
    said = []
    if any(label.endswith(PART_LABEL) for label in shown):
        said.append(f"{PART_LABEL.strip()}: a module split between stages, listed in each stage that runs some of it")
    if ROOT_LABEL in shown:
        said.append(f"{ROOT_LABEL}: operations written in the model's own forward, outside any submodule")
    return "; ".join(said) if said else None


def served_line(inputs: str) -> str:
    """The line saying what calls the stages serve (``ShardedModel.served_inputs``)."""
    return f"inputs served: {inputs}"


def plan_renderables(
    plan: SavedPlan, title: str, notes: Sequence[str] = (), step: StepTimeModel | None = None,
) -> list[RenderableType]:
    """Everything shown for a plan, in order: the stage table and its legend, the bottleneck, how
    the split was made and the predicted step time (under ``step``, see ``plan_step_lines``), the
    boundary values, the tied weights, the code kept whole, then ``notes`` (dim). The CLI prints
    these and ``PlanReport`` renders them, so both read the same."""
    shown: list[RenderableType] = [stage_table(plan, title)]
    legend = module_legend(plan)
    lines = ([legend] if legend else []) + summary_lines(plan) + how_made_lines(plan) + plan_step_lines(plan, step)
    shown += [_plain(line) for line in lines]
    if plan.num_stages > 1:
        shown.append(boundary_table(plan))
    if plan.shared_weights():
        shown.append(shared_weights_table(plan))
    shown += wrapped_tables(plan)
    shown += [Text(note, style="dim") for note in notes]
    return shown


def compare_tables(plans: Mapping[str, SavedPlan]) -> list[Table]:
    """Several strategies' plans of one model side by side: a summary row each, then stage by stage."""
    summary = Table(title="strategies compared")
    for column in ("strategy", "bottleneck", "÷ lower bound", "boundary total", "largest boundary", "stage costs"):
        summary.add_column(column, justify="left" if column in ("strategy", "stage costs") else "right",
                           overflow="fold")
    stages = Table(title="modules per stage")
    stages.add_column("stage", justify="right")
    for name, plan in plans.items():
        fmt = lambda v, p=plan: format_cost(p.cost_model, v)  # noqa: E731 - a local shorthand
        bound = plan.lower_bound()
        sent = plan.boundary_bytes()
        summary.add_row(
            _plain(name), fmt(plan.bottleneck()), f"{plan.bottleneck() / bound:.3f}" if bound > 0 else "n/a",
            format_size(plan, plan.total_boundary_bytes()), format_size(plan, max(sent, default=0.0)),
            ", ".join(fmt(c) for c in plan.stage_costs()),
        )
        stages.add_column(_plain(name), overflow="fold")
    k = max((p.num_stages for p in plans.values()), default=0)
    for stage in range(k):
        cells = [", ".join(stage_modules(p, stage)) if stage < p.num_stages else "" for p in plans.values()]
        stages.add_row(str(stage), *map(_plain, cells))
    return [summary, stages]
