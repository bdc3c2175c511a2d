"""Local search by single-node moves (Fiduccia-Mattheyses style) for ordered partitions.

Minimum-cut refinement moves a boundary only when that lowers the bytes at once; often a
boundary has to get slightly worse before its neighbour can improve. A pass here moves one
node at a time to the stage (between its inputs' and its readers' stages) that saves the most
bytes, *even when the move costs bytes*, locks it for the pass, and in the end keeps the best
prefix of its moves that leaves every stage within budget. Passes alternate between keeping
every budget at each move and letting stages overshoot for a while (so a costly node can move
in before the nodes it displaces move out), and stop when one of each gains nothing. Then
iterated local search: random kicks, each repaired by local passes and kept only if better.
Nothing is kept that sends more bytes or breaks a budget, an order or a non-empty stage.

Per value it keeps the latest stage that reads it and how many readers sit there, so a move
costs O(degree) and a value read by thousands of nodes (a mask) costs nothing unless its last
reader moves earlier. Deterministic: equal gains go to the shorter move, then the earlier
stage, then the lower node index, and the kicks come from a seeded generator.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from typing import Sequence

import numpy as np

from autoshard.graph.constraints import StageBounds
from autoshard.graph.indexed import Adjacency, IndexedDag
from autoshard.graph.limits import StageLimit, slack

#: How far over its budget a stage may go in the middle of a pass (a fraction of the budget),
#: so that a costly node can move in before the nodes it displaces move out; only a prefix of
#: moves that leaves every stage within budget is kept.
OVERSHOOT = 0.5
#: Moves in a row that do not beat the pass's best before the pass stops.
MAX_STALL = 200
#: Passes at most; each must gain to be followed by another.
MAX_PASSES = 10
#: Kicks of iterated local search (``improve``) at most, and the graph size beyond which they
#: thin out (each kick costs about as much on any graph, so the total stays bounded).
KICKS = 100
KICK_NODES = 2_000
#: Moves in a row without a new best before a pass that repairs a kick stops, and passes at
#: most per repair.
KICK_STALL = 30
KICK_PASSES = 4
#: Nodes each kick moves at random, and the seed of the generator that picks them.
KICK_SIZE = 8
SEED = 0
#: Readers of one value beyond which a move does not rescore the value's other readers (their
#: queue entries are rechecked when popped, so this only decides which move is tried first).
RESCORE_READERS = 64


class _State:
    """A partition with per-stage loads and per-value latest readers, updated move by move."""

    def __init__(self, g: IndexedDag, stages: np.ndarray, k: int, limits: Sequence[StageLimit],
                 pinned: Sequence[int], bounds: StageBounds | None = None) -> None:
        self.k, self.num_inputs = k, g.num_inputs
        self.earliest: list[int] = [0] * g.n if bounds is None else bounds.earliest.tolist()
        self.latest: list[int] = [k - 1] * g.n if bounds is None else bounds.latest.tolist()
        self.stage: list[int] = stages.tolist()
        self.succ, self.pred = _rows(g.succ), _rows(g.pred)
        self.nbytes: list[float] = g.nbytes.tolist()
        #: The last stage that needs each value whatever its readers: k - 1 for an output, else -1.
        self.k_out: list[int] = np.where(g.output, k - 1, -1).tolist()
        self.pinned = sorted(pinned)
        self.count: list[int] = np.bincount(stages[g.num_inputs :], minlength=k).tolist()
        self.limits = []  # (weights per stage, sums per stage, room now, budget) per limit
        self.strict, self.loose = [], []
        for limit in limits:
            budget = [float(limit.budgets[j]) + limit.round_off(j) for j in range(k)]
            self.strict.append(budget)
            self.loose.append([b + OVERSHOOT * float(limit.budgets[j]) for j, b in enumerate(budget)])
            weights = [limit.weights(j).tolist() for j in range(k)]
            self.limits.append((weights, limit.sums(stages, k).tolist(), list(budget), budget))
        top = np.full(g.n, -1, dtype=np.int64)
        np.maximum.at(top, g.src, stages[g.dst])
        self.top: list[int] = top.tolist()
        at_top = stages[g.dst] == top[g.src]
        self.top_count: list[int] = np.bincount(g.src[at_top], minlength=g.n).tolist()
        self.over = sum(self._over(j) for j in range(k))
        self.journal: list[tuple[int, int]] = []  # (node, stage it left), to undo a kick

    def round_off(self) -> float:
        """What a pass's saving must beat to count as one: float round-off of the bytes."""
        return slack(math.fsum(self.nbytes) * self.k)

    def undo(self, mark: int) -> None:
        """Take back every move after the first ``mark`` of the journal."""
        while len(self.journal) > mark:
            v, a = self.journal.pop()
            self.move(v, a)
            self.journal.pop()

    def _top_after(self, u: int, v: int, b: int) -> tuple[int, int]:
        """(latest reader stage, readers there) of value u once its reader v sits in stage b."""
        top, count, a = self.top[u], self.top_count[u], self.stage[v]
        if b > top:
            return b, 1
        if b == top:
            return top, count + (a != top)
        if a < top or count > 1:
            return top, count - (a == top)
        stages = [b if w == v else self.stage[w] for w in self.succ[u]]
        latest = max(stages)
        return latest, stages.count(latest)

    def gain(self, v: int, b: int) -> float:
        """Bytes saved by moving v to stage b (negative when the move costs bytes)."""
        return self._gains(v, [b])[0]

    def _gains(self, v: int, targets: list[int], weights: list[float] | None = None) -> list[float]:
        """Bytes saved by moving v to each of the ascending ``targets`` (with ``weights``, what each
        value weighs instead of its bytes: 1 each counts the values crossing).

        Once v sits in stage b, an input u of v is needed up to max(b, floor), where floor (what
        u's other readers and an output need, or just its latest reader's stage when v cannot
        move below it) does not depend on b: the inputs are read once for all targets. Only when
        v alone is u's latest reader and may move earlier are u's other readers scanned (a mask
        read by thousands costs nothing otherwise).
        """
        stage, top, k_out, nbytes = self.stage, self.top, self.k_out, self.nbytes if weights is None else weights
        a = stage[v]
        earlier = targets[0] < a
        terms = []  # per input: (bytes, last stage needing it now, floor of that once v moves)
        for u in self.pred[v]:
            latest = rest = top[u]
            if earlier and latest == a and self.top_count[u] == 1:
                rest = max((stage[w] for w in self.succ[u] if w != v), default=-1)
            # conditionals, not max(): several times cheaper, and this is the hottest loop
            held = stage[u] if stage[u] > k_out[u] else k_out[u]
            terms.append((nbytes[u], latest if latest > held else held, rest if rest > held else held))
        need = top[v] if top[v] > k_out[v] else k_out[v]  # the last stage v's value must reach
        crossed = need - a if need > a else 0
        gains = []
        for b in targets:
            saved = nbytes[v] * (crossed - (need - b if need > b else 0))
            for size, last, floor in terms:
                saved += size * (last - (b if b > floor else floor))
            gains.append(saved)
        return gains

    def _targets(self, v: int) -> range:
        """Stages v may take: after its inputs', before its readers', within its stage range, no
        pinned boundary crossed."""
        stage = self.stage
        lo, hi = 0, self.k - 1
        for u in self.pred[v]:  # loops: max() and min() cost several times as much here
            if stage[u] > lo:
                lo = stage[u]
        for w in self.succ[v]:
            if stage[w] < hi:
                hi = stage[w]
        lo, hi = max(lo, self.earliest[v]), min(hi, self.latest[v])
        if self.pinned:
            at = bisect_left(self.pinned, stage[v])
            if at:
                lo = max(lo, self.pinned[at - 1] + 1)
            if at < len(self.pinned):
                hi = min(hi, self.pinned[at])
        return range(lo, hi + 1)

    def targets_within(self, v: int) -> list[int]:
        """The stages v may move to now: ordered, no pinned boundary crossed, its stage kept
        non-empty, every budget (as far as ``overshoot`` allows) kept; none for an input."""
        a = self.stage[v]
        if v < self.num_inputs or self.count[a] <= 1:
            return []  # inputs sit in stage 0; a stage keeps one node at least
        span = self._targets(v)
        targets = list(span)
        if a in span:
            targets.remove(a)
        if not targets:
            return targets
        for weights, sums, room, _ in self.limits:
            targets = [b for b in targets if sums[b] + weights[b][v] <= room[b]]
        return targets

    def best(self, v: int) -> tuple[float, int] | None:
        """(bytes saved, target stage) of v's best move within every budget, or None."""
        targets = self.targets_within(v)
        if not targets:
            return None
        a = self.stage[v]
        found = None
        for b, gain in zip(targets, self._gains(v, targets)):
            key = (gain, -abs(b - a), -b)
            if found is None or key > found:
                found = key
        return found[0], -found[2]

    def overshoot(self, allowed: bool) -> None:
        """Let moves take stages over budget by ``OVERSHOOT`` (or not) until told otherwise."""
        for (_, _, room, _), rooms in zip(self.limits, self.loose if allowed else self.strict):
            room[:] = rooms

    def _over(self, j: int) -> bool:
        """Whether stage j exceeds one of its budgets (allowed in the middle of a pass)."""
        for _, sums, _, budget in self.limits:
            if sums[j] > budget[j]:
                return True
        return False

    def move(self, v: int, b: int) -> None:
        stage, top, top_count = self.stage, self.top, self.top_count
        a = stage[v]
        self.journal.append((v, a))
        for u in self.pred[v]:
            top[u], top_count[u] = self._top_after(u, v, b)
        stage[v] = b
        self.count[a] -= 1
        self.count[b] += 1
        self.over -= self._over(a) + self._over(b)
        for weights, sums, _, _ in self.limits:
            sums[a] -= weights[a][v]
            sums[b] += weights[b][v]
        self.over += self._over(a) + self._over(b)

    def neighbours(self, v: int) -> set[int]:
        """Nodes whose best move a move of v can change."""
        pred, succ = self.pred, self.succ
        near = set(pred[v])
        near.update(succ[v])
        for u in pred[v]:
            readers = succ[u]
            if len(readers) <= RESCORE_READERS:
                near.update(readers)
        near.discard(v)
        return near


