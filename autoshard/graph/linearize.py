"""Topological orders of a DAG that satisfies the graph contract.

A split is searched as contiguous pieces of one order, so the order decides which splits can be
found at all. Several orders are offered because no single one keeps every cheap cut contiguous.
Every order starts with the ``input`` nodes in program order: they have no predecessors and
always sit in stage 0, so hoisting them is always valid and keeps the non-input sequence clean.

All functions expect a graph that passes ``check_dag``.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable

import networkx as nx

Node = Hashable
Order = list[Node]


def is_input(dag: nx.DiGraph, node: Node) -> bool:
    """Whether ``node`` is a model input (placed in stage 0, never counted as stage content)."""
    return bool(dag.nodes[node].get("input", False))


def is_output(dag: nx.DiGraph, node: Node) -> bool:
    """Whether ``node``'s value is read after the last stage."""
    return bool(dag.nodes[node].get("output", False))


def _insertion_topological(dag: nx.DiGraph) -> Order:
    """Insertion order if it is topological, else the topological order closest to it."""
    index = {v: i for i, v in enumerate(dag.nodes)}
    if all(index[u] < index[v] for u, v in dag.edges):
        return list(dag.nodes)
    return list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))


def _inputs_first(dag: nx.DiGraph, order: Order) -> Order:
    """Stable-move the input nodes to the front (they have no predecessors, so this stays valid)."""
    return [v for v in order if is_input(dag, v)] + [v for v in order if not is_input(dag, v)]


def program_order(dag: nx.DiGraph) -> Order:
    """The graph's insertion order (the program's own order), inputs first.

    Falls back to ``nx.lexicographical_topological_sort`` keyed by insertion index when the
    insertion order is not topological, so the result is always a valid schedule.
    """
    return _inputs_first(dag, _insertion_topological(dag))


def non_inputs(dag: nx.DiGraph, order: Order) -> Order:
    """The nodes of ``order`` that can fill a stage: the sequence a split cuts into pieces."""
    return [v for v in order if not is_input(dag, v)]


def _start(dag: nx.DiGraph) -> tuple[Order, dict[Node, int], dict[Node, int], Order]:
    """Schedule the inputs; return (scheduled, program index, unmet in-degrees, ready nodes)."""
    order = program_order(dag)
    index = {v: i for i, v in enumerate(order)}
    scheduled = [v for v in order if is_input(dag, v)]
    unmet = {v: dag.in_degree(v) for v in order}
    for u in scheduled:
        for v in dag.successors(u):
            unmet[v] -= 1
    ready = [v for v in order if unmet[v] == 0 and not is_input(dag, v)]
    return scheduled, index, unmet, ready


def _release(dag: nx.DiGraph, node: Node, unmet: dict[Node, int], index: dict[Node, int]) -> Order:
    """Count ``node`` as run; return the successors that became ready, in program order."""
    freed = []
    for v in dag.successors(node):
        unmet[v] -= 1
        if unmet[v] == 0:
            freed.append(v)
    return sorted(freed, key=index.__getitem__)


def dfs_order(dag: nx.DiGraph) -> Order:
    """Depth-first topological order: finish a branch before starting its sibling.

    Kahn's algorithm with a stack: the most recently released node runs next, ties broken by
    program index. Branches that program order interleaves come out contiguous, so one stage
    boundary can separate them.
    """
    scheduled, index, unmet, ready = _start(dag)
    stack = ready[::-1]
    while stack:
        node = stack.pop()
        scheduled.append(node)
        stack.extend(reversed(_release(dag, node, unmet, index)))
    return scheduled


class _LiveBytes:
    """Bookkeeping for the live-bytes greedy: how many consumers of each value are still due."""

    def __init__(self, dag: nx.DiGraph) -> None:
        self.dag = dag
        self.pending = {u: dag.out_degree(u) for u in dag.nodes}
        self.done: dict[Node, bool] = {}

    def delta(self, node: Node) -> float:
        """Live bytes added by running ``node`` minus the bytes it frees as a last consumer."""
        dag = self.dag
        keeps = dag.out_degree(node) > 0 or is_output(dag, node)
        added = float(dag.nodes[node]["bytes"]) if keeps else 0.0
        freed = sum(
            float(dag.nodes[u]["bytes"])
            for u in dag.predecessors(node)
            if self.pending[u] == 1 and not is_output(dag, u)
        )
        return added - freed

    def consume(self, node: Node) -> Order:
        """Run ``node``; return consumers that just became the last reader of some value."""
        self.done[node] = True
        last_readers = []
        for u in self.dag.predecessors(node):
            self.pending[u] -= 1
            if self.pending[u] == 1:
                last_readers.extend(v for v in self.dag.successors(u) if v not in self.done)
        return last_readers


def live_bytes_greedy_order(dag: nx.DiGraph) -> Order:
    """List schedule that keeps few bytes live: run the ready node that frees the most bytes.

    Among ready nodes it picks the lowest (bytes its value adds) - (bytes of the values it is
    the last reader of); ties go to the lowest program index. A node's score only improves when it
    becomes some value's last reader, so a lazy heap keeps this O((n + m) log n).
    """
    scheduled, index, unmet, ready = _start(dag)
    live = _LiveBytes(dag)
    for u in scheduled:
        live.consume(u)
    nodes = list(index)
    score: dict[Node, float] = {}
    heap: list[tuple[float, int]] = []

    def rescore(v: Node) -> None:
        score[v] = live.delta(v)
        heapq.heappush(heap, (score[v], index[v]))

    for v in ready:
        rescore(v)
    while heap:
        value, i = heapq.heappop(heap)
        node = nodes[i]
        if node in live.done or value != score[node]:
            continue
        scheduled.append(node)
        for v in live.consume(node) + _release(dag, node, unmet, index):
            if v in score or unmet[v] == 0:
                rescore(v)
    return scheduled


#: Orders the ``min-cut`` strategy may try, by name.
ORDERS: dict[str, Callable[[nx.DiGraph], Order]] = {
    "program": program_order,
    "live-bytes": live_bytes_greedy_order,
    "dfs": dfs_order,
}
