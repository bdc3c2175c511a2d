"""The DAG as flat arrays over node indices, so splitting 100,000 nodes takes seconds.

networkx attribute lookups cost microseconds each; the splitter touches every node and edge
many times. ``IndexedDag`` reads the graph once: nodes are numbered in program order (inputs
first), weights become numpy arrays and edges become CSR adjacency, and every score is then a
vectorised numpy expression. Stage assignments at this level are int arrays indexed by node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Hashable, TypeVar

import networkx as nx
import numpy as np

Node = Hashable
Order = list[Node]
Made = TypeVar("Made")


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


def program_order(dag: nx.DiGraph) -> Order:
    """The graph's insertion order (the program's own order), inputs first.

    Falls back to ``nx.lexicographical_topological_sort`` keyed by insertion index when the
    insertion order is not topological, so the result is always a valid schedule. Inputs have
    no predecessors, so moving them to the front keeps the order valid.
    """
    order = _insertion_topological(dag)
    flags = dag.nodes(data="input", default=False)
    inputs = {v for v, flag in flags if flag}
    return [v for v in order if v in inputs] + [v for v in order if v not in inputs]


def _csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Row pointers and column indices of the edges src -> dst, rows in node order."""
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
    return ptr, dst[order]


class IndexedDag:
    """A contract-satisfying DAG with nodes numbered 0..n-1 in program order, inputs first.

    A node without ``cost`` or an ``attribute`` asked for counts 0 there: schedules need only
    ``bytes``, and the splitter checks the attributes it requires before it reads them. One
    index may serve many splits (a search splitting one weighted graph under many budgets), so
    its arrays are read-only and what depends on the graph alone is made once (``derived``);
    the networkx graph must not change while it is indexed.
    """

    def __init__(self, dag: nx.DiGraph) -> None:
        self.dag = dag
        self.nodes: Order = program_order(dag)
        self.index = {v: i for i, v in enumerate(self.nodes)}
        n = self.n = len(self.nodes)
        rows = [dag.nodes[v] for v in self.nodes]
        self.cost = np.fromiter((d.get("cost", 0.0) for d in rows), float, n)
        self.nbytes = np.fromiter((d["bytes"] for d in rows), float, n)
        self.output = np.fromiter((bool(d.get("output", False)) for d in rows), bool, n)
        self.num_inputs = sum(1 for d in rows if d.get("input", False))
        m = dag.number_of_edges()
        index = self.index
        self.src = np.fromiter((index[u] for u, _ in dag.edges), np.int64, m)
        self.dst = np.fromiter((index[v] for _, v in dag.edges), np.int64, m)
        self.succ_ptr, self.succ_idx = _csr(self.src, self.dst, n)
        self.pred_ptr, self.pred_idx = _csr(self.dst, self.src, n)
        for array in (self.cost, self.nbytes, self.output, self.src, self.dst, self.succ_ptr, self.succ_idx,
                      self.pred_ptr, self.pred_idx):
            array.flags.writeable = False
        self._derived: dict[Callable[[IndexedDag], Any], Any] = {}

    def attribute(self, name: str) -> np.ndarray:
        """The numeric node attribute ``name`` per node (0 where a node lacks it), read once."""
        return self.derived(_Attribute(name))

    def derived(self, make: Callable[[IndexedDag], Made]) -> Made:
        """``make(self)``, made on first use and kept: an order or an attribute, which every split of
        this graph reads the same. An array comes back read-only, as its users share it."""
        if make not in self._derived:
            made = make(self)
            if isinstance(made, np.ndarray):
                made.flags.writeable = False
            self._derived[make] = made
        return self._derived[make]

    @cached_property
    def succ(self) -> Adjacency:
        """Successors per node for the Python loops (schedules, flow networks)."""
        return Adjacency(self.succ_ptr, self.succ_idx)

    @cached_property
    def pred(self) -> Adjacency:
        return Adjacency(self.pred_ptr, self.pred_idx)

    def program(self) -> np.ndarray:
        """Program order as an index array: simply 0..n-1."""
        return np.arange(self.n)

    def assignment(self, stages: np.ndarray) -> dict[Node, int]:
        """The ``{node: stage}`` dict of a stage array, in program order."""
        return dict(zip(self.nodes, stages.tolist()))

    def stages_of(self, assignment: dict[Node, int]) -> np.ndarray:
        return np.fromiter((assignment[v] for v in self.nodes), np.int64, self.n)

    # -- scores --------------------------------------------------------------------------------

    def stage_costs(self, stages: np.ndarray, k: int) -> np.ndarray:
        """Per-stage sums of ``cost``; inputs count toward stage 0."""
        return np.bincount(stages, weights=self.cost, minlength=k)

    def last_reader(self, values: np.ndarray) -> np.ndarray:
        """Per node, the largest of ``values`` over the node and its readers."""
        last = values.copy()
        readers = self.succ_ptr[1:] > self.succ_ptr[:-1]
        if readers.any():
            starts = self.succ_ptr[:-1][readers]
            last[readers] = np.maximum(last[readers], np.maximum.reduceat(values[self.succ_idx], starts))
        return last

    def crossings(self, stages: np.ndarray, k: int) -> np.ndarray:
        """How many boundaries each node's value crosses: up to its last reader, or the end."""
        last = self.last_reader(stages)
        last[self.output] = k - 1
        return last - stages

    def _gather(self, ptr: np.ndarray, idx: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(neighbours of ``nodes`` in CSR ``ptr``/``idx``, the position in ``nodes`` of each)."""
        counts = ptr[nodes + 1] - ptr[nodes]
        owner = np.repeat(np.arange(len(nodes)), counts)
        offsets = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        return idx[ptr[nodes][owner] + offsets], owner

    def with_producers(self, nodes: np.ndarray) -> np.ndarray:
        """``nodes`` and their predecessors: the values whose crossings moving ``nodes`` can change."""
        producers, _ = self._gather(self.pred_ptr, self.pred_idx, nodes)
        return np.unique(np.concatenate((nodes, producers)))

    def bytes_across(self, stages: np.ndarray, j: int, values: np.ndarray) -> float:
        """Bytes of ``values`` that cross boundary j: produced at or before it, read or output after."""
        readers, owner = self._gather(self.succ_ptr, self.succ_idx, values)
        later = np.bincount(owner, weights=stages[readers] > j, minlength=len(values)) > 0
        crossing = (stages[values] <= j) & (later | self.output[values])
        return float(self.nbytes[values] @ crossing)

    def total_bytes(self, stages: np.ndarray, k: int) -> float:
        """All bytes sent between stages: each value once per boundary it crosses."""
        return float(self.nbytes @ self.crossings(stages, k))

    def live_bytes(self, order: np.ndarray) -> np.ndarray:
        """Bytes live across each cut of the non-input part of ``order`` (an index permutation).

        Entry c is the cut just before the c-th non-input node. A value is live across it when
        produced before it (inputs count as produced before cut 0) and read at or after it, or
        when it is a model output. Each value adds its bytes over the span from its producer to
        its last reader, summed with a difference array in O(n + m).
        """
        s = self.n - self.num_inputs
        position = np.empty(self.n, dtype=np.int64)
        position[order] = np.arange(self.n) - self.num_inputs
        position[: self.num_inputs] = -1
        last = self.last_reader(position)
        last[self.output] = s
        live = last > position
        delta = np.bincount(position[live] + 1, weights=self.nbytes[live], minlength=s + 2)
        delta -= np.bincount(last[live] + 1, weights=self.nbytes[live], minlength=s + 2)
        return np.cumsum(delta[: s + 1])


@dataclass(frozen=True)
class _Attribute:
    """Reads one node attribute into an array; equal for equal names, so ``derived`` keeps one."""

    name: str

    def __call__(self, g: IndexedDag) -> np.ndarray:
        return np.fromiter((g.dag.nodes[v].get(self.name, 0.0) for v in g.nodes), float, g.n)


class Adjacency:
    """Neighbour lists sliced on demand from flat CSR lists.

    A list per node would keep 100,000 small objects alive, and the garbage collector would
    then rescan them (and the networkx graph) again and again; slices are short-lived.
    """

    def __init__(self, ptr: np.ndarray, idx: np.ndarray) -> None:
        self.ptr = ptr.tolist()
        self.flat = idx.tolist()

    def __getitem__(self, node: int) -> list[int]:
        return self.flat[self.ptr[node] : self.ptr[node + 1]]
