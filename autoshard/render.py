"""Pictures of a plan: the DAG collapsed to modules and coloured by stage, and cost per stage.

Drawn with matplotlib, an optional extra (``pip install 'autoshard[plot]'``), without pyplot so
no window system is touched. The DAG is collapsed to modules at the deepest depth that keeps the
picture readable; a module spread over several stages is drawn once per stage. Arrows between
stages are labelled with the size of the values they carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autoshard.errors import InvalidArgumentError, MissingDependencyError
from autoshard.plan_io import SavedPlan
from autoshard.report import ROOT_LABEL, format_cost, format_size

DPI = 100
WIDTH_INCHES = 14.0
MAX_BOXES = 40
"""The collapsed graph gets at most this many boxes (unless even top-level modules exceed it)."""

INSTALL_HINT = "pip install 'autoshard[plot]' (or: pip install matplotlib)"
FORMATS = ("svg", "png")


@dataclass
class Box:
    """Consecutive nodes of one module (at the chosen depth) within one stage, drawn as one box."""

    label: str
    stage: int
    row: int
    nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Link:
    """Values flowing from one box to another; ``size`` is the sum over distinct producers."""

    source: int
    target: int
    size: float

    def is_cut(self, boxes: list[Box]) -> bool:
        return boxes[self.source].stage != boxes[self.target].stage


def _label(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth]) if module else ROOT_LABEL


def _group(plan: SavedPlan, depth: int) -> tuple[list[Box], dict[str, int]]:
    """One box per run of consecutive nodes (program order) in the same module and stage.

    Grouping runs rather than whole modules keeps the collapsed graph acyclic: operations of a
    parent module interleaved with its children's become several boxes, not one box with loops.
    """
    boxes: list[Box] = []
    where: dict[str, int] = {}
    rows = [0] * plan.num_stages
    for n in plan.nodes:
        label = f"input {n.name}" if n.input else _label(n.module, depth)
        if n.input or not boxes or (boxes[-1].label, boxes[-1].stage) != (label, n.stage):
            boxes.append(Box(label, n.stage, rows[n.stage]))
            rows[n.stage] += 1
        boxes[-1].nodes.append(n.name)
        where[n.name] = len(boxes) - 1
    return boxes, where


def collapse(plan: SavedPlan, max_boxes: int = MAX_BOXES) -> tuple[list[Box], list[Link]]:
    """Boxes per (module at the deepest readable depth, stage) and the links between them."""
    deepest = max((len(n.module.split(".")) for n in plan.nodes if n.module), default=1)
    for depth in range(deepest, 0, -1):
        boxes, where = _group(plan, depth)
        if len(boxes) <= max_boxes:
            break
    sizes = {n.name: n.bytes for n in plan.nodes}
    flows: dict[tuple[int, int], set[str]] = {}
    for u, v in plan.edges:
        if where[u] != where[v]:
            flows.setdefault((where[u], where[v]), set()).add(u)
    links = [Link(s, t, sum(sizes[p] for p in producers)) for (s, t), producers in flows.items()]
    return boxes, links


def figure_size(plan: SavedPlan) -> tuple[float, float]:
    """The picture's size in inches: a fixed width, tall enough for the longest stage column."""
    boxes, _ = collapse(plan)
    rows = max((b.row + 1 for b in boxes), default=1)
    return WIDTH_INCHES, min(40.0, max(6.0, 1.5 + 0.45 * rows))


def stage_colours(k: int) -> list[str]:
    """One distinct, deterministic colour per stage, as ``#rrggbb``."""
    from matplotlib import colormaps, colors

    name = "tab10" if k <= 10 else "tab20" if k <= 20 else "turbo"
    cmap = colormaps[name]
    if name == "turbo":
        return [colors.to_hex(cmap(0.05 + 0.9 * j / max(1, k - 1))) for j in range(k)]
    return [colors.to_hex(cmap(j)) for j in range(k)]


def _import_matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            f"drawing a plan needs matplotlib, which is not installed: {INSTALL_HINT}") from exc
    return matplotlib, Figure


def _shorten(label: str, limit: int) -> str:
    return label if len(label) <= limit else "…" + label[-(limit - 1):]


