"""User constraints on a split, checked against the graph and resolved to node indices.

Seven kinds, all in terms of graph nodes (``autoshard.passes.split`` resolves module paths and
classes to node sets):

* ``cut_before``: nodes at which a stage must start. A cut before ``v`` is a boundary with
  exactly the nodes before ``v`` in program order on its early side. A ``{node: label}`` mapping
  names each pin by its label in errors (the split pass passes the module paths the user wrote).
* ``together``: labelled node groups that must sit in one stage (``no_split`` modules).
* ``stage_ranges``: the stages a node may take, ``{node: stage}`` or ``{node: (first, last)}``
  (or a ``StageRange``, whose label names it in errors: a module pinned to a stage). A range
  bounds the node's ancestors from above and its descendants from below too, as stages are
  ordered; ranges that contradict each other through the graph are refused naming both.
* ``prefer_together``: labelled groups kept in one stage when the balance bound allows it
  (tied weights); the split reports the ones it had to separate.
* ``capacities``: per-stage relative speeds; stage j's cost / capacity_j is what is balanced.
* ``memory_budgets``: per-stage limits on the sum of the node attribute ``memory``.
* ``memory_in_flight``: with ``memory_budgets``, how many microbatches each stage keeps
  activations for (1F1B: stage j of k keeps k - j); stage j must then satisfy
  sum(``memory``) + in_flight[j] x sum(``activation_memory``) <= memory_budgets[j].

A problem that cannot be met raises ``InfeasibleSplitError`` naming the constraint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from autoshard.errors import EmptyStageError, InfeasibleSplitError, InvalidArgumentError, InvalidArgumentTypeError
from autoshard.graph.indexed import IndexedDag, Node
from autoshard.graph.invariants import is_number
from autoshard.graph.limits import StageLimit

#: The node attribute that ``memory_budgets`` limit: bytes a stage holds once (weights, their
#: gradients and optimizer state).
MEMORY = "memory"
#: The optional node attribute for bytes kept for backward per microbatch in flight (absent: 0).
ACTIVATION_MEMORY = "activation_memory"

Groups = Mapping[str, Collection[Node]] | Sequence[Collection[Node]]


@dataclass(frozen=True)
class StageRange:
    """The stages ``first``..``last`` (inclusive) a node may take; ``label`` names it in errors."""

    first: int
    last: int
    label: str | None = None

    def describe(self, node: Node) -> str:
        """How errors name this range: its label (a module path), else the node, with the stages."""
        stages = f"stage {self.first}" if self.first == self.last else f"stages {self.first}..{self.last}"
        return f"{self.label or repr(node)} (pinned to {stages})"


@dataclass(frozen=True)
class Constraints:
    """What a split must (or should) respect; the empty default constrains nothing."""

    cut_before: tuple[Node, ...] = ()
    together: Mapping[str, frozenset[Node]] = field(default_factory=dict)
    prefer_together: Mapping[str, frozenset[Node]] = field(default_factory=dict)
    capacities: tuple[float, ...] | None = None
    memory_budgets: tuple[float, ...] | None = None
    memory_in_flight: tuple[float, ...] | None = None
    cut_labels: Mapping[Node, str] = field(default_factory=dict)
    stage_ranges: Mapping[Node, StageRange] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        cut_before: Collection[Node] = (),
        together: Groups = (),
        prefer_together: Groups = (),
        capacities: Sequence[float] | float | None = None,
        memory_budgets: Sequence[float] | float | None = None,
        memory_in_flight: Sequence[float] | float | None = None,
        stage_ranges: Mapping[Node, Any] | None = None,
    ) -> Constraints:
        """Normalise user arguments: groups get labels, numbers become float tuples."""
        if memory_in_flight is not None and memory_budgets is None:
            raise InvalidArgumentError(
                "memory_in_flight only scales activation memory under memory_budgets; "
                "give memory_budgets too, or drop memory_in_flight")
        labels = {v: str(label) for v, label in cut_before.items()} if isinstance(cut_before, Mapping) else {}
        return cls(
            cut_before=_nodes("cut_before", cut_before),
            together=_groups("together", together),
            prefer_together=_groups("prefer_together", prefer_together),
            capacities=None if capacities is None else _numbers("capacities", capacities),
            memory_budgets=None if memory_budgets is None else _numbers("memory_budgets", memory_budgets),
            memory_in_flight=None if memory_in_flight is None else _numbers("memory_in_flight", memory_in_flight),
            cut_labels=labels,
            stage_ranges=_stage_ranges(stage_ranges or {}),
        )

    def pin_name(self, node: Node) -> str:
        """How errors name a pin: the label the caller gave it (a module path), else the node."""
        return repr(self.cut_labels[node]) if node in self.cut_labels else repr(node)

    def hard(self) -> bool:
        """Whether anything restricts the splits a strategy may return."""
        return bool(self.cut_before or self.together or self.stage_ranges or self.memory_budgets is not None
                    or self.capacities is not None)

    def names(self) -> list[str]:
        """The options in force, for error messages."""
        return [name for name, value in (
            ("cut_before", self.cut_before), ("together", self.together), ("stage_ranges", self.stage_ranges),
            ("capacities", self.capacities), ("memory_budgets", self.memory_budgets),
            ("memory_in_flight", self.memory_in_flight),
        ) if value]

    def with_together(self, extra: Mapping[str, frozenset[Node]]) -> Constraints:
        """These constraints with ``extra`` groups made hard, each under a label of its own: a
        preference may share its label with a hard group, which must not be replaced."""
        together = dict(self.together)
        for label, members in extra.items():
            added = f"{label} (preferred)"
            while added in together:
                added += "'"
            together[added] = members
        return replace(self, together=together)


def _nodes(option: str, nodes: Any) -> tuple[Node, ...]:
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Collection):
        raise InvalidArgumentTypeError(f"{option} must be a collection of nodes, got {nodes!r}")
    try:
        return tuple(dict.fromkeys(nodes))
    except TypeError as exc:  # an unhashable member, which no node of a networkx graph can be
        raise InvalidArgumentTypeError(f"{option} holds something that cannot be a node ({exc}): {nodes!r}") from exc


def _stage_ranges(ranges: Any) -> dict[Node, StageRange]:
    """``{node: stage | (first, last) | StageRange}`` as ``StageRange``s, each a whole range of stages."""
    if not isinstance(ranges, Mapping):
        raise InvalidArgumentTypeError(
            f"stage_ranges must be a {{node: stage or (first, last)}} mapping, got {ranges!r}")
    found = {}
    for node, value in ranges.items():
        if isinstance(value, StageRange):
            first, last, label = value.first, value.last, value.label
        elif isinstance(value, tuple) and len(value) == 2:
            (first, last), label = value, None
        else:
            first, last, label = value, value, None
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in (first, last)):
            raise InvalidArgumentTypeError(
                f"stage_ranges[{node!r}] must be a stage or a (first, last) pair of stages, got {value!r}")
        if not 0 <= first <= last:
            raise InvalidArgumentError(
                f"stage_ranges[{node!r}] is {first}..{last}; a range needs 0 <= first <= last")
        found[node] = StageRange(first, last, label)
    return found


def _groups(option: str, groups: Any) -> dict[str, frozenset[Node]]:
    """Labelled groups: a mapping keeps its labels, a list is labelled ``option[i]``."""
    if isinstance(groups, Mapping):
        items = [(str(label), members) for label, members in groups.items()]
        labels = [label for label, _ in items]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise InvalidArgumentError(
                f"{option} has several groups labelled {twice[0]!r} (labels are compared as text); give each its own")
    elif isinstance(groups, Sequence) and not isinstance(groups, (str, bytes)):
        items = [(f"{option}[{i}]", members) for i, members in enumerate(groups)]
    else:
        raise InvalidArgumentTypeError(
            f"{option} must be a list or a {{label: nodes}} mapping of node groups, got {groups!r}")
    return {label: frozenset(_nodes(f"{option} {label!r}", members)) for label, members in items}


def _numbers(option: str, values: Any) -> tuple[float, ...]:
    """One number per stage, or a single number for every stage."""
    if is_number(values):
        values = (values,)
    if hasattr(values, "tolist") and getattr(values, "ndim", None) == 1:  # a numpy array or a tensor
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgumentTypeError(f"{option} must be a list of numbers, got {values!r}")
    for i, value in enumerate(values):
        if not is_number(value) or not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(f"{option}[{i}] is {value!r}; it must be a finite number >= 0")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class Rules:
    """Constraints resolved against one graph, as index arrays.

    ``pins`` are program-order positions in the non-input sequence where a boundary must fall
    (each the number of non-input nodes before the pinned node); ``groups`` and
    ``preferences`` are labelled index arrays; ``capacities`` has k entries; ``memory`` is the
    per-stage memory limit when ``memory_budgets`` is given; ``ranges`` the stages each node may
    take (``stage_ranges`` carried through the graph), or None when no node is restricted.
    """

    pins: np.ndarray
    groups: tuple[tuple[str, np.ndarray], ...]
    preferences: tuple[tuple[str, np.ndarray], ...]
    capacities: np.ndarray
    memory: StageLimit | None
    ranges: StageBounds | None = None


@dataclass(frozen=True)
class StageBounds:
    """The earliest and latest stage of every node (index arrays), each range non-empty."""

    earliest: np.ndarray
    latest: np.ndarray

    def allows(self, stages: np.ndarray) -> np.ndarray:
        """Per node, whether its stage lies in its range."""
        return (self.earliest <= stages) & (stages <= self.latest)


def _position(g: IndexedDag, node: Node, option: str) -> int:
    if node not in g.index:
        raise InvalidArgumentError(f"{option}: {node!r} is not a node of the graph")
    return g.index[node]


def _per_stage(option: str, values: tuple[float, ...], k: int) -> np.ndarray:
    if len(values) == 1:
        values = values * k
    if len(values) != k:
        raise InvalidArgumentError(f"{option} has {len(values)} entries for {k} stages; give one per stage")
    return np.array(values, dtype=float)


def resolve(g: IndexedDag, constraints: Constraints, k: int) -> Rules:
    """Check ``constraints`` against the graph and k; raise naming the first one that fails."""
    pins = _pins(g, constraints, k)
    groups = _indexed_groups(g, "together", constraints.together)
    preferences = _indexed_groups(g, "prefer_together", constraints.prefer_together)
    _check_pins_against_groups(g, constraints, pins, groups)
    ranges = stage_bounds(g, constraints, k)
    capacities = np.ones(k) if constraints.capacities is None else _per_stage(
        "capacities", constraints.capacities, k)
    if np.any(capacities <= 0):
        raise InvalidArgumentError(f"capacities must be > 0, got {constraints.capacities}")
    if constraints.memory_budgets is None:
        return Rules(pins, groups, preferences, capacities, None, ranges)
    memory = memory_limit(g, constraints, k)
    _check_memory(g, memory, groups)
    return Rules(pins, groups, preferences, capacities, memory, ranges)


def stage_bounds(g: IndexedDag, constraints: Constraints, k: int) -> StageBounds | None:
    """Each node's stage range, from ``stage_ranges`` carried along the edges: a node comes no
    earlier than any ancestor's first stage and no later than any descendant's last; inputs sit
    in stage 0. None when nothing is restricted. Raises naming two pins that contradict."""
    if not constraints.stage_ranges:
        return None
    earliest, latest = [0] * g.n, [k - 1] * g.n
    latest[: g.num_inputs] = [0] * g.num_inputs
    first_from, last_from = [-1] * g.n, [-1] * g.n  # the pinned node behind each bound, for errors
    for node, allowed in constraints.stage_ranges.items():
        v = _position(g, node, "stage_ranges")
        if allowed.first > k - 1:
            raise InfeasibleSplitError(
                f"{allowed.describe(node)} asks for a stage past the last one of {k} stages "
                f"(stage {k - 1}); pin it to a stage below {k} or ask for more stages")
        if allowed.first > earliest[v]:
            earliest[v], first_from[v] = allowed.first, v
        if allowed.last < latest[v]:
            latest[v], last_from[v] = allowed.last, v
    _carry(g, earliest, latest, first_from, last_from)
    clash = next((v for v in range(g.n) if earliest[v] > latest[v]), None)
    if clash is not None:
        _raise_clash(g, constraints, clash, first_from[clash], last_from[clash])
    bounds = StageBounds(np.array(earliest, dtype=np.int64), np.array(latest, dtype=np.int64))
    _check_every_stage_can_hold_a_node(g, constraints, bounds, k)
    return bounds


def _check_every_stage_can_hold_a_node(g: IndexedDag, constraints: Constraints, bounds: StageBounds, k: int) -> None:
    """Refuse ranges that leave too few nodes for some stages (each stage must hold one): stage j,
    or the stages j..k-1 (0..j), fewer nodes may take than there are of them. Both are an
    ``EmptyStageError``: a stage would be left with nothing to compute."""
    first, last = bounds.earliest[g.num_inputs:], bounds.latest[g.num_inputs:]
    pins = ", ".join(dict.fromkeys(r.describe(v) for v, r in constraints.stage_ranges.items()))
    late = np.cumsum(np.bincount(last, minlength=k)[::-1])[::-1]  # nodes that may sit in stage j or later
    early = np.cumsum(np.bincount(first, minlength=k))  # nodes that may sit in stage j or earlier
    for j in range(k):
        if not np.any((first <= j) & (j <= last)):
            raise EmptyStageError(
                f"the pins leave stage {j} of {k} empty: under {pins} no node may sit there, and each stage "
                "must hold one; pin to other stages or ask for fewer stages", j, k)
        for count, first_stage, last_stage in ((late[j], j, k - 1), (early[j], 0, j)):
            stages = last_stage - first_stage + 1
            if count < stages:
                raise EmptyStageError(
                    f"the pins leave {count} node{'' if count == 1 else 's'} for the {stages} stages "
                    f"{first_stage}..{last_stage}: under {pins} the rest must sit elsewhere, and each stage must hold "
                    "one; pin to other stages or ask for fewer stages", first_stage, k, last_stage, int(count))


def _carry(g: IndexedDag, earliest: list[int], latest: list[int], first_from: list[int], last_from: list[int]) -> None:
    """Carry first stages along the edges and last stages against them, in place, with the node
    each bound comes from."""
    pred, succ = g.pred, g.succ
    for v in range(g.n):  # program order is topological: ancestors first
        for u in pred[v]:
            if earliest[u] > earliest[v]:
                earliest[v], first_from[v] = earliest[u], first_from[u]
    for v in range(g.n - 1, -1, -1):
        for w in succ[v]:
            if latest[w] < latest[v]:
                latest[v], last_from[v] = latest[w], last_from[w]


def spread_stages(g: IndexedDag, bounds: StageBounds, k: int) -> np.ndarray | None:
    """A stage for every node within its range, ordered along the edges, every stage holding one,
    or None if this greedy finds none: stage by stage, the node whose range ends soonest (ties:
    starts latest, comes first) is held to it and the ranges carried again. Sorting an order by
    these stages gives one that some split along keeps every range."""
    earliest, latest = bounds.earliest.tolist(), bounds.latest.tolist()
    unused = [-1] * g.n
    for j in range(k):
        can = [v for v in range(g.num_inputs, g.n) if earliest[v] <= j <= latest[v]]
        if not can:
            return None
        v = min(can, key=lambda u: (latest[u], -earliest[u], u))
        earliest[v] = latest[v] = j
        _carry(g, earliest, latest, unused, unused)
        if any(e > last for e, last in zip(earliest, latest)):
            return None
    return np.array(earliest, dtype=np.int64)


def _raise_clash(g: IndexedDag, constraints: Constraints, v: int, early: int, late: int) -> None:
    """Refuse ranges that leave node v no stage: ``early`` pins an ancestor of v (or v) late, ``late``
    a descendant of v (or v) early."""
    first = constraints.stage_ranges[g.nodes[early]].describe(g.nodes[early])
    if late < 0:  # only an input has its last stage from no pin: inputs have no ancestors
        raise InfeasibleSplitError(f"{first} is a model input; inputs always sit in stage 0")
    later = constraints.stage_ranges[g.nodes[late]].describe(g.nodes[late])
    through = "" if v in (early, late) else f", through {g.nodes[v]!r}"
    raise InfeasibleSplitError(
        f"the pins contradict each other: {first} runs before {later} (it feeds it{through}), but stages "
        "run in order; pin the later one to a stage no earlier than the first one's")


def memory_limit(g: IndexedDag, constraints: Constraints, k: int) -> StageLimit:
    """The memory each stage may hold, from ``memory_budgets`` and ``memory_in_flight``."""
    budgets = _per_stage("memory_budgets", constraints.memory_budgets, k)
    if constraints.memory_in_flight is None:
        return StageLimit("memory", g.attribute(MEMORY), budgets)
    in_flight = _per_stage("memory_in_flight", constraints.memory_in_flight, k)
    return StageLimit("memory", g.attribute(MEMORY), budgets, g.attribute(ACTIVATION_MEMORY), in_flight)


def _indexed_groups(
    g: IndexedDag, option: str, groups: Mapping[str, frozenset[Node]]
) -> tuple[tuple[str, np.ndarray], ...]:
    return tuple(
        (label, np.array(sorted(_position(g, v, f"{option} {label!r}") for v in members), dtype=np.int64))
        for label, members in groups.items() if members
    )


def _pins(g: IndexedDag, constraints: Constraints, k: int) -> np.ndarray:
    positions: dict[int, list[str]] = {}
    for node in constraints.cut_before:
        i = _position(g, node, "cut_before")
        name = constraints.pin_name(node)
        if i < g.num_inputs:
            raise InvalidArgumentError(
                f"cut_before: {name} is a model input; inputs always sit in stage 0, so no stage starts there")
        if i > g.num_inputs:  # a cut before the very first node is where stage 0 starts anyway
            positions.setdefault(i - g.num_inputs, []).append(name)
    pins = np.array(sorted(positions), dtype=np.int64)
    if len(pins) > k - 1:
        # Name the pins (a label shared by several entries that fall at one boundary counts once).
        named = ", ".join("=".join(positions[p]) for p in pins.tolist())
        raise InfeasibleSplitError(
            f"cut_before asks for {len(pins)} boundaries but {k} stages have only {k - 1} ({named}); "
            f"ask for at least {len(pins) + 1} stages or fewer cuts")
    return pins


def _check_pins_against_groups(
    g: IndexedDag, constraints: Constraints, pins: np.ndarray, groups: tuple[tuple[str, np.ndarray], ...]
) -> None:
    for label, members in groups:
        first = max(int(members[0]) - g.num_inputs, 0)
        last = int(members[-1]) - g.num_inputs
        inside = pins[(pins > first) & (pins <= last)]
        if len(inside):
            pinned = g.nodes[int(inside[0]) + g.num_inputs]
            raise InfeasibleSplitError(
                f"cut_before {constraints.pin_name(pinned)} falls inside together group {label!r}, which must stay "
                f"in one stage; cut before the group's first node {g.nodes[int(members[0])]!r} instead, or drop "
                "one of the two")


def _check_memory(g: IndexedDag, memory: StageLimit, groups: tuple[tuple[str, np.ndarray], ...]) -> None:
    """Raise when the budgets cannot hold everything, one node, or one together group."""
    budgets = memory.budgets
    need = float(memory.least().sum())
    if need > budgets.sum() * (1 + 1e-9):
        raise InfeasibleSplitError(
            f"memory_budgets sum to {format_amount(budgets.sum())} but the nodes need {format_amount(need)} in total"
            f"{_in_flight_note(memory)}")
    nodes = np.flatnonzero(~_fits(memory, memory.held, memory.scaled))
    if len(nodes):
        v = int(nodes[0])
        raise InfeasibleSplitError(_too_big(f"node {g.nodes[v]!r}", v, memory))
    for label, members in groups:
        held = memory.held[members].sum(keepdims=True)
        scaled = None if memory.scaled is None else memory.scaled[members].sum(keepdims=True)
        if not _fits(memory, held, scaled)[0]:
            raise InfeasibleSplitError(_too_big(f"together group {label!r}", members, memory))


def _fits(memory: StageLimit, held: np.ndarray, scaled: np.ndarray | None) -> np.ndarray:
    """Per entry, whether some stage's budget holds it."""
    need = held[:, None] if scaled is None else held[:, None] + memory.scale[None, :] * scaled[:, None]
    return np.any(need <= memory.budgets[None, :] * (1 + 1e-9), axis=1)


