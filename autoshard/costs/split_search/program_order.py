"""The exact budgeted split of an order: every split into k contiguous stages, each judged whole.

The budgeted splitter sums per-node parts and re-splits under tightened budgets, a heuristic that
can miss a split the whole count accepts (a stage also holds its received and sent values, one
backward, ...). ``ProgramOrderSplits`` checks every split of the order into k non-empty contiguous
stages, each stage judged by the whole count (``MemoryCount.stages_in_order``), so it says whether any
fits the budgets. Pruned by what a stage holds at least (``MemoryCount.floor()``: per-node parts and the
values crossing its cuts, cheap from prefix sums; the splitter's per-node sums are no floor, a stage
may free a saved output it sends a copy of): only stages whose floor fits and whose rest can still
fit are judged whole, each (stage, first node, end) at most once, at most ``JUDGEMENT_LIMIT`` in all.

The order is the one the stages run in (``SplitRequest.order``: program order unless ``linearize``
chose another), so every split it makes is one the splitter could. The constraints a split must
keep are kept: no-split groups (``together``) in one stage, a stage starting at each ``cut_before``
node, pinned nodes (``stage_ranges``) in their stages. Shared weights kept together are a
preference, not a constraint: a split found may separate a tie, its weight counted in every stage
holding it (the whole count's) and named in ``SplitInfo.separated``. Only a count with a floor is
served (``serves``: the training-memory model; not a budget on a cost model summed per node).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AbstractSet, Collection, Mapping, Sequence

import networkx as nx
import numpy as np

from autoshard.costs.memory import StageFloor
from autoshard.costs.split_search.request import MemoryCount, SplitRequest
from autoshard.graph.constraints import StageRange
from autoshard.graph.indexed import is_input
from autoshard.graph.linearize import non_inputs
from autoshard.graph.partition import Cuts

#: The most stages one search judges whole (each a ``MemoryCount.stages_in_order`` count) before it gives up:
#: 2,000 while a judgment counted every stage of the split; one stage now, 4x cheaper at k = 4.
JUDGEMENT_LIMIT = 6_000


class SearchGaveUp(Exception):
    """More than ``JUDGEMENT_LIMIT`` stages would have been judged: the answer is unknown."""


@dataclass(frozen=True)
class Scaled:
    """A split of the order (``assignment``) fitting ``scale`` x the budgets, the least scale met."""

    scale: float
    assignment: dict[str, int]
    exact: bool


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])


class ProgramOrderSplits:
    """The splits of ``order`` into ``k`` contiguous non-empty stages (model inputs in stage 0) that
    keep the constraints, searched for one whose every stage fits its budget by ``memory``.
    ``costs`` (per node, with ``speeds`` per stage) orders the search: the stage ends nearest an even
    share of the cost are tried first, so the split found is balanced where the budgets allow."""

    def __init__(
        self, dag: nx.DiGraph, order: Sequence[str], k: int, memory: MemoryCount, *,
        together: Collection[AbstractSet[str]] = (), cut_before: Collection[str] = (),
        stage_ranges: Mapping[str, StageRange] | None = None,
        costs: Mapping[str, float] | None = None, speeds: Sequence[float] | None = None,
    ) -> None:
        self.k, self.memory = k, memory
        self.inputs = [v for v in order if is_input(dag, v)]
        self.rest = non_inputs(dag, order)
        self.stage_total = memory.stages_in_order(self.inputs, self.rest)
        n = len(self.rest)
        position = {v: i for i, v in enumerate(self.rest)}
        if memory.floor is None:
            raise ValueError(f"memory count {memory.name!r} gives no floor to prune the search by")
        floor = memory.floor()
        self.held = _prefix([floor.held.get(v, 0.0) for v in self.rest])
        self.gradients = _prefix([floor.gradients.get(v, 0.0) for v in self.rest])
        self.steady_gradients = [bool(floor.steady_gradients and floor.steady_gradients[j]) for j in range(k)]
        self.kept = _prefix([floor.kept.get(v, 0.0) for v in self.rest])
        self.in_flight = np.asarray(memory.in_flight or (1.0,) * k, dtype=float)
        self.received, self.sent = self._crossing(dag, floor)
        self.cuttable = np.ones(n + 1, dtype=bool)  # a cut before rest[c] splits no group
        for group in together:
            places = [position.get(v, -1) for v in group]  # an input sits before every node
            self.cuttable[min(places) + 1:max(places) + 1] = False
        required = sorted(position[v] for v in cut_before if position.get(v, 0) > 0)
        # the furthest a stage starting at rest[a] may end: the first required cut after a
        self.last_end = np.array([next((c for c in required if c > a), n) for a in range(n + 1)])
        self.barred = np.zeros((k, n + 1))  # barred[j][i]: nodes of rest[:i] pinned away from stage j
        for j in range(k):
            pinned = [r is not None and not r.first <= j <= r.last for r in map((stage_ranges or {}).get, self.rest)]
            self.barred[j] = _prefix(pinned)
        self.cost = _prefix([(costs or {}).get(v, 1.0) for v in self.rest])
        self.speeds = np.asarray(speeds or (1.0,) * k, dtype=float)
        self.totals: dict[tuple[int, int, int], float] = {}  # kept across searches: budgets change, totals not
        self.judged = 0

    def _crossing(self, dag: nx.DiGraph, floor: StageFloor) -> tuple[np.ndarray, ...]:
        """Per stage j and cut c (before ``rest[c]``), what the values crossing the cut add at least to
        stage j when it starts there (``received[j][c]``) and ends there (``sent[j][c]``), from each value's
        span of cuts (``graph.partition.Cuts``, as the whole count finds them); cut 0 brings the model
        inputs, cut n takes the outputs."""
        n, k = len(self.rest), self.k
        received, sent = np.zeros((k, n + 2)), np.zeros((k, n + 2))
        cuts = Cuts(dag, self.inputs, self.rest)
        for v, first, last in zip(cuts.values, cuts.first + 1, np.minimum(cuts.last, n - 1)):
            for j in range(k) if first <= last else ():
                for per_cut, per_value in ((received[j], floor.received[j]), (sent[j], floor.sent[j])):
                    per_cut[first] += per_value.get(v, 0.0)
                    per_cut[last + 1] -= per_value.get(v, 0.0)
        received, sent = np.cumsum(received, axis=1)[:, :n + 1], np.cumsum(sent, axis=1)[:, :n + 1]
        for j in range(k):
            received[j][0] = sum(floor.received[j].get(v, 0.0) for v in self.inputs)
            sent[j][n] = sum(floor.sent[j].get(v, 0.0) for v in dag if dag.nodes[v].get("output"))
        return received, sent

    def ends(self, j: int, a: int, budget: float) -> np.ndarray:
        """Where stage j starting at ``rest[a]`` may end (index b: it runs ``rest[a:b]``): the
        constraints kept and its floor within ``budget``, in its steady state and as the step ends."""
        b = np.arange(len(self.rest) + 1)
        held, gradients = self.held - self.held[a], self.gradients - self.gradients[a]
        steady = (held + (gradients if self.steady_gradients[j] else 0.0)
                  + self.in_flight[j] * (self.kept - self.kept[a]) + self.received[j][a] + self.sent[j])
        ending = held + gradients + self.received[j][a] + (self.sent[j] if j < self.k - 1 else 0.0)
        return ((b > a) & (b <= self.last_end[a]) & self.cuttable & (self.barred[j] == self.barred[j][a])
                & (steady <= budget) & (ending <= budget))

    def total(self, j: int, a: int, b: int) -> float:
        """Stage j's whole memory when it runs ``rest[a:b]`` (``MemoryCount.stages_in_order``)."""
        key = (j, a, b)
        if key not in self.totals:
            if self.judged >= JUDGEMENT_LIMIT:
                raise SearchGaveUp
            self.judged += 1
            self.totals[key] = self.stage_total(j, a, b)
        return self.totals[key]

    def fitting(self, budgets: Sequence[float]) -> dict[str, int] | None:
        """A split whose every stage j fits ``budgets[j]``, as an assignment in ``order``, or None when
        none does. Raises ``SearchGaveUp`` past ``JUDGEMENT_LIMIT`` stages judged."""
        self.judged = 0
        return self._fitting(budgets)

    def least_scaled(self, budgets: Sequence[float], low: float, high: float, steps: int,
                     limit: int = JUDGEMENT_LIMIT) -> Scaled | None:
        """The least scale s in (``low``, ``high``], to (high - low) / 2 ** ``steps``, at which a split
        fits every stage j within s x ``budgets[j]``, found by halving, with that split; None when none
        fits at ``high`` (or the search gave up first). What a refused budget names: the closest split.
        Past ``limit`` stages judged in all, the least met so far (``exact`` False)."""
        self.judged = JUDGEMENT_LIMIT - limit  # the judgments of every halving count against ``limit``
        found = None
        try:
            met = self._fitting([high * b for b in budgets])
            if met is None:
                return None
            found = Scaled(high, met, exact=True)
            for _ in range(steps):
                middle = (low + found.scale) / 2
                met = self._fitting([middle * b for b in budgets])
                if met is None:
                    low = middle
                else:
                    found = Scaled(middle, met, exact=True)
        except SearchGaveUp:
            return None if found is None else dataclasses.replace(found, exact=False)
        return found

    def _fitting(self, budgets: Sequence[float]) -> dict[str, int] | None:
        n, k = len(self.rest), self.k
        can = np.zeros((k + 1, n + 1), dtype=bool)  # can[j][a]: stages j.. may fit rest[a:] by their sums
        can[k][n] = True
        for j in range(k - 1, -1, -1):
            for a in range(j, n) if j else (0,):
                can[j][a] = bool(np.any(self.ends(j, a, budgets[j]) & can[j + 1]))
        failed: set[tuple[int, int]] = set()

        def search(j: int, a: int) -> tuple[int, ...] | None:
            if j == k:
                return ()
            if (j, a) in failed or not can[j][a]:
                return None
            share = self.cost[a] + (self.cost[n] - self.cost[a]) * self.speeds[j] / self.speeds[j:].sum()
            candidates = np.flatnonzero(self.ends(j, a, budgets[j]) & can[j + 1])
            for b in sorted(candidates.tolist(), key=lambda b: abs(self.cost[b] - share)):
                if self.total(j, a, b) <= budgets[j]:
                    rest = search(j + 1, b)
                    if rest is not None:
                        return (b, *rest)
            failed.add((j, a))
            return None

        cuts = search(0, 0)
        if cuts is None:
            return None
        assignment = dict.fromkeys(self.inputs, 0)
        for j, (a, b) in enumerate(zip((0, *cuts), cuts)):
            assignment.update(dict.fromkeys(self.rest[a:b], j))
        return assignment


def serves(request: SplitRequest) -> bool:
    """Whether the exact search can judge ``request``'s budgets: a memory count with a floor to prune
    by (the training-memory model's; a count summed from another cost model has none)."""
    return bool(request.max_memory) and request.memory is not None and request.memory.floor is not None


def splits_in_order(request: SplitRequest) -> ProgramOrderSplits:
    """The splits of ``request.order`` into contiguous stages that keep its constraints, judged by its
    memory count; the stage ends nearest an even share of its cost (shared weights at their first
    reader) per capacity are tried first."""
    return ProgramOrderSplits(
        request.dag, request.order, request.k, request.memory, together=request.together.values(),
        cut_before=request.cut_before, stage_ranges=request.stage_ranges,
        costs=request.node_costs(frozenset()), speeds=request.each_stage(request.capacities or (1.0,)))
