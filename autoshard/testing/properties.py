"""Properties every splitter must have, and brute-force oracles to check optimality against.

The oracles enumerate, so they only take small graphs (``BRUTE_FORCE_MAX_NODES`` non-input
nodes). They score with ``autoshard.graph.partition`` and judge validity with
``check_partition``, the same single definitions the library uses.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Callable, Hashable, Iterator, Sequence

import networkx as nx

from autoshard.errors import InvalidArgumentError
from autoshard.graph.constraints import Constraints
from autoshard.graph.invariants import check_partition
from autoshard.graph.linearize import is_input, non_inputs, program_order
from autoshard.graph.partition import bottleneck, total_boundary_bytes
from autoshard.graph.problem import SplitProblem
from autoshard.graph.split import split_dag

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


def at_most(value: float, limit: float, scale: float = 0.0) -> bool:
    """``value <= limit`` up to float round-off, relative to ``limit`` or to ``scale`` if larger.

    Stage costs are compared with a round-off allowance of 1e-9 of the graph's total cost
    (``split_dag``'s documented allowance): pass ``scale=total_cost(dag)`` for bottlenecks, or a
    node far smaller than the total can sit one stage later than the brute force puts it."""
    return value <= limit + REL_TOL * max(abs(limit), abs(scale), 1.0)


def total_cost(dag: nx.DiGraph) -> float:
    """The sum of the nodes' costs: the scale of the splitters' round-off allowance."""
    return float(sum(cost for _, cost in dag.nodes(data="cost", default=0.0)))


def _snapshot(dag: nx.DiGraph) -> tuple:
    """The graph's structure and a copy of every attribute dict (the graph's own dicts would change
    along with it)."""
    return ([(v, dict(data)) for v, data in dag.nodes(data=True)],
            [(u, v, dict(data)) for u, v, data in dag.edges(data=True)], dict(dag.graph))


def check_splitter(
    split_fn: SplitFn, dag: nx.DiGraph, k: int, *, tolerance: float | None = None
) -> Assignment:
    """Assert the properties every splitter has; return its partition for further checks.

    Always: the partition is valid (covering, exactly k non-empty stages, ordered, inputs in
    stage 0), ``dag`` is left untouched (structure and attributes), and the result is
    deterministic within the process (same on a second call and on a copy of the graph, in the
    same order; a splitter that iterates a set of string nodes can still differ from one process
    to the next: run the tests under a few ``PYTHONHASHSEED`` values to see that).
    On graphs small enough for brute force:
    the bottleneck is at least the true optimum over all valid partitions. When ``tolerance``
    is given (the splitter promises balance): the bottleneck is at most (1 + tolerance) x the
    fixed-order optimum, and the boundary bytes are no more than the fewest any contiguous
    split of program order sends within that bound (by brute force on small graphs, else as
    the library's ``fixed-order`` strategy finds them).

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
    small = len(non_inputs(dag, program_order(dag))) <= BRUTE_FORCE_MAX_NODES
    achieved = bottleneck(dag, result, k)
    if small:
        best = brute_force_min_bottleneck(dag, k)
        assert at_most(best, achieved, total_cost(dag)), f"bottleneck {achieved} beats the brute-force optimum {best}"
    if tolerance is not None:
        _check_bounded(dag, k, result, tolerance, small)
    return result


def _check_bounded(dag: nx.DiGraph, k: int, result: Assignment, tolerance: float, small: bool) -> None:
    """The bottleneck within the tolerance, and no more bytes than the fixed-order optimum."""
    if small:
        limit = (1 + tolerance) * brute_force_fixed_order_bottleneck(dag, k)
        fewest = brute_force_min_bytes(dag, k, limit)
    else:
        reference = split_dag(dag, k, "fixed-order", tolerance, return_info=True)
        limit, fewest = reference.info.bound, reference.info.boundary_bytes
    achieved = bottleneck(dag, result, k)
    assert at_most(achieved, limit, total_cost(dag)), f"bottleneck {achieved} exceeds (1+tol) x optimum {limit}"
    sent = total_boundary_bytes(dag, result, k)
    assert at_most(sent, fewest), f"sends {sent} bytes; the fixed-order optimum sends {fewest}"


def _problem(dag: nx.DiGraph, k: int, constraints: Constraints, bound: float) -> SplitProblem:
    return SplitProblem(dag, k, 0.0, constraints, bound=bound)


def constraint_violations(
    dag: nx.DiGraph, assignment: Assignment, k: int, constraints: Constraints = Constraints(),
    bound: float = math.inf,
) -> list[str]:
    """What ``assignment`` breaks: validity, the hard ``constraints``, and stage budgets.

    Stage j may cost at most ``bound`` x capacity_j (and its memory budget); the default bound
    checks the constraints alone. An empty list means everything holds.
    """
    problem = _problem(dag, k, constraints, bound)
    return problem.violations(problem.graph.stages_of(assignment))


def check_constraints(
    dag: nx.DiGraph, assignment: Assignment, k: int, constraints: Constraints = Constraints(),
    bound: float = math.inf,
) -> None:
    """Assert that ``assignment`` is valid and honours ``constraints`` within ``bound``."""
    broken = constraint_violations(dag, assignment, k, constraints, bound)
    assert not broken, f"{assignment} breaks: {'; '.join(broken)}"


def relative_bottleneck(dag: nx.DiGraph, assignment: Assignment, k: int, constraints: Constraints) -> float:
    """max_j cost_j / capacity_j: the bottleneck that capacities make the splitter balance."""
    problem = _problem(dag, k, constraints, math.inf)
    return problem.bottleneck(problem.graph.stages_of(assignment))


def brute_force_constrained(
    dag: nx.DiGraph, k: int, constraints: Constraints, *, contiguous: bool, bound: float = math.inf
) -> list[Assignment]:
    """Every partition of a small ``dag`` that honours ``constraints`` within ``bound``.

    ``contiguous`` limits the search to splits of program order, as the balance bound of the
    bounded strategies is defined.
    """
    problem = _problem(dag, k, constraints, bound)
    g = problem.graph
    candidates = contiguous_partitions(dag, k) if contiguous else all_partitions(dag, k)
    return [a for a in candidates if not problem.violations(g.stages_of(a))]
