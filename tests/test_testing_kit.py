"""The public test kit fails splitters that break a promise, and says which promise and where."""

from __future__ import annotations

from typing import Callable

import networkx as nx
import pytest
from hypothesis import given, settings

from autoshard.graph import bottleneck, split_dag
from autoshard.testing import all_partitions, brute_force_min_bottleneck, check_splitter
from autoshard.testing.strategies import chains, dags, shaped_dags, split_problems

Splitter = Callable[[nx.DiGraph, int], dict]


def chain(costs: list[float], size: float = 1.0) -> nx.DiGraph:
    dag = nx.DiGraph()
    for i, cost in enumerate(costs):
        dag.add_node(f"v{i}", cost=cost, bytes=size)
    nx.add_path(dag, list(dag.nodes))
    return dag


def correct(dag: nx.DiGraph, k: int) -> dict:
    return split_dag(dag, k)


def first_names_in_a_set(dag: nx.DiGraph, k: int) -> dict:
    """Cuts before the first k - 1 names a set yields: every cut is as good on a graph that costs
    nothing, but which one comes first changes with PYTHONHASHSEED."""
    order = list(dag.nodes)
    cuts = [v for v in set(order) if v != order[0]][: k - 1]
    starts = sorted(order.index(v) for v in cuts)
    return {v: sum(start <= i for start in starts) for i, v in enumerate(order)}


def test_a_splitter_that_iterates_a_set_of_names_fails_in_one_process():
    # Before, only a run under another PYTHONHASHSEED could see it: the copy hashed alike.
    dag = chain([0.0] * 20, size=0.0)  # 11,628 equally good splits into 6 stages
    check_splitter(correct, dag, 6)
    with pytest.raises(AssertionError, match=r"not deterministic: a copy of the graph whose node names hash "
                                             r"differently gave another split: nodes 'v\d+' \(stage \d, then \d\)"
                                             r".*PYTHONHASHSEED: sort such sets"):
        check_splitter(first_names_in_a_set, dag, 6)


def test_a_splitter_that_looks_nodes_up_by_name_is_told_about_rehash_false():
    def by_name(dag: nx.DiGraph, k: int) -> dict:
        first = dag.nodes["v0"]  # a name the splitter builds itself: plain hash
        return split_dag(dag, k) if first else {}

    dag = chain([3.0, 1.0, 2.0, 5.0])
    with pytest.raises(AssertionError, match=r"raised KeyError: 'v0' on a copy of the graph whose node names "
                                             r"hash differently .* pass rehash=False"):
        check_splitter(by_name, dag, 2)
    check_splitter(by_name, dag, 2, rehash=False)


def test_the_failure_names_the_nodes_that_moved_between_calls():
    calls = iter(range(100))

    def alternating(dag: nx.DiGraph, k: int) -> dict:
        return split_dag(dag, k, "min-cut" if next(calls) % 2 else "uniform")

    with pytest.raises(AssertionError, match=r"not deterministic: a second call on the same graph gave another "
                                             r"split: nodes 'v\d' \(stage \d, then \d\)"):
        check_splitter(alternating, chain([3.0, 1.0, 2.0, 5.0, 1.0, 4.0]), 3)


def test_the_failure_says_when_only_the_order_of_the_entries_changed():
    calls = iter(range(100))

    def reordering(dag: nx.DiGraph, k: int) -> dict:
        result = split_dag(dag, k)
        return result if next(calls) % 2 == 0 else dict(reversed(list(result.items())))

    with pytest.raises(AssertionError, match="the same stages came back in another order"):
        check_splitter(reordering, chain([3.0, 1.0, 2.0]), 2)


def rescaling_bytes(dag: nx.DiGraph, k: int) -> dict:
    for _, data in dag.nodes(data=True):
        data["bytes"] *= 2
    return split_dag(dag, k)


def dropping_inner_edges(dag: nx.DiGraph, k: int) -> dict:
    result = split_dag(dag, k)
    dag.remove_edges_from([(u, v) for u, v in dag.edges if result[u] == result[v]])
    return result


def moving_the_first_node_last(dag: nx.DiGraph, k: int) -> dict:
    first, *_ = dag.nodes
    data, successors = dict(dag.nodes[first]), list(dag.successors(first))
    dag.remove_node(first)
    dag.add_node(first, **data)
    dag.add_edges_from((first, v) for v in successors)
    return split_dag(dag, k)


seen: set[int] = set()


def caching_from_the_second_call(dag: nx.DiGraph, k: int) -> dict:
    if id(dag) in seen:
        dag.graph["cached"] = True
    seen.add(id(dag))
    return split_dag(dag, k)


@pytest.mark.parametrize("broken, message", [
    (rescaling_bytes, r"modified its input graph \(first call\): node 'v0' attribute 'bytes' changed from 1.0 to 2.0"),
    (dropping_inner_edges, r"modified its input graph \(first call\): edge 'v\d' -> 'v\d' removed"),
    (moving_the_first_node_last, r"modified its input graph \(first call\): the nodes are in another order"),
    (caching_from_the_second_call, r"modified its input graph \(second call\): graph attributes changed from \{\} "
                                   r"to \{'cached': True\}"),
])
def test_the_failure_says_how_the_input_graph_changed(broken: Splitter, message: str):
    with pytest.raises(AssertionError, match=message):
        check_splitter(broken, chain([3.0, 1.0, 2.0, 5.0, 1.0, 4.0]), 3)


@pytest.mark.parametrize("broken, message", [
    (lambda d, k: list(split_dag(d, k).values()), "the splitter returned a list; it must return a mapping"),
    (lambda d, k: {v: float(s) for v, s in split_dag(d, k).items()}, r"stage 0.0, a float; stages are the ints 0..1"),
    (lambda d, k: {v: bool(s) for v, s in split_dag(d, k).items()}, r"stage False, a bool; stages are the ints 0..1"),
    (lambda d, k: {v: s + 1 for v, s in split_dag(d, k).items()}, r"stage 2; stages are 0..1"),
])
def test_a_result_of_the_wrong_kind_fails_as_an_assertion_that_names_it(broken: Splitter, message: str):
    with pytest.raises(AssertionError, match=message):
        check_splitter(broken, chain([3.0, 1.0, 2.0, 5.0]), 2)


def test_an_invalid_partition_of_a_large_graph_is_shown_in_part():
    dag = chain([1.0] * 100)
    with pytest.raises(AssertionError, match=r"invalid partition \{'v0': 0, .*'v7': 0, \.\.\. \(99 entries\)\}: "
                                             r"covering: node 'v99' is not assigned"):
        check_splitter(lambda d, k: {v: s for v, s in split_dag(d, k).items() if v != "v99"}, dag, 4)


@settings(max_examples=60, deadline=None)
@given(split_problems(dags() | shaped_dags() | chains()))
def test_the_pruned_brute_force_bottleneck_is_the_enumerated_one(problem):
    dag, k = problem
    assert brute_force_min_bottleneck(dag, k) == min(bottleneck(dag, a, k) for a in all_partitions(dag, k))