def _rows(adjacency: Adjacency) -> list[tuple[int, ...]]:
    """Each node's neighbours as a tuple: the moves read them hundreds of thousands of times, and
    a tuple of ints, unlike a list, leaves the garbage collector's watch once it has been seen."""
    ptr, flat = adjacency.ptr, adjacency.flat
    return [tuple(flat[ptr[v] : ptr[v + 1]]) for v in range(len(ptr) - 1)]


def _movable(g: IndexedDag, stages: np.ndarray, k: int) -> np.ndarray:
    """Non-input nodes with room to move: an input's stage below theirs or a reader's above."""
    lo = np.zeros(g.n, dtype=np.int64)
    np.maximum.at(lo, g.dst, stages[g.src])
    hi = np.full(g.n, k - 1, dtype=np.int64)
    np.minimum.at(hi, g.src, stages[g.dst])
    movable = (lo < stages) | (hi > stages)
    movable[: g.num_inputs] = False
    return np.flatnonzero(movable)


def _one_pass(state: _State, candidates: list[int], frozen: set[int], ni: int, round_off: float,
              stall_limit: int) -> tuple[float, list[int]]:
    """One pass of moves from ``candidates``; keeps the best prefix that leaves every stage within
    budget. Returns (bytes it saves, the nodes it moved); -inf saved if a start over budget
    found no prefix within it (then nothing moved)."""
    heap: list[tuple[float, int, int]] = []
    locked = set(frozen)

    def push(v: int) -> None:
        found = state.best(v)
        if found is not None:
            heapq.heappush(heap, (-found[0], v, found[1]))

    for v in candidates:
        if v >= ni and v not in locked:
            push(v)
    moves: list[tuple[int, int]] = []
    saved = 0.0
    best_saved = -math.inf if state.over else 0.0
    kept = stall = 0
    while heap and stall < stall_limit:
        neg, v, b = heapq.heappop(heap)
        if v in locked:
            continue
        found = state.best(v)
        if found is None:
            continue
        if found != (-neg, b):
            heapq.heappush(heap, (-found[0], v, found[1]))
            continue
        moves.append((v, state.stage[v]))
        state.move(v, b)
        locked.add(v)
        saved += found[0]
        if saved > best_saved + round_off and not state.over:
            best_saved, kept, stall = saved, len(moves), 0
        else:
            stall += 1
        for w in state.neighbours(v):
            if w >= ni and w not in locked:
                push(w)
    for v, a in reversed(moves[kept:]):
        state.move(v, a)
    return best_saved, [v for v, _ in moves[:kept]]


