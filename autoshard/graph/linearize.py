"""Topological orders of a DAG that satisfies the graph contract.

A split is searched as contiguous pieces of one order, so the order decides which splits can be
found at all. Several orders are offered because no single one keeps every cheap cut contiguous.
Every order starts with the ``input`` nodes in program order: they have no predecessors and
always sit in stage 0, so hoisting them is always valid and keeps the non-input sequence clean.

The schedules work on an ``IndexedDag`` (index arrays, fast); ``ORDERS`` wraps them for a
networkx graph. All functions expect a graph that passes ``check_dag``.
"""

from __future__ import annotations

import heapq
from typing import Callable

import networkx as nx
import numpy as np

from autoshard.graph.indexed import Adjacency, IndexedDag, Node, Order, is_input, is_output, program_order

__all__ = [
    "INDEX_ORDERS",
    "ORDERS",
    "Node",
    "Order",
    "dfs_order",
    "is_input",
    "is_output",
    "live_bytes_greedy_order",
    "non_inputs",
    "program_order",
    "pull_forward",
    "push_back",
]


def non_inputs(dag: nx.DiGraph, order: Order) -> Order:
    """The nodes of ``order`` that can fill a stage: the sequence a split cuts into pieces."""
    return [v for v in order if not is_input(dag, v)]


def _start(g: IndexedDag) -> tuple[list[int], list[int], list[int]]:
    """Schedule the inputs; return (scheduled, unmet in-degrees, ready non-inputs in order)."""
    scheduled = list(range(g.num_inputs))
    unmet = np.diff(g.pred_ptr).tolist()
    for u in scheduled:
        for v in g.succ[u]:
            unmet[v] -= 1
    ready = [v for v in range(g.num_inputs, g.n) if unmet[v] == 0]
    return scheduled, unmet, ready


def _release(g: IndexedDag, node: int, unmet: list[int]) -> list[int]:
    """Count ``node`` as run; return the successors that became ready, in program order."""
    freed = []
    for v in g.succ[node]:
        unmet[v] -= 1
        if unmet[v] == 0:
            freed.append(v)
    return sorted(freed)


def program_schedule(g: IndexedDag) -> np.ndarray:
    """Program order: the node numbering itself."""
    return np.arange(g.n)


def dfs_schedule(g: IndexedDag) -> np.ndarray:
    """Depth-first topological order: finish a branch before starting its sibling.

    Kahn's algorithm with a stack: the most recently released node runs next, ties broken by
    program index. Branches that program order interleaves come out contiguous, so one stage
    boundary can separate them.
    """
    scheduled, unmet, ready = _start(g)
    stack = ready[::-1]
    while stack:
        node = stack.pop()
        scheduled.append(node)
        stack.extend(reversed(_release(g, node, unmet)))
    return np.array(scheduled, dtype=np.int64)


class _LiveBytes:
    """Bookkeeping for the live-bytes greedy: how many consumers of each value are still due."""

    def __init__(self, g: IndexedDag) -> None:
        self.g = g
        self.pending = np.diff(g.succ_ptr).tolist()
        self.nbytes = g.nbytes.tolist()
        self.output = g.output.tolist()
        self.done = [False] * g.n

    def delta(self, node: int) -> float:
        """Live bytes added by running ``node`` minus the bytes it frees as a last consumer."""
        keeps = self.pending[node] > 0 or self.output[node]
        added = self.nbytes[node] if keeps else 0.0
        freed = sum(
            self.nbytes[u]
            for u in self.g.pred[node]
            if self.pending[u] == 1 and not self.output[u]
        )
        return added - freed

    def consume(self, node: int) -> list[int]:
        """Run ``node``; return consumers that just became the last reader of some value."""
        self.done[node] = True
        last_readers = []
        for u in self.g.pred[node]:
            self.pending[u] -= 1
            if self.pending[u] == 1:
                last_readers.extend(v for v in self.g.succ[u] if not self.done[v])
        return last_readers


