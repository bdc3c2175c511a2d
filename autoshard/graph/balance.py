"""Splitting one fixed sequence of nodes into k contiguous, non-empty parts.

``min_bottleneck`` finds the best achievable slowest stage; ``min_bytes_partition`` then spends
the tolerance above it on moving cuts to where few bytes are live. Both compare segment sums the
same way (``_Prefix.fits``), so a bound one of them proves feasible is feasible for the other.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from itertools import accumulate
from typing import Any, Sequence

import networkx as nx

from autoshard.errors import InfeasibleSplitError, InvalidArgumentError
from autoshard.graph.invariants import check_order, check_stage_count, is_number
from autoshard.graph.linearize import Order, is_input, is_output, non_inputs

#: Relative round-off allowance for sums: prefix differences are not exact in floating point.
REL_EPS = 1e-9


def slack(scale: float) -> float:
    """The round-off allowance for comparing sums whose magnitude is at most ``scale``."""
    return REL_EPS * scale


class _Prefix:
    """Prefix sums of the weights; every segment comparison goes through ``fits``."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.sums = list(accumulate((float(w) for w in weights), initial=0.0))
        self.slack = slack(self.sums[-1])

    def segment(self, start: int, end: int) -> float:
        return self.sums[end] - self.sums[start]

    def fits(self, start: int, end: int, bound: float) -> bool:
        """Whether weights[start:end] sum to at most ``bound`` (up to round-off)."""
        return self.sums[end] <= self.sums[start] + bound + self.slack

    def furthest(self, start: int, bound: float) -> int:
        """The largest ``end`` with ``fits(start, end, bound)``; the same test, by bisection."""
        return bisect_right(self.sums, self.sums[start] + bound + self.slack) - 1

    def greedy_ends(self, bound: float, parts: int) -> list[int]:
        """Ends of the first ``parts`` greedy parts, each as long as ``bound`` allows.

        Needs ``bound`` >= every weight, or a part could not hold even one element.
        """
        ends = [0]
        n = len(self.sums) - 1
        while len(ends) <= parts and ends[-1] < n:
            ends.append(self.furthest(ends[-1], bound))
        return ends[1:]


def _check_split_request(weights: Sequence[Any], k: Any) -> None:
    check_stage_count(k, len(weights), f"the sequence has {len(weights)} weights")
    for i, w in enumerate(weights):
        if not is_number(w) or not math.isfinite(w) or w < 0:
            raise InvalidArgumentError(f"weight {i} is {w!r}; weights must be finite and >= 0")


def min_bottleneck(weights: Sequence[float], k: int) -> float:
    """The least possible largest part sum over splits into exactly k non-empty contiguous parts.

    Exact: every probe B is a lower bound on the optimum, so the first feasible probe is it.
    The start max(total / k, max weight) is a lower bound. When greedy parts under B cannot
    cover the sequence in k parts, any bound below min(part sum + the element after it) over
    those k parts leaves every part's end where it was, so that minimum is the next probe.
    Each probe costs O(k log n) and moves some greedy end strictly right.
    """
    _check_split_request(weights, k)
    prefix = _Prefix(weights)
    bound = max(prefix.sums[-1] / k, max(float(w) for w in weights))
    while True:
        ends = prefix.greedy_ends(bound, k)
        if ends[-1] == len(weights):
            return bound
        starts = [0] + ends[:-1]
        bound = min(prefix.segment(s, e + 1) for s, e in zip(starts, ends))


def live_bytes_at_cuts(dag: nx.DiGraph, order: Order) -> list[float]:
    """Bytes live across each cut of the non-input sequence of ``order``, in O(n + m).

    Entry c (0..n) is the cut just before the c-th non-input node. A value is live across it
    when produced before it (inputs count as produced before cut 0) and read at or after it,
    or when it is a model output. Each value adds its bytes over the span from its producer to
    its last reader, swept with a difference array.
    """
    check_order(dag, order)
    sequence = non_inputs(dag, order)
    position = {v: -1 for v in order if is_input(dag, v)}
    position.update((v, i) for i, v in enumerate(sequence))
    n = len(sequence)
    delta = [0.0] * (n + 2)
    for u in order:
        born = position[u]
        readers = (position[v] for v in dag.successors(u))
        last = n if is_output(dag, u) else max(readers, default=born)
        if last > born:
            delta[born + 1] += float(dag.nodes[u]["bytes"])
            delta[last + 1] -= float(dag.nodes[u]["bytes"])
    return list(accumulate(delta[: n + 1]))


