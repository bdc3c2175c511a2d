"""Move stage boundaries off any single order with minimum s-t cuts.

A DP over one order can only cut that order into pieces; the cheapest boundary may need nodes
that the order interleaves. Boundary j is the down-closed set S_j of nodes in stages <= j, and
the values crossing it depend on S_j alone, so each boundary can be re-chosen on its own: any
down-closed S with S_{j-1} ⊆ S ⊆ S_{j+1} keeps the partition ordered, and a minimum cut of a
flow network finds the S that sends the fewest bytes.

A plain minimum cut ignores balance (it usually empties a stage), so each cut runs in a
*corridor*: a head of the two stages pinned to stage j and a tail pinned to stage j+1, each
just heavy enough that every S between them keeps both stages within their budgets (cost and
memory). Corridors come from several topological orders. Together groups move as one node.
A move is kept only if the total boundary bytes strictly drop, so refinement never makes a
partition worse. Boundaries fixed by ``cut_before`` are never moved; a node whose stage range
(``stage_ranges``) allows only one of the two stages is held on that side.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from autoshard.graph.constraints import StageBounds
from autoshard.graph.flow import Network
from autoshard.graph.indexed import IndexedDag
from autoshard.graph.limits import StageLimit, slack

SOURCE, SINK = -1, -2
#: Sweeps over the boundaries whose neighbours moved; each move strictly lowers the bytes.
_MAX_PASSES = 8


class Budgets:
    """Per-stage limits a refined partition must keep: cost, and memory when budgeted."""

    def __init__(self, g: IndexedDag, limits: Sequence[StageLimit], k: int) -> None:
        self.g = g
        self.limits = [(limit, [limit.round_off(j) for j in range(k)]) for limit in limits]

    def within(self, stages: np.ndarray, j: int, k: int) -> bool:
        """Whether stages j and j+1 respect every limit."""
        for limit, round_off in self.limits:
            sums = limit.sums(stages, k)
            if any(sums[i] > limit.budgets[i] + round_off[i] for i in (j, j + 1)):
                return False
        return True

    def shortest(self, region: np.ndarray, stage: int, fixed: bool) -> int:
        """How many leading nodes of ``region`` must leave it so the rest fits ``stage``.

        At least one, so the stage the leading nodes go to is never empty; ``fixed`` adds the
        inputs, which always sit in stage 0.
        """
        count = 1
        for limit, round_off in self.limits:
            weights = limit.weights(stage)
            along = np.cumsum(weights[region])
            extra = float(weights[: self.g.num_inputs].sum()) if fixed else 0.0
            need = float(along[-1]) + extra - limit.budgets[stage] - round_off[stage]
            count = max(count, int(np.searchsorted(along, need, side="left")) + 1)
        return count


class _Corridor:
    """Boundary j between a head pinned to stage j and a tail pinned to stage j+1.

    Each free node (or together group, contracted) is a network node. A value becomes a node
    with an edge producer -> value of capacity bytes and uncapacitated edges to each reader,
    so it is paid once however many readers sit on the far side. Uncapacitated edges reader ->
    producer keep the source side down-closed.
    """

    def __init__(self, g: IndexedDag, stages: np.ndarray, j: int, head: np.ndarray, tail: np.ndarray,
                 groups: Sequence[np.ndarray], group_of: dict[int, int], bounds: StageBounds | None = None) -> None:
        self.g, self.stages, self.j = g, stages, j
        region = (stages == j) | (stages == j + 1)
        region[: g.num_inputs] = False
        held = bounds is not None and (np.any(bounds.earliest[head] > j) or np.any(bounds.latest[tail] <= j))
        if bounds is not None:  # nodes whose range allows one of the two stages join its end
            head = np.union1d(head, np.flatnonzero(region & (bounds.latest <= j)))
            tail = np.union1d(tail, np.flatnonzero(region & (bounds.earliest > j)))
        self.head, self.tail = head, tail
        self.side = np.where(stages <= j, SOURCE, SINK)
        self.side[: g.num_inputs] = SOURCE
        self.side[head] = SOURCE
        self.side[tail] = SINK
        region[head] = False
        region[tail] = False
        self.free = np.flatnonzero(region)
        self.side[self.free] = self.free
        self.feasible = not held and self._contract(groups, group_of)

    def _contract(self, groups: Sequence[np.ndarray], group_of: dict[int, int]) -> bool:
        """Give each grouped free node its group's side; False when a group straddles the pins.

        Every group with a member in either stage counts: a pinned member fixes its side too.
        """
        moving = np.concatenate((self.free, self.head, self.tail)).tolist()
        touched = sorted({group_of[v] for v in moving if v in group_of})
        for group in touched:
            members = groups[group]
            sides = self.side[members]
            free = members[sides >= 0]
            pinned = set(sides[sides < 0].tolist())
            if pinned == {SOURCE, SINK}:
                return False
            self.side[free] = pinned.pop() if pinned else free[0]
        return True

    def network(self) -> Network | None:
        """The flow network, or None when a together group needs a node on both sides."""
        g, side = self.g, self.side.tolist()
        net = Network()
        candidates = set(self.free.tolist())
        for v in self.free.tolist():
            candidates.update(g.pred[v])
        for u in sorted(candidates):
            producer = side[u]
            readers = sorted({side[v] for v in g.succ[u]} - {producer})
            for r in readers:  # a reader on the source side pulls its producer there
                if r == SOURCE and producer == SINK:
                    return None
                if r != SINK and producer != SOURCE:
                    net.add(r, producer)
            if g.output[u] and SINK not in readers and producer != SINK:
                readers.append(SINK)
            if producer == SINK or not readers or (producer == SOURCE and SINK in readers):
                continue  # never crosses, or crosses whatever the cut
            capacity = float(g.nbytes[u])
            if len(readers) == 1:
                net.add(producer, readers[0], capacity)
                continue
            value = ("value", u)
            net.add(producer, value, capacity)
            for r in readers:
                net.add(value, r)
        return net

    def best_move(self) -> np.ndarray | None:
        """The stages with boundary j at a minimum cut of the corridor, or None if none exists.

        Stage j takes the largest source side: every free node that cannot reach the sink.
        """
        net = self.network() if self.feasible else None
        source_side = None if net is None else net.source_side(SOURCE, SINK)
        if source_side is None:
            return None  # a together group forces a node to both sides
        stages = self.stages.copy()
        stages[self.free] = self.j + 1
        stages[self.tail] = self.j + 1
        stages[self.head] = self.j
        on_source = np.fromiter((int(self.side[v]) in source_side for v in self.free.tolist()), bool,
                                len(self.free))
        stages[self.free[on_source]] = self.j
        return stages


def _corridor_pins(
    g: IndexedDag, stages: np.ndarray, j: int, order: np.ndarray, budgets: Budgets
) -> tuple[np.ndarray, np.ndarray] | None:
    """Head and tail pins for boundary j along ``order``, or None when no room is left.

    The two stages' nodes along ``order`` form a topological order of them, so a head is
    down-closed and a tail up-closed. The head is the shortest that keeps stage j+1 within its
    budgets, the tail the shortest that keeps stage j within them; when they do not overlap,
    any cut between them respects the budgets and leaves both stages non-empty.
    """
    along = stages[order]
    region = order[((along == j) | (along == j + 1)) & (order >= g.num_inputs)]
    if len(region) < 2:
        return None
    head = budgets.shortest(region, j + 1, fixed=False)
    tail = budgets.shortest(region[::-1], j, fixed=j == 0)
    if head + tail > len(region):
        return None
    return region[:head], region[len(region) - tail :]


def _best_move(
    g: IndexedDag, stages: np.ndarray, sent: float, j: int, k: int, budgets: Budgets,
    orders: Sequence[np.ndarray], groups: list[np.ndarray], group_of: dict[int, int], bounds: StageBounds | None,
) -> tuple[np.ndarray, float] | None:
    """The corridor cut of boundary j (over all orders) sending the fewest bytes, if fewer than ``sent``.

    Nodes only move between stages j and j+1, so only boundary j's traffic changes: the new
    total is ``sent`` plus the change at j over the values of moved nodes and their producers.
    """
    best, best_sent = None, sent
    for order in orders:
        pins = _corridor_pins(g, stages, j, order, budgets)
        if pins is None:
            continue
        candidate = _Corridor(g, stages, j, *pins, groups, group_of, bounds).best_move()
        if candidate is None or not budgets.within(candidate, j, k):
            continue
        values = g.with_producers(np.flatnonzero(candidate != stages))
        candidate_sent = sent + g.bytes_across(candidate, j, values) - g.bytes_across(stages, j, values)
        if candidate_sent < best_sent - slack(best_sent) and candidate_sent < best_sent:
            best, best_sent = candidate, candidate_sent
    return None if best is None else (best, best_sent)


def _disjoint(groups: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Overlapping groups merged (they must share one stage too), so each node has one group."""
    parent: dict[int, int] = {}

    def root(v: int) -> int:
        while parent.setdefault(v, v) != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for members in groups:
        first = root(int(members[0]))
        for v in members[1:].tolist():
            parent[root(v)] = first
    merged: dict[int, list[int]] = {}
    for v in parent:
        merged.setdefault(root(v), []).append(v)
    return [np.array(sorted(m), dtype=np.int64) for _, m in sorted(merged.items())]