def _draw_graph(ax: Any, plan: SavedPlan, colours: list[str], column_inches: float) -> None:
    boxes, links = collapse(plan)
    rows = max((b.row + 1 for b in boxes), default=1)
    limit = max(8, int(column_inches * 72 / (7 * 0.62)))
    for j in range(plan.num_stages):
        ax.text(j, 0.9, f"stage {j}", ha="center", va="center", fontsize=10, fontweight="bold", color=colours[j])
    for link in links:
        a, b = boxes[link.source], boxes[link.target]
        cut = link.is_cut(boxes)
        bend = 0.0 if a.stage != b.stage or b.row - a.row == 1 else 0.35
        ax.annotate(
            "", xy=(b.stage, -b.row), xytext=(a.stage, -a.row), zorder=1,
            arrowprops=dict(arrowstyle="-|>", color="#c0392b" if cut else "#888888", lw=1.4 if cut else 0.7,
                            shrinkA=6, shrinkB=6, connectionstyle=f"arc3,rad={bend}"),
        )
        if cut:
            ax.text((a.stage + b.stage) / 2, -(a.row + b.row) / 2, format_size(plan, link.size), fontsize=7,
                    ha="center", va="center", color="#c0392b", zorder=4,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9))
    for box in boxes:
        ax.text(box.stage, -box.row, _shorten(box.label, limit), ha="center", va="center", fontsize=7, zorder=3,
                bbox=dict(boxstyle="round,pad=0.3", fc=colours[box.stage], ec="#333333", alpha=0.85))
    ax.set_xlim(-0.6, plan.num_stages - 0.4)
    ax.set_ylim(-rows + 0.4, 1.3)
    ax.set_axis_off()
    ax.set_title("graph collapsed to modules (red arrows cross a stage boundary)", fontsize=10)


def _draw_costs(ax: Any, plan: SavedPlan, colours: list[str]) -> None:
    costs = plan.stage_costs()
    k = plan.num_stages
    ideal = sum(n.costs[plan.cost_model] for n in plan.nodes) / k
    ax.bar(range(k), costs, color=colours, edgecolor="#333333")
    ax.axhline(ideal, color="black", linestyle="--", linewidth=1, label=f"ideal: total / {k}")
    if plan.lower_bound() > ideal:
        ax.axhline(plan.lower_bound(), color="black", linestyle=":", linewidth=1, label="lower bound (largest node)")
    ax.set_xticks(range(k), [str(j) for j in range(k)])
    ax.yaxis.set_major_formatter(lambda value, _: format_cost(plan.cost_model, value))
    ax.set_xlabel("stage")
    ax.set_ylabel(f"{plan.cost_model} cost")
    ax.set_title(f"cost per stage; bottleneck {format_cost(plan.cost_model, plan.bottleneck())}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")


def draw_plan(plan: SavedPlan, path: str | Path, format: Literal["svg", "png"] | None = None) -> Path:
    """Write the picture of ``plan`` to ``path`` as SVG or PNG (default: from the file's suffix).

    The image is ``figure_size(plan)`` inches at ``DPI`` dots per inch (SVG sizes are in points,
    72 per inch). Raises ``MissingDependencyError`` with the install command when matplotlib is absent.
    """
    target = Path(path)
    chosen = format or target.suffix.lstrip(".").lower()
    if chosen not in FORMATS:
        raise InvalidArgumentError(f"cannot draw {str(target)!r} as {chosen!r}; use a .svg or .png file")
    matplotlib, Figure = _import_matplotlib()
    width, height = figure_size(plan)
    colours = stage_colours(plan.num_stages)
    with matplotlib.rc_context({"svg.hashsalt": "autoshard", "font.family": "DejaVu Sans"}):
        fig = Figure(figsize=(width, height), dpi=DPI)
        grid = fig.add_gridspec(1, 2, width_ratios=[2.4, 1], left=0.02, right=0.97, top=0.9, bottom=0.08)
        _draw_graph(fig.add_subplot(grid[0]), plan, colours, width * 0.66 / plan.num_stages)
        _draw_costs(fig.add_subplot(grid[1]), plan, colours)
        fig.suptitle(f"{plan.model or 'model'}: {plan.num_stages} stages balanced by {plan.cost_model}", fontsize=12)
        metadata = {"Date": None} if chosen == "svg" else None
        try:
            fig.savefig(target, format=chosen, dpi=DPI, metadata=metadata)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot write the picture {str(target)!r}: {exc.strerror or exc}") from exc
    return target