def live_bytes_schedule(g: IndexedDag) -> np.ndarray:
    """List schedule that keeps few bytes live: run the ready node that frees the most bytes.

    Among ready nodes it picks the lowest (bytes its value adds) - (bytes of the values it is
    the last reader of); ties go to the lowest program index. A node's score only improves when
    it becomes some value's last reader, so a lazy heap keeps this O((n + m) log n).
    """
    scheduled, unmet, ready = _start(g)
    live = _LiveBytes(g)
    for u in scheduled:
        live.consume(u)
    score: dict[int, float] = {}
    heap: list[tuple[float, int]] = []

    def rescore(v: int) -> None:
        score[v] = live.delta(v)
        heapq.heappush(heap, (score[v], v))

    for v in ready:
        rescore(v)
    while heap:
        value, node = heapq.heappop(heap)
        if live.done[node] or value != score[node]:
            continue
        scheduled.append(node)
        for v in live.consume(node) + _release(g, node, unmet):
            if v in score or unmet[v] == 0:
                rescore(v)
    return np.array(scheduled, dtype=np.int64)


def _closure(start: int, neighbours: Adjacency, placed: np.ndarray) -> list[int]:
    """``start`` and every node reachable from it through ``neighbours`` not yet ``placed``."""
    found, stack = [start], [start]
    placed[start] = True
    while stack:
        for u in neighbours[stack.pop()]:
            if not placed[u]:
                placed[u] = True
                found.append(u)
                stack.append(u)
    return found


def pull_forward(g: IndexedDag, base: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """``base`` with each of ``nodes`` run as early as it can: right after its own ancestors.

    Taking ``nodes`` in ``base`` order, each comes with its ancestors not yet placed (in ``base``
    order); the other nodes follow in ``base`` order. A costly node then has a cut just after
    it with nothing else before it but what it needs, which ``base`` may not offer.
    """
    rank = np.empty(g.n, dtype=np.int64)
    rank[base] = np.arange(g.n)
    placed = np.zeros(g.n, dtype=bool)
    placed[: g.num_inputs] = True
    chunks = [np.arange(g.num_inputs)]
    for node in sorted(nodes.tolist(), key=rank.__getitem__):
        if not placed[node]:
            chunks.append(np.array(sorted(_closure(node, g.pred, placed), key=rank.__getitem__), dtype=np.int64))
    return np.concatenate([*chunks, base[~placed[base]]])


def push_back(g: IndexedDag, base: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """``base`` with each of ``nodes`` run as late as it can: right before its own descendants.

    The mirror of ``pull_forward``: a costly node then has a cut just before it with everything
    before it that does not need it.
    """
    rank = np.empty(g.n, dtype=np.int64)
    rank[base] = np.arange(g.n)
    placed = np.zeros(g.n, dtype=bool)
    chunks = [base[:0]]
    for node in sorted(nodes.tolist(), key=rank.__getitem__, reverse=True):
        if not placed[node]:
            chunks.append(np.array(sorted(_closure(node, g.succ, placed), key=rank.__getitem__), dtype=np.int64))
    return np.concatenate([base[~placed[base]], *reversed(chunks)])


Schedule = Callable[[IndexedDag], np.ndarray]

#: Index-level schedules by name, for the splitter.
INDEX_ORDERS: dict[str, Schedule] = {
    "program": program_schedule,
    "live-bytes": live_bytes_schedule,
    "dfs": dfs_schedule,
}


def _named(schedule: Schedule) -> Callable[[nx.DiGraph], Order]:
    def order(dag: nx.DiGraph) -> Order:
        g = IndexedDag(dag)
        return [g.nodes[i] for i in schedule(g).tolist()]

    order.__name__ = schedule.__name__.replace("schedule", "order")
    order.__doc__ = schedule.__doc__
    return order


dfs_order = _named(dfs_schedule)
live_bytes_greedy_order = _named(live_bytes_schedule)

#: Orders of a networkx graph by name (``linearize{order=...}``, ``min-cut``'s ``orders``).
ORDERS: dict[str, Callable[[nx.DiGraph], Order]] = {
    "program": program_order,
    "live-bytes": live_bytes_greedy_order,
    "dfs": dfs_order,
}
