"""Single-node moves and iterated local search (``autoshard.graph.moves``), and the orders that
pull costly nodes forward or push them back (``linearize.pull_forward`` / ``push_back``)."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.errors import InfeasibleSplitError
from autoshard.graph import split_dag, total_boundary_bytes
from autoshard.graph import moves
from autoshard.graph.constraints import Constraints
from autoshard.graph.linearize import pull_forward, push_back
from autoshard.graph.problem import SplitProblem
from autoshard.graph.split import _fewer_values
from autoshard.testing import check_constraints
from autoshard.testing.graphs import layered_graph
from autoshard.testing.strategies import constrained_problems, dags, shaped_dags, split_problems

fast = settings(max_examples=60, deadline=None)


def valid_and_no_worse(problem: SplitProblem, start: np.ndarray, found: np.ndarray) -> None:
    g, k = problem.graph, problem.k
    assert problem.violations(found) == []
    assert g.total_bytes(found, k) <= g.total_bytes(start, k)


@fast
@given(constrained_problems(shaped_dags(max_nodes=9) | dags(max_nodes=9)), st.sampled_from([0.0, 0.25]))
def test_moves_kicks_and_fewer_values_keep_every_rule_and_never_send_more(problem, tolerance):
    dag, k, constraints = problem
    try:
        split = SplitProblem(dag, k, tolerance, constraints)
        start = split.dp_split(split.graph.program())
    except InfeasibleSplitError:  # such draws are covered in test_split_constraints
        return
    groups = [m for _, m in split.rules.groups]
    fixed = np.unique(np.concatenate(groups)) if groups else None
    pinned = split.pinned_boundaries(start)
    bounds = split.rules.ranges
    improved = moves.improve(split.graph, start, k, split.limits(), pinned, fixed, bounds=bounds)
    valid_and_no_worse(split, start, improved)
    searched = moves.improve(split.graph, improved, k, split.limits(), pinned, fixed, kicks=10, bounds=bounds)
    valid_and_no_worse(split, improved, searched)
    if fixed is not None:
        assert np.array_equal(searched[fixed], start[fixed])  # together groups never move
    assert split.pinned_boundaries(searched) == pinned
    fewer = _fewer_values(split, start)  # also keeps the bottleneck and lets no more values cross
    valid_and_no_worse(split, start, fewer)
    assert split.bottleneck(fewer) <= split.bottleneck(start) * (1 + 1e-9) + 1e-9
    assert split.graph.crossings(fewer, k).sum() <= split.graph.crossings(start, k).sum()
    assert split.pinned_boundaries(fewer) == pinned


@fast
@given(split_problems(dags(max_nodes=10) | shaped_dags(max_nodes=10)), st.data())
def test_each_move_gains_exactly_the_bytes_it_saves(problem, data):
    dag, k = problem
    split = SplitProblem(dag, k, 1.0)
    g = split.graph
    state = moves._State(g, split.dp_split(g.program()), k, split.limits(), [])
    for _ in range(data.draw(st.integers(1, 12))):
        options = [(v, b) for v in range(g.num_inputs, g.n) for b in state.targets_within(v)]
        if not options:
            break
        v, b = data.draw(st.sampled_from(options))
        before = g.total_bytes(np.array(state.stage), k)
        gain = state.gain(v, b)
        state.move(v, b)
        after = np.array(state.stage)
        # The recount subtracts two sums of the whole split: its round-off scales with their size.
        assert gain == pytest.approx(before - g.total_bytes(after, k), abs=1e-12 * max(1.0, before))
        fresh = moves._State(g, after, k, split.limits(), [])
        assert (state.top, state.top_count, state.count) == (fresh.top, fresh.top_count, fresh.count)


def test_a_split_tying_on_bytes_lets_fewer_values_cross():
    """A value of no bytes (a shape's carrier) read past a cut ties with a cut after its reader on
    bytes, but is one more message: the moves take its reader across, with the one it reads."""
    dag = nx.DiGraph()
    for name, cost, nbytes, reads in (("a", 1.0, 10.0, []), ("z", 0.0, 0.0, ["a"]), ("v", 0.0, 10.0, ["a", "z"]),
                                      ("d", 1.0, 10.0, ["v"])):
        dag.add_node(name, cost=cost, bytes=nbytes)
        dag.add_edges_from((read, name) for read in reads)
    dag.nodes["d"]["output"] = True
    split = SplitProblem(dag, 2, 0.0)
    g = split.graph
    start = g.stages_of({"a": 0, "z": 0, "v": 1, "d": 1})
    found = moves.fewer_values(g, start, 2, split.limits())
    assert g.total_bytes(found, 2) == g.total_bytes(start, 2) == 10.0
    assert (g.crossings(start, 2).sum(), g.crossings(found, 2).sum()) == (2, 1)
    assert split_dag(dag, 2) in ({"a": 0, "z": 0, "v": 0, "d": 1}, {"a": 0, "z": 1, "v": 1, "d": 1})


def test_moves_that_cost_bytes_for_a_while_reach_the_proven_optimum():
    # Stage 0 must take a costly node (a fifth of a stage) and give up four light ones whose
    # large values are read in stage 1: no single boundary move gains on its own.
    dag = layered_graph(60, seed=1)
    without = split_dag(dag, 2, tolerance=0.02, moves=False, return_info=True).info
    with_moves = split_dag(dag, 2, tolerance=0.02, return_info=True).info
    exact = split_dag(dag, 2, "exact", tolerance=0.02, return_info=True).info
    assert exact.proven_optimal
    assert with_moves.boundary_bytes == exact.boundary_bytes == 11264
    assert without.boundary_bytes == 136192
    assert with_moves.bottleneck <= with_moves.bound


def test_kicks_escape_a_split_that_moves_alone_cannot_improve():
    problem = SplitProblem(layered_graph(30, seed=5), 2, 0.02)
    g = problem.graph
    start = moves.improve(g, problem.dp_split(g.program()), 2, problem.limits())
    assert np.array_equal(moves.improve(g, start, 2, problem.limits()), start)  # a local optimum
    found = moves.improve(g, start, 2, problem.limits(), kicks=60)
    assert g.total_bytes(found, 2) < g.total_bytes(start, 2)
    assert problem.violations(found) == []
    assert np.array_equal(moves.improve(g, start, 2, problem.limits(), kicks=60), found)  # seeded


def test_patience_stops_the_kicks_after_that_many_in_a_row_find_nothing(monkeypatch):
    problem = SplitProblem(layered_graph(30, seed=5), 2, 0.02)
    g = problem.graph
    start = moves.improve(g, problem.dp_split(g.program()), 2, problem.limits())
    kicks = []
    real_passes = moves._passes

    def counted(state, graph, frozen, seeds):
        kicks.append(seeds is not None)  # a kick's repair starts from its seeds
        real_passes(state, graph, frozen, seeds)

    monkeypatch.setattr(moves, "_passes", counted)
    found = moves.improve(g, start, 2, problem.limits(), kicks=60)
    assert sum(kicks) == 60 and g.total_bytes(found, 2) < g.total_bytes(start, 2)  # kick 1 (of 0..59) gains
    kicks.clear()
    assert np.array_equal(moves.improve(g, start, 2, problem.limits(), kicks=60, patience=3), found)
    assert sum(kicks) == 2 + 3  # the gain at kick 1, then three in a row that find nothing
    kicks.clear()
    assert np.array_equal(moves.improve(g, start, 2, problem.limits(), kicks=60, patience=1), start)
    assert sum(kicks) == 1


def test_kicks_thin_out_on_tiny_and_large_graphs():
    assert moves.kicks_for(10) == 10
    assert moves.kicks_for(500) == moves.KICKS
    assert moves.kicks_for(2 * moves.KICK_NODES) == moves.KICKS // 2
    assert moves.kicks_for(moves.KICKS * moves.KICK_NODES + 1) == 0


def test_a_value_read_by_many_nodes_counts_once_per_boundary_while_its_readers_move():
    # Every node reads the hub: moving readers between stages must keep the hub's crossings
    # exact (the latest reader and how many sit there), or the gains would be wrong.
    dag = nx.DiGraph()
    dag.add_node("hub", cost=1.0, bytes=1000.0)
    previous = "hub"
    for i in range(12):
        dag.add_node(f"v{i}", cost=1.0, bytes=1.0 + (i % 3))
        dag.add_edges_from([("hub", f"v{i}"), (previous, f"v{i}")])
        previous = f"v{i}"
    problem = SplitProblem(dag, 3, 0.5)
    g = problem.graph
    start = problem.dp_split(g.program())
    found = moves.improve(g, start, 3, problem.limits(), kicks=20)
    assert problem.violations(found) == []
    assert g.total_bytes(found, 3) == total_boundary_bytes(dag, g.assignment(found), 3)
    assert g.total_bytes(found, 3) <= g.total_bytes(start, 3)


def traced_transformer_without_shapes() -> nx.DiGraph:
    """The built-in transformer-lm as ``trace,build-dag`` sees it: one byte per value, an input
    mask read only in the middle of the model, parameter bytes as costs."""
    costs = {2: 12800.0, 5: 65536.0, 15: 34176.0, 16: 34176.0, 17: 34176.0, 18: 34176.0, 19: 13200.0}
    dag = nx.DiGraph()
    for name in ("src", "src_mask"):
        dag.add_node(name, cost=0.0, bytes=1.0, input=True)
    for i in range(2, 20):
        dag.add_node(f"n{i}", cost=costs.get(i, 0.0), bytes=1.0, output=i == 19)
    edges = "src-2 src_mask-8 src_mask-12 2-3 3-4 3-6 4-5 5-6 6-7 7-9 7-11 7-13 7-15 8-10 9-10 10-15 10-16 " \
            "10-17 10-18 11-12 12-14 12-15 12-16 12-17 12-18 13-14 14-15 14-16 14-17 14-18 15-16 16-17 17-18 18-19"
    for edge in edges.split():
        u, v = edge.split("-")
        dag.add_edge(u if u.startswith("src") else f"n{u}", f"n{v}")
    return dag


def test_an_input_next_to_moved_nodes_never_moves_out_of_stage_zero():
    # Regression: kick repairs rescored the inputs beside moved nodes and moved the mask.
    dag = traced_transformer_without_shapes()
    result = split_dag(dag, 3, tolerance=0.0)
    check_constraints(dag, result, 3)
    assert result["src_mask"] == 0 and result["src"] == 0


def test_pinned_boundaries_and_budgets_hold_under_moves():
    dag = layered_graph(80, seed=3)
    constraints = Constraints.build(cut_before=["n40"])
    result = split_dag(dag, 3, tolerance=0.3, cut_before=["n40"], return_info=True)
    check_constraints(dag, result.assignment, 3, constraints, result.info.bound * (1 + 1e-9))


# --- orders that move costly nodes ----------------------------------------------------------


def is_topological(g, order: np.ndarray) -> bool:
    position = np.empty(g.n, dtype=np.int64)
    position[order] = np.arange(g.n)
    return sorted(order.tolist()) == list(range(g.n)) and bool(np.all(position[g.src] < position[g.dst]))


@fast
@given(split_problems(dags(max_nodes=12) | shaped_dags(max_nodes=12)), st.data())
def test_pulled_and_pushed_orders_are_topological_and_keep_inputs_first(problem, data):
    dag, k = problem
    g = SplitProblem(dag, k, 0.0).graph
    nodes = np.array(data.draw(st.lists(st.integers(g.num_inputs, g.n - 1), max_size=3, unique=True))
                     if g.n > g.num_inputs else [], dtype=np.int64)
    for order in (pull_forward(g, g.program(), nodes), push_back(g, g.program(), nodes)):
        assert is_topological(g, order)
        assert order[: g.num_inputs].tolist() == list(range(g.num_inputs))


def test_a_pulled_node_follows_just_its_ancestors_and_a_pushed_one_precedes_just_its_descendants():
    #   a -> b -> H -> c      x, y: independent of H
    dag = nx.DiGraph()
    for name in ("a", "x", "b", "y", "H", "c"):
        dag.add_node(name, cost=1.0, bytes=1.0)
    dag.add_edges_from([("a", "b"), ("b", "H"), ("H", "c")])
    g = SplitProblem(dag, 2, 0.0).graph
    heavy = np.array([g.index["H"]])
    names = lambda order: [g.nodes[i] for i in order.tolist()]  # noqa: E731
    assert names(pull_forward(g, g.program(), heavy)) == ["a", "b", "H", "x", "y", "c"]
    assert names(push_back(g, g.program(), heavy)) == ["a", "x", "b", "y", "H", "c"]
