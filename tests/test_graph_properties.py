"""Property tests of the splitter against brute force, on random chains and DAGs."""

from __future__ import annotations

import functools
import itertools
from itertools import combinations, product

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.errors import InvalidArgumentError
from autoshard.graph import (
    bottleneck,
    boundary_bytes,
    boundary_values,
    check_partition,
    min_bottleneck,
    split_dag,
    total_boundary_bytes,
)
from autoshard.graph.balance import live_bytes_at_cuts, min_bytes_partition
from autoshard.graph.indexed import IndexedDag
from autoshard.graph.invariants import check_order
from autoshard.graph.linearize import ORDERS, is_input, is_output, non_inputs, program_order
from autoshard.testing import (
    all_partitions,
    brute_force_min_bottleneck,
    brute_force_min_bytes,
    check_splitter,
)
from autoshard.testing.properties import at_most, total_cost
from autoshard.testing.strategies import chains, dags, shaped_dags, split_problems, weights

BUILTIN = ("min-cut", "fixed-order", "greedy", "uniform", "exact")
BOUNDED = ("min-cut", "fixed-order", "exact")
tolerances = st.sampled_from([0.0, 0.02, 0.25])
fast = settings(max_examples=100, deadline=None)


def close(a: float, b: float) -> bool:
    return at_most(a, b) and at_most(b, a)


def splitter(strategy: str, tolerance: float = 0.02):
    return functools.partial(split_dag, strategy=strategy, tolerance=tolerance)


def order_weights(dag, order) -> list[float]:
    """Costs along the non-input sequence, the inputs' cost on the first (stage 0) node."""
    sequence = non_inputs(dag, order)
    inputs = sum(dag.nodes[v]["cost"] for v in order if is_input(dag, v))
    return [dag.nodes[v]["cost"] + (inputs if i == 0 else 0.0) for i, v in enumerate(sequence)]


def from_cuts(dag, order, cuts) -> dict:
    sequence = non_inputs(dag, order)
    bounds = [0, *cuts, len(sequence)]
    assignment = dict.fromkeys(order, 0)
    for j in range(len(bounds) - 1):
        assignment.update((v, j) for v in sequence[bounds[j] : bounds[j + 1]])
    return assignment


# --- every strategy -----------------------------------------------------------------------


@fast
@given(split_problems(dags() | shaped_dags()), st.sampled_from(BUILTIN), tolerances)
def test_every_strategy_splits_random_dags_validly(problem, strategy, tolerance):
    dag, k = problem
    bound = tolerance if strategy in BOUNDED else None
    check_splitter(splitter(strategy, tolerance), dag, k, tolerance=bound)


@fast
@given(split_problems(chains(max_nodes=10), max_stages=5), st.sampled_from(BUILTIN))
def test_every_strategy_splits_random_chains_validly(problem, strategy):
    dag, k = problem
    check_splitter(splitter(strategy), dag, k, tolerance=0.02 if strategy in BOUNDED else None)


@fast
@given(split_problems(chains(), max_stages=5), st.sampled_from(BOUNDED))
def test_on_chains_the_bounded_strategies_reach_the_true_optimum(problem, strategy):
    dag, k = problem
    result = split_dag(dag, k, strategy, tolerance=0.0)
    achieved, best = bottleneck(dag, result, k), brute_force_min_bottleneck(dag, k)
    assert at_most(achieved, best, total_cost(dag)) and at_most(best, achieved)


@fast
@given(split_problems(dags(max_nodes=10) | shaped_dags(max_nodes=10)), tolerances)
def test_min_cut_never_sends_more_than_fixed_order_and_stays_in_budget(problem, tolerance):
    dag, k = problem
    fixed = split_dag(dag, k, "fixed-order", tolerance)
    unrefined = split_dag(dag, k, "min-cut", tolerance, refine=False)
    refined = split_dag(dag, k, "min-cut", tolerance)
    exact = split_dag(dag, k, "exact", tolerance)
    sent = [total_boundary_bytes(dag, a, k) for a in (fixed, unrefined, refined, exact)]
    assert at_most(sent[3], sent[2]) and at_most(sent[2], sent[1]) and at_most(sent[1], sent[0])
    budget = (1 + tolerance) * min_bottleneck(order_weights(dag, program_order(dag)), k)
    for assignment in (fixed, unrefined, refined, exact):
        assert at_most(bottleneck(dag, assignment, k), budget, total_cost(dag))