def refine(
    g: IndexedDag,
    stages: np.ndarray,
    k: int,
    budgets: Budgets,
    orders: Sequence[np.ndarray],
    frozen: frozenset[int] = frozenset(),
    groups: Sequence[np.ndarray] = (),
    bounds: StageBounds | None = None,
) -> np.ndarray:
    """Improve a valid partition boundary by boundary until no corridor cut lowers its bytes.

    ``orders`` are topological orders (index arrays) that define the corridors; boundaries in
    ``frozen`` stay put, each of ``groups`` moves as one and every node keeps to its ``bounds``.
    The result is valid, keeps every stage within ``budgets`` and sends at most as many bytes as
    the input.
    """
    groups = _disjoint(groups)
    group_of = {int(v): i for i, members in enumerate(groups) for v in members.tolist()}
    sent = g.total_bytes(stages, k)
    dirty = set(range(k - 1)) - frozen
    for _ in range(_MAX_PASSES):
        if not dirty:
            break
        for j in sorted(dirty):
            dirty.discard(j)
            best = _best_move(g, stages, sent, j, k, budgets, orders, groups, group_of, bounds)
            if best is not None:
                stages, sent = best
                dirty.update(i for i in (j - 1, j, j + 1) if 0 <= i < k - 1 and i not in frozen)
    return stages
