"""Properties every splitter must have, and brute-force oracles to check optimality against.

The oracles enumerate, so they only take small graphs (``BRUTE_FORCE_MAX_NODES`` non-input
nodes). They score with ``autoshard.graph.partition`` and judge validity with
``check_partition``, the same single definitions the library uses.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Hashable, Iterator, Sequence

import networkx as nx

from autoshard.errors import InvalidArgumentError
from autoshard.graph.invariants import check_partition
from autoshard.graph.linearize import is_input, non_inputs, program_order
from autoshard.graph.partition import bottleneck, total_boundary_bytes

Assignment = dict[Hashable, int]
SplitFn = Callable[[nx.DiGraph, int], Assignment]

#: Largest number of non-input nodes the oracles accept (k ** n partitions at most).
BRUTE_FORCE_MAX_NODES = 8
#: Relative allowance when comparing float sums computed in different orders.
REL_TOL = 1e-9


def _check_small(dag: nx.DiGraph) -> None:
    n = len(non_inputs(dag, program_order(dag)))
    if n > BRUTE_FORCE_MAX_NODES:
        raise InvalidArgumentError(
            f"brute force takes at most {BRUTE_FORCE_MAX_NODES} non-input nodes, got {n}"
        )


def all_partitions(dag: nx.DiGraph, k: int) -> Iterator[Assignment]:
    """Every valid k-stage partition of a small ``dag``, each exactly once."""
    _check_small(dag)
    order = program_order(dag)
    assignment: Assignment = {}

    def extend(i: int) -> Iterator[Assignment]:
        if i == len(order):
            if len({s for v, s in assignment.items() if not is_input(dag, v)}) == k:
                yield dict(assignment)
            return
        v = order[i]
        lowest = max((assignment[p] for p in dag.predecessors(v)), default=0)
        for s in [0] if is_input(dag, v) else range(lowest, k):
            assignment[v] = s
            yield from extend(i + 1)
        del assignment[v]

    yield from extend(0)


def contiguous_partitions(
    dag: nx.DiGraph, k: int, order: Sequence[Hashable] | None = None
) -> Iterator[Assignment]:
    """Every split of the non-input sequence of ``order`` (default program order) into k pieces."""
    order = list(order) if order is not None else program_order(dag)
    _check_small(dag)
    sequence = non_inputs(dag, order)
    for cuts in combinations(range(1, len(sequence)), k - 1):
        bounds = [0, *cuts, len(sequence)]
        assignment = dict.fromkeys(order, 0)
        for j in range(k):
            assignment.update((v, j) for v in sequence[bounds[j] : bounds[j + 1]])
        yield assignment


def brute_force_min_bottleneck(dag: nx.DiGraph, k: int) -> float:
    """The least bottleneck over ALL valid partitions, by enumeration."""
    return min(bottleneck(dag, a, k) for a in all_partitions(dag, k))


def brute_force_fixed_order_bottleneck(dag: nx.DiGraph, k: int) -> float:
    """The least bottleneck over contiguous splits of program order, by enumeration."""
    return min(bottleneck(dag, a, k) for a in contiguous_partitions(dag, k))


def brute_force_min_bytes(
    dag: nx.DiGraph, k: int, bound: float, order: Sequence[Hashable] | None = None
) -> float:
    """The fewest total boundary bytes over contiguous splits of ``order`` within ``bound``."""
    return min(
        total_boundary_bytes(dag, a, k)
        for a in contiguous_partitions(dag, k, order)
        if bottleneck(dag, a, k) <= bound * (1 + REL_TOL)
    )


def at_most(value: float, limit: float) -> bool:
    """``value <= limit`` up to float round-off."""
    return value <= limit + REL_TOL * max(abs(limit), 1.0)


def _snapshot(dag: nx.DiGraph) -> tuple:
    return list(dag.nodes(data=True)), list(dag.edges(data=True))


def check_splitter(
    split_fn: SplitFn, dag: nx.DiGraph, k: int, *, tolerance: float | None = None
) -> Assignment:
    """Assert the properties every splitter has; return its partition for further checks.

    Always: the partition is valid (covering, exactly k non-empty stages, ordered, inputs in
    stage 0), ``dag`` is left untouched, and the result is deterministic (same on a second call
    and on a copy of the graph, in the same order). On graphs small enough for brute force:
    the bottleneck is at least the true optimum over all valid partitions, and, when
    ``tolerance`` is given, at most (1 + tolerance) x the fixed-order optimum.

    The order-based splitters promise no more than that: the optimum over all partitions can be
    lower than any split of one order (independent nodes of cost 3, 3, 2, 2 in k=2 stages:
    6 contiguously, 5 as {3, 2} | {3, 2}).
    """
    before = _snapshot(dag)
    result = split_fn(dag, k)
    assert _snapshot(dag) == before, "the splitter modified its input graph"
    try:
        check_partition(dag, result, k)
    except InvalidArgumentError as err:
        raise AssertionError(f"invalid partition {result}: {err}") from err
    for again in (split_fn(dag, k), split_fn(dag.copy(), k)):
        assert list(again.items()) == list(result.items()), f"not deterministic: {result} vs {again}"
    if len(non_inputs(dag, program_order(dag))) <= BRUTE_FORCE_MAX_NODES:
        _check_optimality(dag, k, bottleneck(dag, result, k), tolerance)
    return result


def _check_optimality(dag: nx.DiGraph, k: int, achieved: float, tolerance: float | None) -> None:
    best = brute_force_min_bottleneck(dag, k)
    assert at_most(best, achieved), f"bottleneck {achieved} beats the brute-force optimum {best}"
    if tolerance is not None:
        limit = (1 + tolerance) * brute_force_fixed_order_bottleneck(dag, k)
        assert at_most(achieved, limit), f"bottleneck {achieved} exceeds (1+tol) x optimum {limit}"
