"""Properties every splitter must have, and brute-force oracles to check optimality against.

The oracles enumerate, so they only take small graphs (``BRUTE_FORCE_MAX_NODES`` non-input
nodes). They score with ``autoshard.graph.partition`` and judge validity with
``check_partition``, the same single definitions the library uses.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import networkx as nx

from autoshard.errors import AutoshardError, InvalidArgumentError
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
    """The least bottleneck over ALL valid partitions, by enumeration.

    The same value as ``min(bottleneck(dag, a, k) for a in all_partitions(dag, k))`` (stage costs
    summed in program order, as ``stage_costs`` sums them), but it enumerates over index lists and
    drops a branch once a stage costs at least the best found: scoring every partition of 8 nodes
    in 4 stages (40,000) took seconds per example, minutes while hypothesis shrinks a failure.
    """
    _check_small(dag)
    order = program_order(dag)
    index = {v: i for i, v in enumerate(order)}
    preds = [[index[p] for p in dag.predecessors(v)] for v in order]
    cost = [float(dag.nodes[v]["cost"]) for v in order]
    fills = [not is_input(dag, v) for v in order]
    left = [sum(fills[i:]) for i in range(len(order) + 1)]  # non-input nodes from position i on
    stage = [0] * len(order)
    costs, filled = [0.0] * k, [0] * k
    best = math.inf

    def extend(i: int) -> None:
        nonlocal best
        if left[i] < filled.count(0):
            return  # too few nodes left to fill every stage
        if i == len(order):
            best = min(best, max(costs))
            return
        lowest = max((stage[p] for p in preds[i]), default=0)
        for s in range(lowest, k) if fills[i] else [0]:
            before = costs[s]
            costs[s] += cost[i]
            if costs[s] < best:
                stage[i], filled[s] = s, filled[s] + fills[i]
                extend(i + 1)
                filled[s] -= fills[i]
            costs[s] = before

    extend(0)
    if best == math.inf:
        raise InvalidArgumentError(f"no valid partition of the graph into {k} stages")
    return best


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


#: How many entries of a partition, or differing nodes, a failure message shows.
SHOWN = 8


def _snapshot(dag: nx.DiGraph) -> tuple:
    """The graph's structure and a copy of every attribute dict (the graph's own dicts would change
    along with it)."""
    return ([(v, dict(data)) for v, data in dag.nodes(data=True)],
            [(u, v, dict(data)) for u, v, data in dag.edges(data=True)], dict(dag.graph))


def _first_change(before: tuple, after: tuple) -> str:
    """What differs between two snapshots, so the failure says which node, edge or attribute changed."""
    for what, old, new in (("node", before[0], after[0]), ("edge", before[1], after[1])):
        old_keys, new_keys = [item[:-1] for item in old], [item[:-1] for item in new]
        gone = [key for key in old_keys if key not in set(new_keys)]
        added = [key for key in new_keys if key not in set(old_keys)]
        if gone:
            return f"{what} {_key(gone[0])} removed"
        if added:
            return f"{what} {_key(added[0])} added"
        if old_keys != new_keys:
            return f"the {what}s are in another order (e.g. removed and added again)"
        for key, (*_, a), (*_, b) in zip(old_keys, old, new):
            if a != b:
                name = next(n for n in {**a, **b} if a.get(n, _MISSING) != b.get(n, _MISSING))
                return (f"{what} {_key(key)} attribute {name!r} changed from {a.get(name, _MISSING)!r} "
                        f"to {b.get(name, _MISSING)!r}")
    return f"graph attributes changed from {before[2]!r} to {after[2]!r}"


class _Missing:
    def __repr__(self) -> str:
        return "<absent>"


_MISSING = _Missing()


def _key(key: tuple) -> str:
    return repr(key[0]) if len(key) == 1 else f"{key[0]!r} -> {key[1]!r}"


def _check_untouched(dag: nx.DiGraph, before: tuple, call: str) -> None:
    after = _snapshot(dag)
    assert after == before, f"the splitter modified its input graph ({call}): {_first_change(before, after)}"


def _show(assignment: Mapping) -> str:
    """An assignment for a message: the first ``SHOWN`` entries, so a large graph's stays readable."""
    items = list(assignment.items())
    shown = ", ".join(f"{v!r}: {s!r}" for v, s in items[:SHOWN])
    return "{" + shown + (f", ... ({len(items)} entries)" if len(items) > SHOWN else "") + "}"


