"""Splitting one fixed sequence of nodes into k contiguous, non-empty parts.

``Line`` is a sequence with its per-part limits: a cost budget per stage (bound x capacity),
optional memory budgets, positions that must be cuts (pins) and positions that must not be
(inside a together group), and the parts each element may join (its stage range).
``min_bottleneck_of`` finds the best achievable bound and
``min_bytes_cuts`` spends the tolerance above it on cuts where few bytes are live. Every
segment test goes through ``Line.starts``, so a bound one of them proves feasible is feasible
for the other.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from itertools import accumulate
from typing import Any, Sequence

import networkx as nx
import numpy as np

from autoshard.errors import InfeasibleSplitError, InvalidArgumentError
from autoshard.graph.indexed import IndexedDag
from autoshard.graph.invariants import check_order, check_stage_count, is_number
from autoshard.graph.limits import StageLimit, slack

#: Relative width at which the bisection for a constrained bottleneck stops.
BISECTION_PRECISION = 1e-12


def _check_weights(weights: Sequence[Any], k: Any) -> int:
    k = check_stage_count(k, len(weights), f"the sequence has {len(weights)} weights")
    for i, w in enumerate(weights):
        if not is_number(w) or not math.isfinite(w) or w < 0:
            raise InvalidArgumentError(f"weight {i} is {w!r}; weights must be finite and >= 0")
    return k


class Line:
    """A sequence to cut into k parts, with the limits each part must respect.

    ``capacities[j]`` scales the cost budget of part j; ``memory`` (laid along the sequence)
    limits each part's memory; a cut must fall at every position in ``pins`` and at no
    position where ``forbidden`` is true; element i may only join parts ``earliest[i]`` to
    ``latest[i]`` (``ranges``, laid along the sequence). Position c is the cut before weights[c].
    """

    def __init__(
        self,
        weights: np.ndarray,
        capacities: np.ndarray,
        pins: np.ndarray | None = None,
        forbidden: np.ndarray | None = None,
        memory: StageLimit | None = None,
        ranges: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.n = len(weights)
        self.k = len(capacities)
        self.prefix = np.concatenate(([0.0], np.cumsum(weights, dtype=float)))
        self.slack = slack(float(self.prefix[-1]))
        self.capacities = capacities
        self.pins = np.zeros(0, dtype=np.int64) if pins is None else pins
        self.forbidden = np.zeros(self.n + 1, dtype=bool) if forbidden is None else forbidden
        self.memory = memory
        floors = np.concatenate(([0], self.pins))
        self.pin_floor = floors[np.searchsorted(self.pins, np.arange(1, self.n + 1), side="left")]
        self.range_floors = None if ranges is None else _range_floors(*ranges, self.k)

    def starts(self, j: int, bound: float) -> np.ndarray:
        """For each end c in 1..n, the first start c' at which part j = [c', c) fits ``bound``.

        A part fits when its cost is at most bound x capacity_j (up to round-off), its memory
        within budget, it contains no pin and each of its elements may join part j.
        """
        reach = (self.prefix + bound * self.capacities[j]) + self.slack
        first = np.searchsorted(reach, self.prefix[1:], side="left")
        if self.memory is not None:
            prefix = self.memory.prefix(j)
            budget = (prefix + self.memory.budgets[j]) + slack(float(prefix[-1]))
            first = np.maximum(first, np.searchsorted(budget, prefix[1:], side="left"))
        first = np.maximum(first, self.pin_floor)
        return first if self.range_floors is None else np.maximum(first, self.range_floors[j])

    def cut_allowed(self) -> np.ndarray:
        """Whether each position 0..n may end a part that is not the last."""
        allowed = ~self.forbidden
        allowed[self.n] = False
        return allowed

    def witness(self, bound: float) -> np.ndarray | None:
        """Cut positions of some split into exactly k parts within every limit, or None."""
        reach = np.zeros(self.n + 1, dtype=bool)
        reach[0] = True
        allowed = self.cut_allowed()
        ends = np.arange(1, self.n + 1)
        layers, firsts = [], []
        for j in range(self.k):
            count = np.concatenate(([0], np.cumsum(reach)))
            first = self.starts(j, bound)
            layers.append(reach)
            firsts.append(first)
            reach = np.zeros(self.n + 1, dtype=bool)
            reach[1:] = count[ends] > count[np.minimum(first, ends)]
            if j < self.k - 1:
                reach &= allowed
        if not reach[self.n]:
            return None
        cuts = [self.n]
        for reach, first in zip(reversed(layers[1:]), reversed(firsts[1:])):
            end = cuts[-1]
            cuts.append(int(first[end - 1] + np.flatnonzero(reach[first[end - 1] : end])[0]))
        return np.array(cuts[:0:-1], dtype=np.int64)

    def feasible(self, bound: float) -> bool:
        """Whether some split into exactly k parts respects every limit under ``bound``."""
        return self.witness(bound) is not None

    def achieved(self, cuts: np.ndarray) -> float:
        """The largest part cost / capacity of the split at ``cuts``."""
        bounds = np.concatenate(([0], cuts, [self.n]))
        return float((np.diff(self.prefix[bounds]) / self.capacities).max())


def _range_floors(earliest: np.ndarray, latest: np.ndarray, k: int) -> np.ndarray:
    """Per part j and end c in 1..n, the first start that leaves out every element before c
    that may not join part j (one past the last such element)."""
    after = np.arange(1, len(earliest) + 1)
    floors = np.empty((k, len(earliest)), dtype=np.int64)
    for j in range(k):
        barred = (earliest > j) | (latest < j)
        floors[j] = np.maximum.accumulate(np.where(barred, after, 0)) if len(after) else after
    return floors


def min_bottleneck(weights: Sequence[float], k: int) -> float:
    """The least possible largest part sum over splits into exactly k non-empty contiguous parts.

    Exact: every probe B is a lower bound on the optimum, so the first feasible probe is it.
    The start max(total / k, max weight) is a lower bound. When greedy parts under B cannot
    cover the sequence in k parts, any bound below min(part sum + the element after it) over
    those k parts leaves every part's end where it was, so that minimum is the next probe.
    Each probe costs O(k log n) and moves some greedy end strictly right. A probe is accepted
    up to a few units in the last place of the total (the float error of a prefix difference,
    enough for the next probe to move an end), not up to ``slack``: with that allowance the
    greedy parts could cover under a probe that no split reaches exactly and take tiny elements
    along, giving up to the allowance above the optimum ([20, 3e-8, 3e-8, 20, 1e-8], k=3 gave
    20 + 4e-8 where 20 + 1e-8 is reachable), and the splitters add the allowance again on top.
    The answer is what the greedy parts reach, never a bound below any split.
    """
    k = _check_weights(weights, k)
    sums = list(accumulate((float(w) for w in weights), initial=0.0))
    round_off = 4 * math.ulp(sums[-1])
    bound = max(sums[-1] / k, max(float(w) for w in weights))
    while True:
        ends = _greedy_ends(sums, k, bound, round_off)
        if ends[-1] == len(weights):
            return _largest_part(sums, ends)
        bound = min(sums[e + 1] - sums[s] for s, e in zip([0] + ends[:-1], ends))


def _greedy_ends(sums: list[float], k: int, bound: float, round_off: float) -> list[int]:
    """The ends of at most k greedy parts, each as long as it can be within ``bound`` + round-off."""
    ends, start = [], 0
    while len(ends) < k and start < len(sums) - 1:
        start = bisect_right(sums, (sums[start] + bound * 1.0) + round_off) - 1
        ends.append(start)
    return ends


def _largest_part(sums: list[float], ends: list[int]) -> float:
    return max(sums[e] - sums[s] for s, e in zip([0] + ends[:-1], ends))


def min_bottleneck_of(line: Line) -> float:
    """The least bound under which ``line`` splits into k parts within all its limits.

    Exact (``min_bottleneck``) for plain lines; otherwise a bisection to a relative width of
    ``BISECTION_PRECISION`` between the lower bound total / sum(capacities) and the bound at
    which every part could hold everything, reporting what the split found there achieves
    (so the bound is a real bottleneck, not a point inside the round-off allowance). Its probes
    hold costs to float resolution, not to ``slack``, as ``min_bottleneck``'s do: within the
    allowance the lower bound can pass where no split reaches it, and the split found there can
    end up to the allowance above the optimum. Raises ``InfeasibleSplitError`` when even that
    bound fails: then pins, forbidden cuts or memory budgets cannot be met.
    """
    weights = np.diff(line.prefix)
    plain = (not len(line.pins) and not line.forbidden.any() and line.memory is None
             and line.range_floors is None and bool(np.all(line.capacities == 1.0)))
    if plain:
        return min_bottleneck(weights.tolist(), line.k)
    total = float(line.prefix[-1])
    low = total / float(line.capacities.sum())
    high = total / float(line.capacities.min())
    if not line.feasible(high):
        raise InfeasibleSplitError("no split meets the constraints whatever the balance")
    line = copy.copy(line)
    line.slack = 4 * math.ulp(total)
    if not line.feasible(low):
        while high - low > BISECTION_PRECISION * high:
            middle = (low + high) / 2
            if line.feasible(middle):
                high = middle
            else:
                low = middle
        low = high
    return line.achieved(line.witness(low))


def live_bytes_at_cuts(dag: nx.DiGraph, order: Sequence[Any]) -> list[float]:
    """Bytes live across each cut of the non-input sequence of ``order``, in O(n + m).

    See ``IndexedDag.live_bytes``; ``order`` is a topological order of ``dag``'s nodes.
    """
    check_order(dag, order)
    g = IndexedDag(dag)
    return g.live_bytes(np.array([g.index[v] for v in order], dtype=np.int64)).tolist()


class _RangeMin:
    """Sparse table over integer ranks: the position of the least rank in any range, in O(1)."""

    def __init__(self, rank: np.ndarray) -> None:
        size = len(rank)
        table = [np.arange(size)]
        span = 1
        while 2 * span <= size:
            prev = table[-1]
            a, b = prev[: size - 2 * span + 1], prev[span : size - span + 1]
            table.append(np.where(rank[a] <= rank[b], a, b))
            span *= 2
        self.rank = rank
        self.table = table

    def argmin(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Per query, the position of the least rank in [lo, hi] (inclusive, lo <= hi)."""
        level = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
        out = np.empty(len(lo), dtype=np.int64)
        for power in np.unique(level).tolist():
            pick = level == power
            a = self.table[power][lo[pick]]
            b = self.table[power][hi[pick] - (1 << power) + 1]
            out[pick] = np.where(self.rank[a] <= self.rank[b], a, b)
        return out