Score = tuple[float, float]
_UNREACHABLE: Score = (math.inf, math.inf)


def _check_dp_request(weights: Sequence[float], live: Sequence[float], k: int, bound: float) -> None:
    _check_split_request(weights, k)
    if len(live) != len(weights) + 1:
        raise InvalidArgumentError(
            f"live must have one entry per cut (len(weights) + 1 = {len(weights) + 1}), "
            f"got {len(live)}"
        )
    if not is_number(bound) or math.isnan(bound) or bound < 0:
        raise InvalidArgumentError(f"the bound must be a number >= 0, got {bound!r}")


def _add(a: Score, b: Score) -> Score:
    return (a[0] + b[0], a[1] + b[1])


class _Layer:
    """One DP layer: for every prefix end c, the best score of splitting weights[:c] in j parts.

    A score is (live bytes at the cuts, distance of the cuts from their ideal balanced prefix
    sums). The second term only breaks ties in bytes, toward balanced stages: equal-sized values
    are the norm in real models, so ties are common.
    """

    def __init__(self, size: int) -> None:
        self.score = [_UNREACHABLE] * size
        self.parent = [-1] * size


def _next_layer(prev: _Layer, prefix: _Prefix, cut_score: list[Score], bound: float) -> _Layer:
    """Extend every (j-1)-part split by one part ending at c, with a sliding-window minimum.

    The last part is weights[c':c] for c' in [lo(c), c - 1], where lo(c) is the first start
    that keeps the part within ``bound``; prefix sums never decrease, so both window ends only
    move right. The deque keeps window indices with strictly increasing candidate scores, so
    ties go to the earliest cut.
    """
    size = len(prev.score)
    layer = _Layer(size)
    window: deque[tuple[Score, int]] = deque()
    lo = 0
    for c in range(1, size):
        start = c - 1
        if prev.score[start] != _UNREACHABLE:
            value = _add(prev.score[start], cut_score[start])
            while window and window[-1][0] > value:
                window.pop()
            window.append((value, start))
        while not prefix.fits(lo, c, bound):
            lo += 1
        while window and window[0][1] < lo:
            window.popleft()
        if window:
            layer.score[c], layer.parent[c] = window[0]
    return layer


def min_bytes_partition(
    weights: Sequence[float], live: Sequence[float], k: int, bound: float
) -> list[int]:
    """The k-1 cut positions that minimise the total ``live`` bytes at the cuts.

    Splits ``weights`` into exactly k non-empty contiguous parts, each summing to at most
    ``bound``; cut c falls just before weights[c] and costs live[c]. Ties in bytes go to cuts
    nearest their balanced positions, then to the earliest cut. O(n k) time and memory.
    Raises ``InfeasibleSplitError`` when no split fits the bound.
    """
    _check_dp_request(weights, live, k, bound)
    prefix = _Prefix(weights)
    n = len(weights)
    layers = [_Layer(n + 1)]
    layers[0].score[0] = (0.0, 0.0)
    for j in range(1, k + 1):
        ideal = prefix.sums[-1] * (j - 1) / k
        cut_score = [(float(live[c]), abs(prefix.sums[c] - ideal)) for c in range(n + 1)]
        cut_score[0] = (0.0, 0.0)
        layers.append(_next_layer(layers[-1], prefix, cut_score, bound))
    if layers[k].score[n] == _UNREACHABLE:
        raise InfeasibleSplitError(
            f"no split into {k} contiguous non-empty parts keeps every part within {bound}"
        )
    cuts = [n]
    for layer in reversed(layers[2:]):
        cuts.append(layer.parent[cuts[-1]])
    return cuts[:0:-1]