class _Rehashed(str):
    """A node name equal to the original but hashing differently, as it would under another
    ``PYTHONHASHSEED``: sets of such names iterate in another order."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash(("autoshard.testing", str(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rehashed) and str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other


def _plain(node: Hashable) -> Hashable:
    return str(node) if isinstance(node, _Rehashed) else node


def _rehashed_copy(dag: nx.DiGraph) -> nx.DiGraph:
    """A copy of ``dag`` (same order, attributes and edges) whose ``str`` node names hash differently."""
    name = {v: _Rehashed(v) if isinstance(v, str) else v for v in dag.nodes}
    copy = nx.DiGraph()
    copy.graph.update(dag.graph)
    copy.add_nodes_from((name[v], dict(data)) for v, data in dag.nodes(data=True))
    copy.add_edges_from((name[u], name[v], dict(data)) for u, v, data in dag.edges(data=True))
    return copy


def _check_same(result: Mapping, again: Any, call: str, advice: str = "") -> None:
    """Assert ``again`` is ``result`` entry by entry in the same order; name the nodes that differ."""
    first = list(result.items())
    second = [(_plain(v), s) for v, s in again.items()] if isinstance(again, Mapping) else again
    if second == first:
        return
    if not isinstance(again, Mapping):
        raise AssertionError(f"not deterministic: {call} returned a {type(again).__name__}, not a mapping")
    other = dict(second)
    moved = [f"{v!r} (stage {s!r}, then {other.get(v, _MISSING)!r})" for v, s in first
             if other.get(v, _MISSING) != s]
    moved += [f"{v!r} (absent, then stage {s!r})" for v, s in second if v not in result]
    what = (f"nodes {', '.join(moved[:SHOWN])}{' ...' if len(moved) > SHOWN else ''} moved" if moved
            else "the same stages came back in another order")
    raise AssertionError(f"not deterministic: {call} gave another split: {what}{advice}")


def check_splitter(
    split_fn: SplitFn, dag: nx.DiGraph, k: int, *, tolerance: float | None = None, rehash: bool = True
) -> Assignment:
    """Assert the properties every splitter has; return its partition for further checks.

    Always: the partition is valid (covering, exactly k non-empty stages, ordered, inputs in
    stage 0), ``dag`` is left untouched (structure and attributes), and the result is
    deterministic (same on a second call and on a copy of the graph, in the same order). The copy's
    ``str`` node names hash differently, as under another ``PYTHONHASHSEED``, so a splitter that
    iterates a set of names fails here rather than in another process; ``rehash=False`` hands it a
    plain copy instead, for a splitter that looks nodes up by names it builds itself.
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
    _check_untouched(dag, before, "first call")
    if not isinstance(result, Mapping):
        raise AssertionError(f"the splitter returned a {type(result).__name__}; it must return a mapping node -> stage")
    try:
        check_partition(dag, result, k)
    except AutoshardError as err:
        raise AssertionError(f"invalid partition {_show(result)}: {err}") from err
    _check_same(result, split_fn(dag, k), "a second call on the same graph")
    _check_untouched(dag, before, "second call")
    if rehash and any(isinstance(v, str) for v in dag.nodes):
        try:
            again = split_fn(_rehashed_copy(dag), k)
        except Exception as err:
            raise AssertionError(
                f"the splitter raised {type(err).__name__}: {err} on a copy of the graph whose node names hash "
                "differently (as under another PYTHONHASHSEED); if it looks nodes up by names it builds itself, "
                "pass rehash=False") from err
        if [(_plain(v), s) for v, s in again.items()] != list(result.items()):
            _check_same(result, split_fn(dag.copy(), k), "a copy of the graph")  # then not the hashes
        _check_same(result, again, "a copy of the graph whose node names hash differently",
                    " (a plain copy gives the same split, so unless the splitter draws random numbers it depends on "
                    "the iteration order of a set of names or on their hashes, and its result changes with "
                    "PYTHONHASHSEED: sort such sets, or iterate the graph's nodes; a splitter that looks nodes up "
                    "by names it builds itself can pass rehash=False)")
    else:
        _check_same(result, split_fn(dag.copy(), k), "a copy of the graph")
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
    bounded strategies is defined (reordered, as the splitter reorders it, where stage ranges
    cannot be kept along it: ``SplitProblem.respect_pins``).
    """
    problem = _problem(dag, k, constraints, bound)
    g = problem.graph
    order = [g.nodes[i] for i in problem.respect_pins(g.program()).tolist()]
    candidates = contiguous_partitions(dag, k, order) if contiguous else all_partitions(dag, k)
    return [a for a in candidates if not problem.violations(g.stages_of(a))]
