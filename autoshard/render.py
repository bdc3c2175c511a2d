"""Pictures of a plan: each stage's modules in a column, the values and tied weights between them, cost per stage.

Drawn with matplotlib, an optional extra (``pip install 'autoshard[plot]'``), without pyplot so
no window system is touched. A stage's column lists its modules as the CLI's table names them
(``layers.0-5``, ``attn (part)``, ``(root)``), one box each, at the deepest depth that keeps the
picture readable; the model's inputs are named as its forward's arguments. Red arrows carry
values to a later stage, and a box says how many bytes it sends; a dashed line joins the stages
that hold one tied weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Literal

from autoshard.errors import InvalidArgumentError, MissingDependencyError
from autoshard.plan_io import PlanNode, SavedPlan
from autoshard.report import (BYTE_COSTS, ROOT_LABEL, node_label, numbered_lists, compress_module_ranges,
                              format_cost, format_size, module_legend)

DPI = 100
WIDTH_INCHES = 14.0
GRAPH_SHARE = 0.66
"""The part of the picture's width the stage columns get; the cost chart has the rest."""
MIN_COLUMN_INCHES = 1.2
"""Many stages widen the picture rather than squeeze each column below this."""
MAX_BOXES = 40
"""The picture gets at most this many boxes (unless even top-level modules exceed it)."""
FONT_SIZE = 7
CHAR_WIDTH = 0.62
"""DejaVu Sans' widest common characters, as a fraction of the font size: keeps labels in their column."""
SENT = "#c0392b"
TIED = "#8e44ad"

STYLE = {"svg.hashsalt": "autoshard", "font.family": "DejaVu Sans"}
"""A fixed font, and SVG ids that do not change from run to run."""

INSTALL_HINT = "pip install 'autoshard[plot]' (or: pip install matplotlib)"
FORMATS = ("svg", "png")


@dataclass
class Box:
    """One module range of one stage (or one model input), drawn as one box."""

    label: str
    stage: int
    row: int
    nodes: list[str] = field(default_factory=list)
    input: bool = False
    sends: float = 0.0
    """Bytes of the values it sends to later stages, each value once."""


@dataclass(frozen=True)
class Link:
    """Values flowing from a box to a box of a later stage."""

    source: int
    target: int


@dataclass(frozen=True)
class Tie:
    """A weight held by several stages under one or more names: one box per stage reads it."""

    names: tuple[str, ...]
    boxes: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """What the graph panel draws, computed apart from matplotlib so it can be checked without drawing."""

    boxes: list[Box]
    links: list[Link]
    ties: list[Tie]
    legend: str | None
    """What ``(part)`` and ``(root)`` mean, for those the boxes show (``report.module_legend``)."""


def _at_depth(plan: SavedPlan, depth: int) -> SavedPlan:
    """The plan with every module cut to ``depth`` components: the picture at that depth."""
    nodes = tuple(replace(n, module=".".join(n.module.split(".")[:depth])) for n in plan.nodes)
    return replace(plan, nodes=nodes)


def _stage_labels(plan: SavedPlan, compress: bool) -> dict[str, str]:
    """Each compute node's label, as ``report.stage_modules`` lists it (ranged when ``compress``)."""
    spans = plan.module_stage_sets()
    numbered = numbered_lists(spans)
    raw = {n.name: node_label(n, spans, numbered) for n in plan.nodes if not n.input}
    if not compress:
        return raw
    ranged: dict[str, str] = {}
    for stage in range(plan.num_stages):
        order = list(dict.fromkeys(raw[n.name] for n in plan.nodes if n.stage == stage and not n.input))
        order = [label for label in order if label != ROOT_LABEL]
        ranges = compress_module_ranges(order)
        # compression is greedy from the left, so a prefix ends in the range holding its last label
        ranged.update({label: ranges[len(compress_module_ranges(order[: i + 1])) - 1] for i, label in enumerate(order)})
    return {name: ranged.get(label, label) for name, label in raw.items()}


