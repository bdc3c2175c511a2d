"""Minimum s-t cuts for boundary refinement, on a small integer flow network.

Capacities are scaled to integers below 2**29 in total (uncapacitated edges get 2**30), so the
max-flow is exact and an uncapacitated source-sink path shows as a flow of 2**30 or more. The
cut returned is the one whose sink side is smallest: the nodes that can still reach the sink
in the residual network. That set is the same for every maximum flow, so the two solvers give
identical answers: scipy's compiled Dinic for networks of ``COMPILED_FROM`` edges or more when
scipy is installed (ten times faster on corridors of thousands of nodes), else shortest augmenting
paths in Python. Most corridors are a few dozen edges, where scipy's checks and conversions take
about 2 ms a call against a few dozen microseconds for the whole Python solve; the bound search
of ``cost=memory`` refines thousands of them.
"""

from __future__ import annotations

import contextlib
from typing import Hashable

import numpy as np

#: Marks an uncapacitated edge in ``Network.add``.
UNBOUNDED = -1.0
_FINITE_TOTAL = 2**29
_INFINITE = 2**30
#: Networks with at least this many edges go to scipy's solver (about where it starts to win).
COMPILED_FROM = 256


class Network:
    """Directed edges with capacities >= 0 (or ``UNBOUNDED``); parallel edges add up."""

    def __init__(self) -> None:
        self.capacity: dict[tuple[Hashable, Hashable], float] = {}

    def add(self, u: Hashable, v: Hashable, capacity: float = UNBOUNDED) -> None:
        if u == v:
            return
        known = self.capacity.get((u, v))
        if known == UNBOUNDED or capacity == UNBOUNDED:
            self.capacity[(u, v)] = UNBOUNDED
        else:
            self.capacity[(u, v)] = capacity + (known or 0.0)

    def _integer(self, ends: tuple[Hashable, Hashable]) -> tuple[list[Hashable], np.ndarray, np.ndarray, np.ndarray]:
        """(nodes, tail index, head index, integer capacity) of every edge; ``ends`` come first."""
        nodes = list(dict.fromkeys([*ends, *(x for edge in self.capacity for x in edge)]))
        index = {v: i for i, v in enumerate(nodes)}
        tails = np.fromiter((index[u] for u, _ in self.capacity), np.int64, len(self.capacity))
        heads = np.fromiter((index[v] for _, v in self.capacity), np.int64, len(self.capacity))
        raw = np.fromiter(self.capacity.values(), float, len(self.capacity))
        finite = raw != UNBOUNDED
        scale = _FINITE_TOTAL / max(float(raw[finite].sum()), 1.0)
        caps = np.where(finite, np.floor(raw * scale), _INFINITE).astype(np.int64)
        return nodes, tails, heads, caps

    def source_side(self, source: Hashable, sink: Hashable) -> set[Hashable] | None:
        """The largest source side of a minimum cut: every node that cannot reach the sink.

        None when an uncapacitated path joins source and sink (no finite cut exists).
        """
        nodes, tails, heads, caps = self._integer((source, sink))
        reaches = _reaches_sink(len(nodes), tails, heads, caps, 0, 1)
        if reaches is None:
            return None
        return {v for v, r in zip(nodes, reaches) if not r}


def _reaches_sink(
    n: int, tails: np.ndarray, heads: np.ndarray, caps: np.ndarray, s: int, t: int
) -> np.ndarray | None:
    """Which nodes reach ``t`` in the residual of a maximum ``s``-``t`` flow (None: the flow is unbounded)."""
    if len(caps) >= COMPILED_FROM:
        with contextlib.suppress(ImportError):
            return _scipy_reaches_sink(n, tails, heads, caps, s, t)
    return _python_reaches_sink(n, tails, heads, caps, s, t)


def _scipy_reaches_sink(
    n: int, tails: np.ndarray, heads: np.ndarray, caps: np.ndarray, s: int, t: int
) -> np.ndarray | None:
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    graph = csr_matrix((caps.astype(np.int32), (tails, heads)), shape=(n, n))
    result = maximum_flow(graph, s, t, method="dinic")
    if result.flow_value >= _INFINITE:
        return None
    residual = (graph - result.flow).tocsr()
    residual.data[residual.data < 0] = 0
    residual.eliminate_zeros()
    reaches = np.zeros(n, dtype=bool)
    reaches[breadth_first_order(residual.T.tocsr(), t, directed=True, return_predecessors=False)] = True
    return reaches


def _python_reaches_sink(
    n: int, tails: np.ndarray, heads: np.ndarray, caps: np.ndarray, s: int, t: int
) -> np.ndarray | None:
    """Edmonds-Karp (each augmenting path a shortest one), then the nodes reaching ``t`` in the residual."""
    residual: list[dict[int, int]] = [{} for _ in range(n)]  # residual[u][v]: what u -> v can still carry
    for u, v, c in zip(tails.tolist(), heads.tolist(), caps.tolist()):
        residual[u][v] = residual[u].get(v, 0) + c
        residual[v].setdefault(u, 0)
    total = 0
    while True:
        parent = [-1] * n
        parent[s] = s
        queue = [s]
        for u in queue:
            for v, c in residual[u].items():
                if c > 0 and parent[v] < 0:
                    parent[v] = u
                    queue.append(v)
            if parent[t] >= 0:
                break
        if parent[t] < 0:
            break
        path, v = [], t
        while v != s:
            path.append((parent[v], v))
            v = parent[v]
        push = min(residual[u][v] for u, v in path)
        for u, v in path:
            residual[u][v] -= push
            residual[v][u] += push
        total += push
        if total >= _INFINITE:
            return None
    reaches = np.zeros(n, dtype=bool)
    reaches[t] = True
    frontier = [t]
    while frontier:
        v = frontier.pop()
        for u in residual[v]:  # every edge into v, either way round, has its reverse in residual[v]
            if not reaches[u] and residual[u][v] > 0:
                reaches[u] = True
                frontier.append(u)
    return reaches
