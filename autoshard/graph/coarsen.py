"""Coarse graphs for ``min-cut``: each large value with a single reader merged into that reader.

Single-node moves and one-boundary cuts stop at splits where a better one needs a producer and
its reader to cross a boundary together, many times over. Contracting every value that has one
reader (and is at least ``min_bytes``) into that reader makes such chains one node, so the same
search on the coarse graph takes steps the fine search cannot; its split is then projected back
and polished on the full graph (one level of the multilevel scheme of METIS and KaHyPar).

A merged value never crosses a boundary, so a coarse split sends exactly the bytes of its
projection: each cluster sends only its root's value, the one member read from outside.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from autoshard.graph.indexed import IndexedDag


def _mergeable(g: IndexedDag) -> np.ndarray:
    """Per node, whether its value may merge into its reader: one reader, not a model output or input."""
    single = (np.diff(g.succ_ptr) == 1) & ~g.output
    single[: g.num_inputs] = False
    return single


def single_reader_sizes(g: IndexedDag) -> np.ndarray:
    """Sizes of the values that ``clusters`` may merge."""
    return g.nbytes[_mergeable(g)]


def clusters(g: IndexedDag, min_bytes: float, max_cost: float) -> np.ndarray:
    """Cluster root per node: values of at least ``min_bytes`` with one reader join the reader's cluster.

    Largest values first (ties: program order), and never past ``max_cost`` per cluster, so no
    cluster is too costly for the balance the split must keep. A member's only reader lies in
    its cluster, so the quotient graph stays acyclic.
    """
    root = np.arange(g.n)

    def find(v: int) -> int:
        while root[v] != v:
            root[v] = root[root[v]]
            v = int(root[v])
        return v

    cost = g.cost.copy()
    merged = np.flatnonzero(_mergeable(g) & (g.nbytes >= min_bytes))
    for u in merged[np.argsort(-g.nbytes[merged], kind="stable")].tolist():
        ru, rv = find(u), find(int(g.succ_idx[g.succ_ptr[u]]))
        if ru != rv and cost[ru] + cost[rv] <= max_cost:
            root[ru] = rv
            cost[rv] += cost[ru]
    return np.array([find(v) for v in range(g.n)], dtype=np.int64)


def quotient(g: IndexedDag, roots: np.ndarray) -> tuple[nx.DiGraph, np.ndarray]:
    """The coarse DAG of ``roots`` (clusters numbered in program order of their first member) and
    the cluster of each node.

    A cluster costs its members' sum and weighs the bytes of the values read from outside it
    (its root's); it is an input or output when a member is.
    """
    _, first, cluster = np.unique(roots, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    cluster = rank[cluster]
    m = len(first)
    leaves = np.zeros(g.n, dtype=bool)
    leaves[g.src[cluster[g.src] != cluster[g.dst]]] = True
    leaves |= g.output
    cost = np.bincount(cluster, weights=g.cost, minlength=m)
    sent = np.bincount(cluster, weights=np.where(leaves, g.nbytes, 0.0), minlength=m)
    is_input = np.zeros(m, dtype=bool)
    is_input[cluster[: g.num_inputs]] = True
    is_output = np.zeros(m, dtype=bool)
    is_output[cluster[g.output]] = True
    dag = nx.DiGraph()
    for c in range(m):
        dag.add_node(c, cost=float(cost[c]), bytes=float(sent[c]), input=bool(is_input[c]),
                     output=bool(is_output[c]))
    across = cluster[g.src] != cluster[g.dst]
    dag.add_edges_from(zip(cluster[g.src[across]].tolist(), cluster[g.dst[across]].tolist()))
    return dag, cluster


def project(coarse: IndexedDag, stages: np.ndarray, cluster: np.ndarray) -> np.ndarray:
    """The stage of every node of the full graph under ``stages``, a split of ``coarse`` (the
    indexed ``quotient`` graph, whose nodes are the cluster numbers)."""
    by_cluster = np.empty(coarse.n, dtype=np.int64)
    by_cluster[np.array(coarse.nodes, dtype=np.int64)] = stages
    return by_cluster[cluster]
