"""``SplitProblem``: one validated request (graph, k, tolerance, constraints) and what every
strategy derives from it: the balance bound, per-order sequences with their limits, scores;
and ``Outcome``, a strategy's answer (here so ``split`` and ``exact`` share it without a cycle).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import networkx as nx
import numpy as np

from autoshard.errors import InfeasibleSplitError, plural
from autoshard.graph.balance import Line, min_bottleneck_of, min_bytes_cuts
from autoshard.graph.constraints import (
    ACTIVATION_MEMORY, MEMORY, Constraints, Rules, format_amounts, resolve, spread_stages,
)
from autoshard.graph.indexed import IndexedDag, Node
from autoshard.graph.invariants import check_weights
from autoshard.graph.limits import StageLimit, laid_along, slack


@dataclass(frozen=True)
class Outcome:
    """A strategy's answer with what it knows about its quality."""

    stages: np.ndarray | Mapping[Node, int]
    proven_optimal: bool | None = None


#: What a split of program order that no constraint set allows says beyond the constraints: why other
#: orders were not tried, and what to do (``split_placing_ties`` drops it: a ``max_memory`` refusal
#: says what to do itself, and its budgets come from the caller, not from that order).
ORDER_ADVICE = (" (the budget comes from that order: a group that other orders could keep together is not "
                "looked for); relax one of them or change the number of stages")