def _in_flight_note(memory: StageLimit) -> str:
    if memory.scaled is None or not memory.scaled.any():
        return ""
    fewest = float(memory.scale.min())
    per_stage = ", ".join(f"{s:g}" for s in memory.scale.tolist())
    return (f" even with activations counted for {fewest:g} microbatch{'' if fewest == 1 else 'es'}, the fewest "
            f"any stage keeps in flight (memory_in_flight per stage: {per_stage})")


def _too_big(what: str, members: int | np.ndarray, memory: StageLimit) -> str:
    held = float(np.sum(memory.held[members]))
    scaled = 0.0 if memory.scaled is None else float(np.sum(memory.scaled[members]))
    if not scaled:
        return (f"{what} needs memory {format_amount(held)}, more than the largest memory budget "
                f"{format_amount(memory.budgets.max())}")
    return (f"{what} needs memory {format_amount(held)} plus {format_amount(scaled)} per microbatch in flight, more "
            f"than any stage holds under memory_budgets {format_amounts(memory.budgets.tolist())} with "
            f"memory_in_flight {format_amounts(memory.scale.tolist())}")


def format_amounts(values: Sequence[float]) -> str:
    """``[307,200; 307,200]``: amounts as ``format_amount`` writes them, apart where their own commas would blur."""
    return f"[{'; '.join(map(format_amount, values))}]"


def format_amount(value: float) -> str:
    """A memory amount as it reads best: whole numbers with thousands separated (bytes: 36,608,
    not 36608 or 3.6608e+04), and so fractions of a byte from a million up (a budget of "3.6MiB" is
    3,774,873.6 bytes: 3,774,874, not 3.77487e+06); others as ``%g`` with thousands separated too."""
    whole = float(value).is_integer() or abs(value) >= 1e6
    return f"{value:,.0f}" if whole and abs(value) < 1e18 else f"{value:,g}"
