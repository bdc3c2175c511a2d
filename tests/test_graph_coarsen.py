"""Coarse graphs for min-cut (``autoshard.graph.coarsen``) and min-cut's use of them."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.graph import split_dag
from autoshard.graph.coarsen import clusters, project, quotient, single_reader_sizes
from autoshard.graph.indexed import IndexedDag
from autoshard.testing.graphs import layered_graph
from autoshard.testing.strategies import dags, shaped_dags

fast = settings(max_examples=80, deadline=None)


def coarse(dag: nx.DiGraph, min_bytes: float, max_cost: float) -> tuple[IndexedDag, nx.DiGraph, np.ndarray]:
    g = IndexedDag(dag)
    return (g, *quotient(g, clusters(g, min_bytes, max_cost)))


@fast
@given(shaped_dags(max_nodes=12) | dags(max_nodes=12), st.sampled_from([0.0, 2.0, 1e9]),
       st.sampled_from([0.0, 3.0, np.inf]))
def test_only_single_reader_values_merge_and_the_quotient_is_a_dag(dag, min_bytes, max_cost):
    g, quot, cluster = coarse(dag, min_bytes, max_cost)
    assert nx.is_directed_acyclic_graph(quot)
    assert sorted(quot.nodes) == list(range(len(quot))) == sorted(set(cluster.tolist()))
    readers = np.diff(g.succ_ptr)
    for c in range(len(quot)):
        members = np.flatnonzero(cluster == c)
        if len(members) > 1:
            assert g.cost[members].sum() <= max_cost
        sent = [v for v in members.tolist()
                if g.output[v] or any(cluster[w] != c for w in g.succ[v])]
        assert len(sent) <= 1, "a cluster sends at most one value: its root's"
        for v in members.tolist():
            if v not in sent and len(members) > 1 and readers[v]:
                assert readers[v] == 1 and g.nbytes[v] >= min_bytes and not g.output[v]
        assert quot.nodes[c]["bytes"] == sum(g.nbytes[v] for v in sent)
        assert quot.nodes[c]["cost"] == pytest.approx(g.cost[members].sum())
    assert all(quot.nodes[cluster[v]]["input"] for v in range(g.num_inputs))


@fast
@given(shaped_dags(max_nodes=12) | dags(max_nodes=12), st.integers(2, 4), st.randoms(use_true_random=False))
def test_a_coarse_split_sends_exactly_the_bytes_of_its_projection(dag, k, rng):
    g, quot, cluster = coarse(dag, 0.0, np.inf)
    q = IndexedDag(quot)
    k = min(k, q.n - q.num_inputs)
    if k < 1:
        return
    # a random ordered split of the coarse graph: cut a topological order anywhere
    cuts = sorted(rng.sample(range(1, q.n - q.num_inputs), k - 1)) if k > 1 else []
    stages = np.zeros(q.n, dtype=np.int64)
    stages[q.num_inputs:] = np.searchsorted(cuts, np.arange(q.n - q.num_inputs), side="right")
    fine = project(q, stages, cluster)
    assert np.all(fine[g.src] <= fine[g.dst])
    assert g.total_bytes(fine, k) == q.total_bytes(stages, k)


def test_merged_values_are_the_large_ones_with_one_reader():
    dag = layered_graph(200, seed=3)
    g = IndexedDag(dag)
    sizes = single_reader_sizes(g)
    assert len(sizes) and set(sizes.tolist()) <= {256.0, 1024.0, 4096.0, 65536.0}
    _, quot, _ = coarse(dag, 4096.0, np.inf)
    _, finer, _ = coarse(dag, 65536.0, np.inf)
    assert len(quot) < len(finer) < g.n


def test_coarse_graphs_find_cuts_that_single_node_moves_miss():
    # layered-100 at k = 2: moves and boundary cuts stop at a split sending 4,352 bytes; the proven
    # optimum sends 4,096, and min-cut reaches it through a coarse graph.
    dag = layered_graph(100, seed=1)
    fine_only = split_dag(dag, 2, coarsen=False, return_info=True).info
    default = split_dag(dag, 2, return_info=True).info
    optimum = split_dag(dag, 2, "exact", return_info=True).info
    assert optimum.proven_optimal
    assert default.boundary_bytes == optimum.boundary_bytes < fine_only.boundary_bytes
    assert default.bottleneck <= default.bound


@pytest.mark.parametrize("seed", range(2))
def test_coarse_graphs_never_make_min_cut_worse(seed):
    dag = layered_graph(150, seed=seed)
    for k in (2, 8):
        fine_only = split_dag(dag, k, coarsen=False, return_info=True).info
        default = split_dag(dag, k, return_info=True).info
        assert default.boundary_bytes <= fine_only.boundary_bytes
        assert default.bottleneck <= default.bound * (1 + 1e-9)


def test_graphs_of_mostly_cost_free_nodes_are_not_coarsened(monkeypatch):
    """As in a traced model weighed by its parameters: the coarse graphs found nothing there."""
    import autoshard.graph.split as split_module

    calls = []
    monkeypatch.setattr(split_module, "_coarse_split", lambda *args: calls.append(args[1]))
    dag = layered_graph(100, seed=1)
    split_dag(dag, 2)
    assert len(calls) == 2  # one per quantile
    nodes = sorted(v for v in dag if not dag.nodes[v].get("input"))
    for v in nodes[: (len(nodes) + 1) // 2]:
        dag.nodes[v]["cost"] = 0.0
    calls.clear()
    split_dag(dag, 2)
    assert calls == []


def test_kicks_on_graphs_of_mostly_cost_free_nodes_stop_when_they_stop_paying(monkeypatch):
    import autoshard.graph.split as split_module

    patience = []
    real_improve = split_module.local_moves.improve
    monkeypatch.setattr(split_module.local_moves, "improve",
                        lambda *args, **kwargs: (patience.extend(args[7:8]), real_improve(*args, **kwargs))[1])
    dag = layered_graph(100, seed=1)
    split_dag(dag, 2)
    assert patience and set(patience) == {None}  # every search with kicks (coarse graphs too) runs them all
    for v in sorted(v for v in dag if not dag.nodes[v].get("input"))[::2]:
        dag.nodes[v]["cost"] = 0.0
    patience.clear()
    split_dag(dag, 2)
    assert patience == [split_module.MOSTLY_FREE_KICK_PATIENCE]  # and no coarse graphs