def min_bytes_cuts(line: Line, live: np.ndarray, bound: float) -> np.ndarray:
    """The k-1 cut positions that minimise the total ``live`` bytes at the cuts.

    Every part fits its limits under ``bound`` (see ``Line.starts``); cut c costs live[c].
    Ties in bytes go to cuts nearest their balanced positions (prefix sums proportional to the
    capacities), then to the earliest cut. Layer by layer, the best previous cut in each
    part's window of starts comes from a sparse-table range minimum: O(k n log n), vectorised.
    Raises ``InfeasibleSplitError`` when no split fits.
    """
    n, k = line.n, line.k
    total = float(line.prefix[-1])
    share = np.cumsum(line.capacities) / line.capacities.sum()
    allowed = line.cut_allowed()
    sent = np.full(n + 1, np.inf)
    sent[0] = 0.0
    skew = np.zeros(n + 1)
    parents = []
    ends = np.arange(1, n + 1)
    for j in range(k):
        cand_sent, cand_skew = sent, skew
        if j:
            cand_sent = sent + live
            cand_skew = skew + np.abs(line.prefix - total * share[j - 1])
        rank = np.empty(n + 1, dtype=np.int64)
        rank[np.lexsort((np.arange(n + 1), cand_skew, cand_sent))] = np.arange(n + 1)
        first = line.starts(j, bound)
        usable = first <= ends - 1
        best = np.full(n + 1, -1, dtype=np.int64)
        best[1:][usable] = _RangeMin(rank).argmin(first[usable], ends[usable] - 1)
        reached = best >= 0
        reached[reached] = np.isfinite(cand_sent[best[reached]])
        if j < k - 1:
            reached &= allowed
        sent = np.where(reached, cand_sent[best], np.inf)
        skew = np.where(reached, cand_skew[best], 0.0)
        parents.append(best)
    if not np.isfinite(sent[n]):
        raise InfeasibleSplitError(
            f"no split into {k} contiguous non-empty parts keeps every part within its limits "
            f"(bound {bound:g})")
    cuts = [n]
    for best in reversed(parents[1:]):
        cuts.append(int(best[cuts[-1]]))
    return np.array(cuts[:0:-1], dtype=np.int64)


def min_bytes_partition(
    weights: Sequence[float], live: Sequence[float], k: int, bound: float
) -> list[int]:
    """``min_bytes_cuts`` for a plain sequence: parts within ``bound``, fewest live bytes at cuts.

    Splits ``weights`` into exactly k non-empty contiguous parts; cut c falls just before
    weights[c] and costs live[c]. Raises ``InfeasibleSplitError`` when no split fits.
    """
    k = _check_weights(weights, k)
    if len(live) != len(weights) + 1:
        raise InvalidArgumentError(
            f"live must have one entry per cut (len(weights) + 1 = {len(weights) + 1}), got {len(live)}")
    if not is_number(bound) or math.isnan(bound) or bound < 0:
        raise InvalidArgumentError(f"the bound must be a number >= 0, got {bound!r}")
    line = Line(np.array(weights, dtype=float), np.ones(k))
    return min_bytes_cuts(line, np.array(live, dtype=float), float(bound)).tolist()