# --- balance primitives against brute force -----------------------------------------------


@fast
@given(st.lists(weights, min_size=1, max_size=9), st.data())
def test_min_bottleneck_equals_brute_force_over_cut_positions(values, data):
    k = data.draw(st.integers(1, len(values)))
    brute = min(
        max(sum(values[a:b]) for a, b in zip((0, *cuts), (*cuts, len(values))))
        for cuts in combinations(range(1, len(values)), k - 1)
    )
    assert close(min_bottleneck(values, k), brute)


def test_min_bottleneck_does_not_absorb_an_element_below_the_round_off_allowance():
    # The allowance (1e-9 of the total) let the middle part take the tiny last element, so
    # the bound came out 100 + 1.2e-7 where three parts reach exactly 100.
    assert min_bottleneck([20.0, 100.0, 1.192092896e-07], 3) == 100.0


@pytest.mark.parametrize("strategy", BOUNDED)
def test_tiny_costs_within_the_round_off_allowance_do_not_raise_the_bound(strategy):
    # Greedy parts within the allowance covered under the probe 20, which no split reaches, taking
    # the tiny costs along: the bound came out 20 + 4e-8 where 20 + 1e-8 is reachable, and every
    # bounded strategy used it and the allowance again (20 + 6e-8, over 1e-9 of the total).
    costs, sizes = [20.0, 3e-8, 3e-8, 20.0, 1e-8], [100.0, 100.0, 1.0, 1.0, 0.0]
    assert min_bottleneck(costs, 3) == pytest.approx(20.0 + 1e-8, rel=1e-14)
    dag = nx.DiGraph()
    for i, (cost, size) in enumerate(zip(costs, sizes)):
        dag.add_node(f"v{i}", cost=cost, bytes=size)
    nx.add_path(dag, list(dag.nodes))
    check_splitter(splitter(strategy, 0.0), dag, 3, tolerance=0.0)


@fast
@given(split_problems(dags()), st.sampled_from(sorted(ORDERS)), tolerances)
def test_dp_sends_the_brute_force_minimum_within_the_bound(problem, order_name, tolerance):
    dag, k = problem
    order = ORDERS[order_name](dag)
    values = order_weights(dag, order)
    bound = (1 + tolerance) * min_bottleneck(values, k)
    live = live_bytes_at_cuts(dag, order)
    cuts = min_bytes_partition(values, live, k, bound)
    assignment = from_cuts(dag, order, cuts)
    check_partition(dag, assignment, k)
    assert at_most(bottleneck(dag, assignment, k), bound, total_cost(dag))
    sent = total_boundary_bytes(dag, assignment, k)
    assert close(sent, sum(live[c] for c in cuts))
    assert close(sent, brute_force_min_bytes(dag, k, bound, order))


@fast
@given(dags(max_nodes=10), st.sampled_from(sorted(ORDERS)))
def test_live_bytes_sweep_equals_the_naive_count(dag, order_name):
    order = ORDERS[order_name](dag)
    sequence = non_inputs(dag, order)
    position = {v: (sequence.index(v) if v in sequence else -1) for v in order}

    def naive(c: int) -> float:
        return sum(
            dag.nodes[u]["bytes"]
            for u in order
            if position[u] < c
            and (is_output(dag, u) or any(position[v] >= c for v in dag.successors(u)))
        )

    live = live_bytes_at_cuts(dag, order)
    assert len(live) == len(sequence) + 1
    assert all(close(bytes_, naive(c)) for c, bytes_ in enumerate(live))


# --- orders, scores and validity ----------------------------------------------------------


@fast
@given(dags())
def test_every_order_is_topological_inputs_first_and_deterministic(dag):
    inputs = [v for v in dag.nodes if is_input(dag, v)]
    for make in ORDERS.values():
        order = make(dag)
        check_order(dag, order)
        assert order[: len(inputs)] == inputs
        assert make(dag.copy()) == order