def _passes(state: _State, g: IndexedDag, frozen: set[int], seeds: list[int] | None) -> None:
    """Strict and overshooting passes in turn until one of each gains nothing.

    Without ``seeds`` every pass starts from all movable nodes; with them, from the seeds, the
    nodes moved so far and their neighbours (a local repair after a kick).
    """
    round_off = state.round_off()
    near = None if seeds is None else set(seeds)
    failed = 0
    for count in range(MAX_PASSES if seeds is None else KICK_PASSES):
        state.overshoot(bool(count % 2))
        if near is None:
            candidates = _movable(g, np.array(state.stage, dtype=np.int64), state.k).tolist()
        else:
            candidates = sorted(near)
        stall = MAX_STALL if seeds is None else KICK_STALL
        gained, moved = _one_pass(state, candidates, frozen, g.num_inputs, round_off, stall)
        if near is not None:
            for v in moved:
                near.add(v)
                near.update(state.neighbours(v))
        failed = 0 if gained > 0 else failed + 1
        if failed == 2:
            break


def kicks_for(n: int) -> int:
    """How many kicks ``improve`` makes on a graph of n nodes: ``KICKS``, fewer on graphs of fewer
    than ``KICKS`` nodes (little to explore) or more than ``KICK_NODES`` (each kick costs more)."""
    return max(0, min(KICKS, n, KICK_NODES * KICKS // max(n, 1)))


def improve(
    g: IndexedDag,
    stages: np.ndarray,
    k: int,
    limits: Sequence[StageLimit],
    pinned: frozenset[int] = frozenset(),
    fixed: np.ndarray | None = None,
    kicks: int = 0,
    patience: int | None = None,
    bounds: StageBounds | None = None,
) -> np.ndarray:
    """``stages`` after passes of single-node moves, then ``kicks`` rounds of iterated local
    search (stopping early after ``patience`` kicks in a row find nothing better, if given);
    never sends more bytes than ``stages``.

    ``limits`` are the per-stage budgets every stage keeps; no move crosses a boundary in
    ``pinned``; ``fixed`` nodes (together groups) stay where they are; every node keeps to its
    ``bounds`` (``stage_ranges``). Each kick moves
    ``KICK_SIZE`` random movable nodes of the best split so far to random stages they may take
    (allowing overshoot), repairs locally with passes of moves, and keeps the result if it is
    within every budget and sends fewer bytes: that escapes the local optima where a better
    split needs several costly moves at once. The generator is seeded: deterministic.
    """
    frozen = set() if fixed is None else set(fixed.tolist())
    state = _State(g, stages, k, limits, sorted(pinned), bounds)
    _passes(state, g, frozen, None)
    best = np.array(state.stage, dtype=np.int64)
    best_sent = g.total_bytes(best, k)
    state.journal.clear()
    rng = np.random.default_rng(SEED)
    fruitless = 0
    for _ in range(kicks):
        if patience is not None and fruitless >= patience:
            break
        movable = [v for v in _movable(g, best, k).tolist() if v not in frozen]
        if not movable:
            break
        mark = len(state.journal)
        state.overshoot(True)
        chosen = rng.choice(movable, size=min(KICK_SIZE, len(movable)), replace=False).tolist()
        for v in chosen:
            targets = state.targets_within(v)
            if targets:
                state.move(v, targets[int(rng.integers(len(targets)))])
        _passes(state, g, frozen, chosen)
        found = np.array(state.stage, dtype=np.int64)
        sent = g.total_bytes(found, k)
        if not state.over and sent < best_sent:
            best, best_sent = found, sent
            state.journal.clear()
            fruitless = 0
        else:
            state.undo(mark)
            fruitless += 1
    return best


class _Crossings(_State):
    """Moves scored by the values that stop crossing a boundary, among those sending no byte more."""

    def __init__(self, g: IndexedDag, *args: object, **kwargs: object) -> None:
        super().__init__(g, *args, **kwargs)  # type: ignore[arg-type]
        self.each = [1.0] * g.n

    def round_off(self) -> float:
        return 0.5  # counts are whole

    def best(self, v: int) -> tuple[float, int] | None:
        """(crossings saved, target stage) of v's best move that sends no more bytes, or None."""
        targets = self.targets_within(v)
        if not targets:
            return None
        a = self.stage[v]
        found = max(((fewer, -abs(b - a), -b) for b, saved, fewer in
                     zip(targets, self._gains(v, targets), self._gains(v, targets, self.each)) if saved >= 0),
                    default=None)
        return None if found is None else (found[0], -found[2])


def fewer_values(g: IndexedDag, stages: np.ndarray, k: int, limits: Sequence[StageLimit],
                 pinned: frozenset[int] = frozenset(), fixed: np.ndarray | None = None,
                 bounds: StageBounds | None = None) -> np.ndarray:
    """``stages`` after passes of single-node moves that let fewer values cross boundaries, none sending a
    byte more, within every budget: splits tie on bytes where values of no bytes cross (a shape's
    carrier), yet each value crossing is one more message per microbatch. The passes are ``improve``'s
    (a move may add a crossing for a while; the best prefix is kept), as are the keywords. Deterministic;
    never sends more bytes than ``stages``.
    """
    frozen = set() if fixed is None else set(fixed.tolist())
    state = _Crossings(g, stages, k, limits, sorted(pinned), bounds)
    made_from = g.dag.nodes(data="made_from")
    for v in range(g.n):  # a carrier where a partition places it (Partition.from_assignment), and kept there:
        if made_from[g.nodes[v]] is not None and v not in frozen:  # its readers may move up to it
            after = max(state.stage[u] for u in state.pred[v])
            if after in state.targets_within(v):
                state.move(v, after)
            frozen.add(v)  # (counted here, it crosses even where its tensor does, which it does not)
    _passes(state, g, frozen, None)
    result = np.array(state.stage, dtype=np.int64)
    return result if g.total_bytes(result, k) <= g.total_bytes(stages, k) else stages