class SplitProblem:
    """Split ``dag`` into ``k`` stages within ``tolerance`` of the best balance, under constraints.

    ``bound`` is B = (1 + tolerance) x the least achievable max_j cost_j / capacity_j over
    contiguous splits of program order that meet the hard constraints; stage j may cost at
    most B x capacity_j. Give ``bound`` to reuse one computed without some constraints, and
    ``dag`` indexed to reuse its index (and what it derived) across problems.
    """

    def __init__(
        self,
        dag: nx.DiGraph | IndexedDag,
        k: int,
        tolerance: float,
        constraints: Constraints = Constraints(),
        bound: float | None = None,
    ) -> None:
        self.graph = dag if isinstance(dag, IndexedDag) else IndexedDag(dag)
        self.dag, self.k, self.tolerance, self.constraints = self.graph.dag, k, tolerance, constraints
        if constraints.memory_budgets is not None:
            check_weights(self.dag, (MEMORY,))
            if constraints.memory_in_flight is not None:
                check_weights(self.dag, (ACTIVATION_MEMORY,), required=False)
        self.rules: Rules = resolve(self.graph, constraints, k)
        if bound is not None:
            self.__dict__["bound"] = bound

    @cached_property
    def bound(self) -> float:
        line = self.line(self.respect_pins(self.graph.program()))
        try:
            best = min_bottleneck_of(line)
        except InfeasibleSplitError:
            raise InfeasibleSplitError(self._infeasible()) from None
        return (1.0 + self.tolerance) * best

    def _infeasible(self) -> str:
        c = self.constraints
        parts = []
        if c.cut_before:
            parts.append(f"cut_before [{', '.join(map(c.pin_name, c.cut_before))}]")
        if c.together:
            parts.append(f"together groups {sorted(c.together)!r}")
        if c.stage_ranges:
            parts.append(f"stage_ranges [{', '.join(dict.fromkeys(r.describe(v) for v, r in c.stage_ranges.items()))}]")
        if c.memory_budgets is not None:
            parts.append(f"memory_budgets {format_amounts(c.memory_budgets)}")
        if c.memory_in_flight is not None:
            parts.append(f"memory_in_flight {format_amounts(c.memory_in_flight)}")
        if c.capacities is not None or not parts:
            parts.append(f"capacities {list(c.capacities or [1.0] * self.k)!r}")
        most = self._most_stages()
        if most < self.k:
            stages = plural(most, "stage")
            return (f"no split of program order into {self.k} non-empty stages meets {' and '.join(parts)}: "
                    f"keeping the together groups whole leaves {plural(most - 1, 'place')} to cut, so at most "
                    f"{stages}; ask for at most {stages} or drop a group")
        return (f"no split of program order into {self.k} non-empty stages meets {' and '.join(parts)} "
                f"at once{ORDER_ADVICE}")

    def _most_stages(self) -> int:
        """The most stages program order can be cut into with every together group whole: one more
        than the cut positions no group spans (pins are such positions too)."""
        forbidden = self.line(self.respect_pins(self.graph.program())).forbidden
        return int(np.count_nonzero(~forbidden[1:-1])) + 1

    @property
    def budgets(self) -> np.ndarray:
        """The cost each stage may reach: bound x capacity."""
        return self.bound * self.rules.capacities

    def limits(self) -> list[StageLimit]:
        """Every per-stage budget a split must keep: cost, and memory when budgeted."""
        cost = StageLimit("cost", self.graph.cost, self.budgets)
        return [cost] if self.rules.memory is None else [cost, self.rules.memory]

    # -- sequences -----------------------------------------------------------------------------

    def respect_pins(self, order: np.ndarray) -> np.ndarray:
        """``order`` reordered (stably) so each pinned prefix of program order comes first and, when
        no split along it keeps the stage ranges, within each prefix by stage range.

        A pinned prefix is down-closed and both ends of a range only grow along edges, so sorting
        by them keeps the order topological, and every pin becomes a cut position of it. An order
        some split along which keeps every range (and pin and group, whatever the balance) is kept
        as it is, so ranges taken from a split of program order leave program order alone;
        otherwise the first with such a split of: sorted by the first stage each node may take, by
        the last, by a stage for each node that keeps every range and leaves no stage empty
        (``spread_stages``).
        """
        g, pins, ranges = self.graph, self.rules.pins, self.rules.ranges
        segment = np.zeros(g.n, dtype=np.int64)
        if len(pins):
            segment = np.searchsorted(pins, np.arange(g.n) - g.num_inputs, side="right")
            segment[: g.num_inputs] = 0
            order = order[np.argsort(segment[order], kind="stable")]
        if ranges is None or self.line(order).feasible(math.inf):
            return order
        for keys in ((ranges.latest, ranges.earliest), (ranges.earliest, ranges.latest)):
            candidate = order[np.lexsort((keys[0][order], keys[1][order], segment[order]))]
            if self.line(candidate).feasible(math.inf):
                return candidate
        spread = spread_stages(g, ranges, self.k)
        return order if spread is None else order[np.lexsort((spread[order], segment[order]))]

    def line(self, order: np.ndarray, groups: tuple[np.ndarray, ...] | None = None) -> Line:
        """The non-input sequence of ``order`` with this problem's limits on each part.

        ``groups`` (default: the together groups) forbid cuts inside their span along
        ``order``; the inputs' cost and memory go to the first element, as stage 0 holds them.
        """
        g, rules = self.graph, self.rules
        sequence = order[g.num_inputs :]
        groups = tuple(m for _, m in rules.groups) if groups is None else groups
        memory = None if rules.memory is None else rules.memory.along(sequence, g.num_inputs)
        ranges = None if rules.ranges is None else (rules.ranges.earliest[sequence], rules.ranges.latest[sequence])
        return Line(laid_along(g.cost, sequence, g.num_inputs), rules.capacities, rules.pins,
                    self._forbidden(order, groups), memory, ranges)

    def _forbidden(self, order: np.ndarray, groups: tuple[np.ndarray, ...]) -> np.ndarray:
        g = self.graph
        s = g.n - g.num_inputs
        spans = np.zeros(s + 2, dtype=np.int64)
        if groups:
            position = np.empty(g.n, dtype=np.int64)
            position[order] = np.arange(g.n) - g.num_inputs
            position[: g.num_inputs] = 0
            for members in groups:
                at = position[members]
                spans[at.min() + 1] += 1
                spans[at.max() + 1] -= 1
        return np.cumsum(spans[: s + 1]) > 0

    def stages_from_cuts(self, order: np.ndarray, cuts: np.ndarray) -> np.ndarray:
        """Stage per node when the non-input sequence of ``order`` is cut before each position."""
        g = self.graph
        stages = np.zeros(g.n, dtype=np.int64)
        sequence = order[g.num_inputs :]
        stages[sequence] = np.searchsorted(cuts, np.arange(len(sequence)), side="right")
        return stages

    def dp_split(self, order: np.ndarray) -> np.ndarray:
        """The contiguous split of ``order`` with the fewest boundary bytes within the budgets."""
        order = self.respect_pins(order)
        cuts = min_bytes_cuts(self.line(order), self.graph.live_bytes(order), self.bound)
        return self.stages_from_cuts(order, cuts)

    def pinned_boundary(self, stages: np.ndarray, pin: int) -> int:
        """The boundary j whose early side S_j is the prefix that ``pin`` fixes."""
        return int(stages[: self.graph.num_inputs + pin].max())

    def pinned_boundaries(self, stages: np.ndarray) -> frozenset[int]:
        """The boundaries of ``stages`` that ``cut_before`` fixes."""
        return frozenset(self.pinned_boundary(stages, p) for p in self.rules.pins.tolist())

    def violations(self, stages: np.ndarray, bounded: bool = True) -> list[str]:
        """Every rule ``stages`` breaks: validity, budgets and the hard constraints (``bounded``
        false: not the cost budget, which a strategy kept for comparison does not keep)."""
        g, k, rules = self.graph, self.k, self.rules
        found = []
        if np.any(stages[g.src] > stages[g.dst]):
            found.append("ordered: an edge runs to an earlier stage")
        if np.any(stages[: g.num_inputs] != 0) or np.any((stages < 0) | (stages >= k)):
            return found + ["range: inputs must sit in stage 0 and stages in 0..k-1"]  # the rest count per stage
        if len(np.unique(stages[g.num_inputs :])) != k:
            found.append("non-empty: some stage holds no non-input node")
        for limit in self.limits()[0 if bounded else 1:]:
            round_off = slack(max(map(limit.total, range(k))) + float(limit.budgets.sum()))
            if np.any(limit.sums(stages, k) > limit.budgets + round_off):
                found.append(f"{limit.name}: a stage exceeds its budget")
        found += [f"together {label!r}: split over stages" for label, members in rules.groups
                  if len(np.unique(stages[members])) > 1]
        if rules.ranges is not None:
            found += [f"stage_ranges {g.nodes[v]!r}: outside its stages {rules.ranges.earliest[v]}.."
                      f"{rules.ranges.latest[v]}" for v in np.flatnonzero(~rules.ranges.allows(stages)).tolist()]
        ni = g.num_inputs
        for pin in rules.pins.tolist():
            if stages[: ni + pin].max() >= stages[ni + pin :].min():
                found.append(f"cut_before {g.nodes[ni + pin]!r}: no boundary falls there")
        return found

    def is_valid(self, stages: np.ndarray) -> bool:
        return not self.violations(stages)

    # -- scores --------------------------------------------------------------------------------

    def bottleneck(self, stages: np.ndarray) -> float:
        """max_j cost_j / capacity_j: the slowest stage, relative to its speed."""
        return float((self.graph.stage_costs(stages, self.k) / self.rules.capacities).max())

    def separated(self, stages: np.ndarray) -> tuple[str, ...]:
        """Labels of ``prefer_together`` groups whose members ended up in several stages."""
        index = self.graph.index
        return tuple(
            label for label, members in self.constraints.prefer_together.items()
            if len({int(stages[index[v]]) for v in members}) > 1
        )

    def with_preferences(self) -> SplitProblem:
        """This problem plus every ``prefer_together`` group the bound can still afford.

        Groups are tried in the order given; each is kept if program order still splits
        within the bound with it and the groups kept before it. The bound stays the one
        computed without them.
        """
        kept: dict[str, frozenset[Node]] = {}
        chosen = [m for _, m in self.rules.groups]
        for label, members in self.rules.preferences:
            if self.line(self.graph.program(), tuple(chosen + [members])).feasible(self.bound):
                kept[label] = self.constraints.prefer_together[label]
                chosen.append(members)
        stricter = copy.copy(self)
        stricter.constraints = self.constraints.with_together(kept)
        stricter.rules = resolve(self.graph, stricter.constraints, self.k)
        return stricter

    def assignment(self, stages: np.ndarray) -> Mapping[Node, int]:
        return self.graph.assignment(stages)