@fast
@given(split_problems(dags(max_nodes=6), max_stages=3), st.data())
def test_boundary_scores_follow_the_definition(problem, data):
    dag, k = problem
    assignment = data.draw(st.sampled_from(list(all_partitions(dag, k))))
    order = program_order(dag)

    def crosses(u, j: int) -> bool:
        later = any(assignment[v] > j for v in dag.successors(u))
        return assignment[u] <= j and (later or is_output(dag, u))

    expected = [[u for u in order if crosses(u, j)] for j in range(k - 1)]
    assert boundary_values(dag, assignment, k) == expected
    sizes = [sum(dag.nodes[u]["bytes"] for u in values) for values in expected]
    assert all(close(a, b) for a, b in zip(boundary_bytes(dag, assignment, k), sizes))
    assert close(total_boundary_bytes(dag, assignment, k), sum(sizes))


@settings(max_examples=40, deadline=None)
@given(split_problems(dags(max_nodes=4, max_inputs=1), max_stages=3))
def test_check_partition_accepts_exactly_the_enumerated_partitions(problem):
    dag, k = problem
    order = program_order(dag)
    accepted = []
    for stages in product(range(k), repeat=len(order)):
        candidate = dict(zip(order, stages))
        try:
            check_partition(dag, candidate, k)
        except InvalidArgumentError:
            continue
        accepted.append(candidate)
    assert accepted == sorted(all_partitions(dag, k), key=lambda a: [a[v] for v in order])


@fast
@given(split_problems(dags(max_nodes=6) | shaped_dags(max_nodes=6), max_stages=3), st.data())
def test_per_boundary_bytes_add_up_to_the_total(problem, data):
    # Refinement scores a move by the change at one boundary; that is only sound if the
    # per-boundary counts add up to the total the library reports.
    dag, k = problem
    assignment = data.draw(st.sampled_from(list(all_partitions(dag, k))))
    g = IndexedDag(dag)
    stages = g.stages_of(assignment)
    everything = np.arange(g.n)
    per_boundary = [g.bytes_across(stages, j, everything) for j in range(k - 1)]
    assert all(close(a, b) for a, b in zip(per_boundary, boundary_bytes(dag, assignment, k)))
    assert close(g.total_bytes(stages, k), total_boundary_bytes(dag, assignment, k))


# -- the kit catches splitters that break a promise ------------------------------------------------
def _rescaling(dag, k):
    for _, data in dag.nodes(data=True):
        data["cost"] *= 1000  # changes the caller's graph
    return split_dag(dag, k)


def _tagging_the_graph(dag, k):
    dag.graph["split"] = "mine"
    return split_dag(dag, k)


def _one_stage_short(dag, k):
    return {v: min(s, k - 2) for v, s in split_dag(dag, k).items()}


def _backwards(dag, k):
    return {v: k - 1 - s for v, s in split_dag(dag, k).items()}


_CALLS = itertools.count()


def _alternating(dag, k):
    """Two valid splits in turn: a splitter whose answer depends on something besides its input."""
    return split_dag(dag, k, "min-cut" if next(_CALLS) % 2 else "uniform")


@pytest.mark.parametrize("broken, message", [
    (_rescaling, "modified its input graph"),
    (_tagging_the_graph, "modified its input graph"),
    (_one_stage_short, "invalid partition"),
    (_backwards, "invalid partition"),
    (_alternating, "not deterministic"),
])
def test_check_splitter_fails_a_splitter_that_breaks_a_promise(broken, message):
    dag = nx.DiGraph()
    for i, cost in enumerate([3.0, 1.0, 2.0, 5.0, 1.0, 4.0]):
        dag.add_node(f"v{i}", cost=cost, bytes=1.0)
    nx.add_path(dag, list(dag.nodes))
    check_splitter(lambda d, k: split_dag(d, k), dag, 3)  # the unbroken one passes
    with pytest.raises(AssertionError, match=message):
        check_splitter(broken, dag, 3)