def _input_label(node: PlanNode) -> str:
    """A model input by its forward's argument name (the placeholder's target), not the graph's node name
    (``input_ids_unchecked`` once capture checks the inputs)."""
    return f"input: {node.target or node.name}"


def _boxes(plan: SavedPlan, labels: dict[str, str]) -> tuple[list[Box], dict[str, int]]:
    """Per stage: its inputs, then its module ranges in program order and ``(root)`` last, as the table lists them."""
    boxes: list[Box] = []
    where: dict[str, int] = {}
    for stage in range(plan.num_stages):
        members = [n for n in plan.nodes if n.stage == stage]
        keys = [_input_label(n) if n.input else labels[n.name] for n in members]
        order = [k for k in dict.fromkeys(keys) if k != ROOT_LABEL] + [ROOT_LABEL] * (ROOT_LABEL in keys)
        inputs = {_input_label(n) for n in members if n.input}
        first = len(boxes)
        boxes.extend(Box(label, stage, row, input=label in inputs) for row, label in enumerate(order))
        for n, key in zip(members, keys):
            where[n.name] = first + order.index(key)
            boxes[where[n.name]].nodes.append(n.name)
    return boxes, where


def _coarser(plan: SavedPlan) -> Iterator[tuple[SavedPlan, dict[str, str]]]:
    """Ever coarser pictures: from the deepest modules, each depth one module a box, then ranged."""
    deepest = max((len(n.module.split(".")) for n in plan.nodes if n.module), default=1)
    for depth in range(deepest, 0, -1):
        shown = _at_depth(plan, depth)
        yield shown, _stage_labels(shown, compress=False)
        yield shown, _stage_labels(shown, compress=True)


def layout(plan: SavedPlan, max_boxes: int = MAX_BOXES) -> Layout:
    """The boxes at the deepest depth (ranged only when needed) with at most ``max_boxes``, and what joins them."""
    for shown, labels in _coarser(plan):
        boxes, where = _boxes(plan, labels)
        if len(boxes) <= max_boxes:
            break
    sizes = {n.name: n.bytes for n in plan.nodes}
    sent: set[str] = set()
    flows: dict[tuple[int, int], None] = {}
    for u, v in plan.edges:
        if boxes[where[u]].stage != boxes[where[v]].stage:
            flows[where[u], where[v]] = None
            if u not in sent:
                sent.add(u)
                boxes[where[u]].sends += sizes[u]
    ties = []
    for weight in plan.shared_weights():
        if len(weight.stages) > 1:
            readers = {boxes[where[n]].stage: where[n] for n in reversed(weight.nodes)}  # the first reader per stage
            ties.append(Tie(weight.aliases or (weight.name,), tuple(readers[s] for s in sorted(readers))))
    return Layout(boxes, [Link(s, t) for s, t in flows], ties, module_legend(shown))


def _legend_lines(shown: Layout) -> int:
    return 1 + len(shown.ties) + (shown.legend.count("; ") + 1 if shown.legend else 0)


def figure_size(plan: SavedPlan) -> tuple[float, float]:
    """The picture's size in inches: wide enough for every stage's column, tall enough for the longest
    column and the legend under it."""
    shown = layout(plan)
    rows = max((b.row + 1 for b in shown.boxes), default=1)
    width = max(WIDTH_INCHES, plan.num_stages * MIN_COLUMN_INCHES / GRAPH_SHARE)
    return width, min(40.0, max(6.0, 1.5 + 0.45 * rows + 0.2 * _legend_lines(shown)))


def stage_colours(k: int) -> list[str]:
    """One distinct, deterministic colour per stage, as ``#rrggbb``."""
    from matplotlib import colormaps, colors

    name = "tab10" if k <= 10 else "tab20" if k <= 20 else "turbo"
    cmap = colormaps[name]
    if name == "turbo":
        return [colors.to_hex(cmap(0.05 + 0.9 * j / max(1, k - 1))) for j in range(k)]
    return [colors.to_hex(cmap(j)) for j in range(k)]


