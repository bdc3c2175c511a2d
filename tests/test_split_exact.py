"""The ``exact`` strategy: MILP optimum, proof flag, time-outs that keep the best found."""

from __future__ import annotations

import sys

import networkx as nx
import pytest

from autoshard.errors import InvalidArgumentError, MissingDependencyError
from autoshard.graph import split_dag
from autoshard.testing import check_constraints
from autoshard.graph.constraints import Constraints
from autoshard.testing.graphs import layered_graph


def test_exact_beats_min_cut_where_orders_and_corridors_miss_the_optimum():
    dag = layered_graph(60, seed=0)
    heuristic = split_dag(dag, 2, return_info=True)
    exact = split_dag(dag, 2, "exact", return_info=True)
    assert exact.info.proven_optimal is True
    assert exact.info.boundary_bytes < heuristic.info.boundary_bytes
    assert exact.info.bound == heuristic.info.bound  # the same balance budget
    check_constraints(dag, exact.assignment, 2, Constraints(), exact.info.bound * (1 + 1e-9))


def test_a_time_out_returns_the_best_split_found_without_raising():
    dag = layered_graph(300, seed=0)
    heuristic = split_dag(dag, 8, return_info=True)
    rushed = split_dag(dag, 8, "exact", time_limit=0.05, return_info=True)
    assert rushed.info.proven_optimal is False
    assert rushed.info.boundary_bytes <= heuristic.info.boundary_bytes
    check_constraints(dag, rushed.assignment, 8, Constraints(), rushed.info.bound * (1 + 1e-9))


def test_one_stage_is_optimal_without_a_solver():
    dag = nx.DiGraph()
    dag.add_node("a", cost=1.0, bytes=1.0)
    result = split_dag(dag, 1, "exact", return_info=True)
    assert result.assignment == {"a": 0} and result.info.proven_optimal is True


@pytest.mark.parametrize("limit", [0, -1.0, True, "10"])
def test_time_limit_must_be_positive_seconds(limit):
    with pytest.raises(InvalidArgumentError, match="time_limit must be a number of seconds > 0"):
        split_dag(layered_graph(20), 2, "exact", time_limit=limit)


def test_without_highspy_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'autoshard\[exact\]'"):
        split_dag(layered_graph(20), 2, "exact")