def import_matplotlib() -> Any:
    """matplotlib and its ``Figure``, or ``MissingDependencyError`` saying how to install it."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            f"drawing a plan needs matplotlib, which is not installed: {INSTALL_HINT}") from exc
    return matplotlib, Figure


def _fit(label: str, limit: int) -> str:
    """A long name on two lines, broken after a dot; past that its end is kept, which says which layer
    and whether it is a ``(part)``."""
    if len(label) <= limit:
        return label
    cut = label.rfind(".", 0, limit)
    if cut < 0:
        return "…" + label[-(limit - 1):]
    rest = label[cut + 1:]
    return label[: cut + 1] + "\n" + (rest if len(rest) <= limit else "…" + rest[-(limit - 1):])


def _box_text(plan: SavedPlan, box: Box, limit: int) -> str:
    text = _fit(box.label, limit)
    return f"{text}\nsends {format_size(plan, box.sends)}" if box.sends else text


def _draw_graph(ax: Any, plan: SavedPlan, shown: Layout, colours: list[str], column_points: float) -> None:
    from matplotlib.lines import Line2D

    boxes = shown.boxes
    rows = max((b.row + 1 for b in boxes), default=1)
    limit = max(8, int((column_points - 16) / (FONT_SIZE * CHAR_WIDTH)))
    for j in range(plan.num_stages):
        ax.text(j, 0.9, f"stage {j}", ha="center", va="center", fontsize=10, fontweight="bold", color=colours[j])
    texts = []
    for box in boxes:
        texts.append(ax.text(box.stage, -box.row, _box_text(plan, box, limit), ha="center", va="center",
                             fontsize=FONT_SIZE, zorder=3, linespacing=1.1,
                             bbox=dict(boxstyle="round,pad=0.3", fc="white" if box.input else colours[box.stage],
                                       ec=colours[box.stage] if box.input else "#333333")))
    for link in shown.links:
        skips = boxes[link.target].stage - boxes[link.source].stage > 1  # bowed: it does not enter the stages between
        ax.annotate("", xy=(0, 0.5), xycoords=texts[link.target], xytext=(1, 0.5), textcoords=texts[link.source],
                    zorder=4, arrowprops=dict(arrowstyle="-|>", color=SENT, lw=1.2, shrinkA=3, shrinkB=3, alpha=0.6,
                                              connectionstyle=f"arc3,rad={0.25 if skips else 0}"))
    handles = [Line2D([], [], color=SENT, lw=1.2, alpha=0.6,
                      label="values sent to a later stage (a box says how many bytes)")]
    for tie in shown.ties:
        for a, b in zip(tie.boxes, tie.boxes[1:]):
            ax.annotate("", xy=(0.5, 0), xycoords=texts[b], xytext=(0.5, 0), textcoords=texts[a], zorder=2,
                        gid=f"tie:{tie.names[0]}", arrowprops=dict(
                            arrowstyle="-", color=TIED, lw=1.5, linestyle="--", shrinkA=2, shrinkB=2,
                            connectionstyle="arc3,rad=0.15"))
        stages = ", ".join(str(boxes[i].stage) for i in tie.boxes)
        handles.append(Line2D([], [], color=TIED, lw=1.5, linestyle="--",
                              label=f"one weight held by stages {stages}: {' = '.join(tie.names)}"))
    for line in shown.legend.split("; ") if shown.legend else ():
        handles.append(Line2D([], [], linestyle="none", label=line))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), fontsize=FONT_SIZE, frameon=False,
              handlelength=2.5)
    ax.set_xlim(-0.5, plan.num_stages - 0.5)
    ax.set_ylim(-rows + 0.4, 1.3)
    ax.set_axis_off()
    ax.set_title("each stage's modules in program order", fontsize=10)


def _byte_step(top: float) -> float:
    """A tick step that is a round number of KB, MB...: 1024-based sizes at 5000-byte steps read 4.9 KB, 9.8 KB."""
    unit = 1024.0 ** max(0, int(math.log(max(top, 1.0), 1024)))
    wanted = top / unit / 5
    return unit * min(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if s >= wanted)


def _draw_costs(ax: Any, plan: SavedPlan, colours: list[str]) -> None:
    from matplotlib.ticker import MultipleLocator

    costs = plan.stage_costs()
    k = plan.num_stages
    ideal = sum(n.costs[plan.cost_model] for n in plan.nodes) / k
    ax.bar(range(k), costs, color=colours, edgecolor="#333333")
    ax.axhline(ideal, color="black", linestyle="--", linewidth=1, label=f"ideal: total / {k}")
    if plan.lower_bound() > ideal:
        ax.axhline(plan.lower_bound(), color="black", linestyle=":", linewidth=1, label="lower bound (largest node)")
    ax.set_xticks(range(k), [str(j) for j in range(k)])
    if plan.cost_model in BYTE_COSTS:
        ax.yaxis.set_major_locator(MultipleLocator(_byte_step(max(costs + [plan.lower_bound()]))))
    ax.yaxis.set_major_formatter(lambda value, _: format_cost(plan.cost_model, value))
    ax.set_xlabel("stage")
    ax.set_ylabel(f"{plan.cost_model} cost")
    ax.set_title(f"cost per stage; bottleneck {format_cost(plan.cost_model, plan.bottleneck())}", fontsize=10)
    ax.legend(fontsize=FONT_SIZE + 1, loc="upper left", bbox_to_anchor=(0, -0.1), frameon=False)


def plan_figure(plan: SavedPlan) -> Any:
    """The picture as a matplotlib ``Figure`` (no pyplot): what ``draw_plan`` writes, for a notebook or a test."""
    matplotlib, Figure = import_matplotlib()
    width, height = figure_size(plan)
    shown = layout(plan)
    colours = stage_colours(plan.num_stages)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height), dpi=DPI)
        bottom = (0.35 + 0.17 * _legend_lines(shown)) / height
        grid = fig.add_gridspec(1, 2, width_ratios=[2.4, 1], left=0.02, right=0.97, top=0.9, bottom=bottom)
        graph = fig.add_subplot(grid[0])
        _draw_graph(graph, plan, shown, colours, graph.get_position().width * width * 72 / plan.num_stages)
        _draw_costs(fig.add_subplot(grid[1]), plan, colours)
        fig.suptitle(f"{plan.model or 'model'}: {plan.num_stages} stages balanced by {plan.cost_model}", fontsize=12)
    return fig


def draw_plan(plan: SavedPlan, path: str | Path, format: Literal["svg", "png"] | None = None) -> Path:
    """Write the picture of ``plan`` to ``path`` as SVG or PNG (default: from the file's suffix).

    The image is ``figure_size(plan)`` inches at ``DPI`` dots per inch (SVG sizes are in points,
    72 per inch). Raises ``MissingDependencyError`` with the install command when matplotlib is absent.
    """
    target = Path(path)
    chosen = format or target.suffix.lstrip(".").lower()
    if chosen not in FORMATS:
        raise InvalidArgumentError(f"cannot draw {str(target)!r} as {chosen!r}; use a .svg or .png file")
    matplotlib, _ = import_matplotlib()
    with matplotlib.rc_context(STYLE):
        fig = plan_figure(plan)
        metadata = {"Date": None} if chosen == "svg" else None
        try:
            fig.savefig(target, format=chosen, dpi=DPI, metadata=metadata)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot write the picture {str(target)!r}: {exc.strerror or exc}") from exc
    return target
