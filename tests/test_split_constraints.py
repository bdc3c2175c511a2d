"""User constraints on split_dag: pins, together groups, preferences, capacities, memory budgets."""

from __future__ import annotations

import math
import pickle

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.errors import (
    EmptyStageError, InfeasibleSplitError, InvalidArgumentError, InvalidArgumentTypeError, InvalidGraphError,
)
from autoshard.graph import Constraints, split_dag, total_boundary_bytes
from autoshard.graph.constraints import ACTIVATION_MEMORY, StageRange
from autoshard.testing import (
    brute_force_constrained,
    check_constraints,
    constraint_violations,
    relative_bottleneck,
)
from autoshard.testing.properties import at_most
from autoshard.testing.graphs import layered_graph
from autoshard.testing.strategies import constrained_problems, dags, shaped_dags

BOUNDED = ("min-cut", "fixed-order", "exact")


def chain(costs: list[float], **attrs: list[float]) -> nx.DiGraph:
    dag = nx.DiGraph()
    for i, c in enumerate(costs):
        dag.add_node(f"v{i}", cost=float(c), bytes=1.0, **{k: float(v[i]) for k, v in attrs.items()})
    nx.add_path(dag, list(dag.nodes))
    return dag


def stages(assignment: dict) -> list[int]:
    return list(assignment.values())


def options(c: Constraints) -> dict:
    return {"cut_before": c.cut_before, "together": c.together, "capacities": c.capacities,
            "memory_budgets": c.memory_budgets, "memory_in_flight": c.memory_in_flight,
            "stage_ranges": c.stage_ranges}


# --- properties against brute force -------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(constrained_problems(shaped_dags(max_nodes=7) | dags(max_nodes=7)), st.sampled_from(BOUNDED),
       st.sampled_from([0.0, 0.25]))
def test_bounded_strategies_honour_random_constraints_or_say_none_can(problem, strategy, tolerance):
    dag, k, constraints = problem
    try:
        contiguous = brute_force_constrained(dag, k, constraints, contiguous=True)
    except InfeasibleSplitError:  # a pin inside a group, more pins than boundaries, ...
        contiguous = []
    if not contiguous:
        with pytest.raises(InfeasibleSplitError):
            split_dag(dag, k, strategy, tolerance, **options(constraints))
        return
    best = min(relative_bottleneck(dag, a, k, constraints) for a in contiguous)
    bound = (1 + tolerance) * best
    result = split_dag(dag, k, strategy, tolerance, return_info=True, **options(constraints))
    check_constraints(dag, result.assignment, k, constraints, bound * (1 + 1e-9))
    assert at_most(result.info.bound, bound) and at_most(bound, result.info.bound)
    sent = total_boundary_bytes(dag, result.assignment, k)
    within = [a for a in contiguous if at_most(relative_bottleneck(dag, a, k, constraints), bound)]
    fixed_order_best = min(total_boundary_bytes(dag, a, k) for a in within)
    if strategy == "fixed-order":
        assert at_most(sent, fixed_order_best) and at_most(fixed_order_best, sent)
    else:
        assert at_most(sent, fixed_order_best)


@settings(max_examples=60, deadline=None)
@given(constrained_problems(shaped_dags(max_nodes=6) | dags(max_nodes=6), max_stages=3),
       st.sampled_from([0.0, 0.25]))
def test_exact_sends_the_fewest_bytes_of_all_constrained_splits(problem, tolerance):
    dag, k, constraints = problem
    try:
        result = split_dag(dag, k, "exact", tolerance, return_info=True, **options(constraints))
    except InfeasibleSplitError:
        return  # covered by the test above
    bound = result.info.bound * (1 + 1e-9)
    feasible = brute_force_constrained(dag, k, constraints, contiguous=False, bound=bound)
    fewest = min(total_boundary_bytes(dag, a, k) for a in feasible)
    sent = total_boundary_bytes(dag, result.assignment, k)
    assert result.info.proven_optimal is True
    assert at_most(sent, fewest) and at_most(fewest, sent)


# --- stage ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", BOUNDED)
def test_a_stage_range_holds_a_node_in_its_stages_even_off_balance(strategy):
    dag = chain([1] * 8)
    assert stages(split_dag(dag, 2, strategy, 0.0)) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert stages(split_dag(dag, 2, strategy, 0.0, stage_ranges={"v1": 1})) == [0, 1, 1, 1, 1, 1, 1, 1]
    # A range bounds ancestors from above and descendants from below: v6 in stage 0 takes v0..v6 along.
    assert stages(split_dag(dag, 2, strategy, 0.0, stage_ranges={"v6": (0, 0)})) == [0] * 7 + [1]
    assert stages(split_dag(dag, 3, strategy, 0.0, stage_ranges={"v2": (1, 2), "v5": 1})) == [0, 0, 1, 1, 1, 1, 2, 2]


def interleaved() -> nx.DiGraph:
    """Two branches interleaved in program order (a1 b1 a2 b2), heavy values inside each branch."""
    dag = nx.DiGraph()
    for name, nbytes in (("x", 1), ("a1", 100), ("b1", 100), ("a2", 1), ("b2", 1)):
        dag.add_node(name, cost=0.0 if name == "x" else 1.0, bytes=float(nbytes), input=name == "x",
                     output=name in ("a2", "b2"))
    dag.add_edges_from([("x", "a1"), ("x", "b1"), ("a1", "a2"), ("b1", "b2")])
    return dag


@pytest.mark.parametrize("strategy", BOUNDED)
def test_stage_ranges_program_order_cannot_meet_reorder_it(strategy):
    # a1 comes first in program order but must sit in the later stage, b1 in the earlier one.
    result = split_dag(interleaved(), 2, strategy, 0.5, stage_ranges={"a1": 1, "b1": 0, "b2": 0})
    assert result == {"x": 0, "b1": 0, "b2": 0, "a1": 1, "a2": 1}


def aux_head() -> nx.DiGraph:
    """a -> b -> c, and an auxiliary head reading a that comes last in program order."""
    dag = nx.DiGraph()
    for name in ("x", "a", "b", "c", "aux"):
        dag.add_node(name, cost=0.0 if name == "x" else 1.0, bytes=1.0, input=name == "x", output=name in ("c", "aux"))
    dag.add_edges_from([("x", "a"), ("a", "b"), ("b", "c"), ("a", "aux")])
    return dag


@pytest.mark.parametrize("strategy", BOUNDED)
def test_ranges_a_late_node_can_only_meet_early_are_met_by_reordering(strategy):
    assert split_dag(aux_head(), 2, strategy, 0.0, stage_ranges={"aux": 0}) == {
        "x": 0, "a": 0, "aux": 0, "b": 1, "c": 1}
    # Neither end of the ranges orders it: the node pinned to the middle stage comes last, and what
    # the last stage holds must be moved after it.
    dag = chain([1] * 4)
    dag.add_node("side", cost=1.0, bytes=1.0, output=True)
    dag.add_edge("v0", "side")
    dag.add_node("late", cost=1.0, bytes=1.0, output=True)
    dag.add_edge("v1", "late")
    result = split_dag(dag, 3, strategy, 1.0, stage_ranges={"late": 1, "v3": 2})
    assert result["late"] == 1 and result["v3"] == 2 and set(result.values()) == {0, 1, 2}


@pytest.mark.parametrize("strategy", ("min-cut", "exact"))
def test_refinement_never_moves_a_node_out_of_its_range(strategy):
    # Unconstrained, min-cut keeps each heavy value inside its branch; pinned, a1 and b1 stay apart.
    free = split_dag(interleaved(), 2, strategy, 1.0)
    assert free["a1"] == free["a2"] and free["b1"] == free["b2"]
    pinned = split_dag(interleaved(), 2, strategy, 1.0, stage_ranges={"a1": 0, "a2": 1, "b1": 0, "b2": 1})
    assert (pinned["a1"], pinned["a2"], pinned["b1"], pinned["b2"]) == (0, 1, 0, 1)


@pytest.mark.parametrize(("ranges", "message"), [
    ({"v6": 0}, "the pins leave 1 node for the 2 stages 1..2"),
    ({"v2": 2, "v5": 1},
     "'v2' (pinned to stage 2) runs before 'v5' (pinned to stage 1) (it feeds it), but stages run in order"),
    ({"v2": StageRange(2, 2, "blocks.2"), "v5": StageRange(0, 1, "head")},
     "blocks.2 (pinned to stage 2) runs before head (pinned to stages 0..1)"),
    ({"v2": 3}, "'v2' (pinned to stage 3) asks for a stage past the last one of 3 stages (stage 2)"),
    ({"nope": 1}, "'nope' is not a node of the graph"),
])
def test_stage_ranges_no_split_meets_are_named(ranges, message):
    with pytest.raises((InfeasibleSplitError, InvalidArgumentError)) as info:
        split_dag(chain([1] * 8), 3, "min-cut", stage_ranges=ranges)
    assert message in str(info.value)


def test_too_few_nodes_for_the_last_stages_is_an_empty_stage_naming_them():
    """A stage left nothing to compute, alone or among several sharing too few nodes, is the same
    refusal (``EmptyStageError``), which a sharded model's new capture words in the user's terms."""
    with pytest.raises(EmptyStageError) as info:
        split_dag(chain([1] * 8), 3, "min-cut", stage_ranges={"v6": 0})
    assert (info.value.stage, info.value.last, info.value.nodes, info.value.num_stages) == (1, 2, 1, 3)
    assert info.value.stages() == "stages 1..2"
    copied = pickle.loads(pickle.dumps(info.value))
    assert (copied.stage, copied.last, copied.nodes, str(copied)) == (1, 2, 1, str(info.value))


def test_an_input_pinned_past_stage_0_is_refused():
    dag = nx.DiGraph()
    dag.add_node("x", input=True, cost=0.0, bytes=1.0)
    dag.add_node("y", cost=1.0, bytes=1.0, output=True)
    dag.add_node("z", cost=1.0, bytes=1.0, output=True)
    dag.add_edges_from([("x", "y"), ("x", "z")])
    with pytest.raises(InfeasibleSplitError, match="'x' \\(pinned to stage 1\\) is a model input"):
        split_dag(dag, 2, stage_ranges={"x": 1})


@pytest.mark.parametrize(("ranges", "error", "message"), [
    ({"v1": (2, 1)}, InvalidArgumentError, "a range needs 0 <= first <= last"),
    ({"v1": -1}, InvalidArgumentError, "a range needs 0 <= first <= last"),
    ({"v1": 1.0}, InvalidArgumentTypeError, "must be a stage or a (first, last) pair"),
    (["v1"], InvalidArgumentTypeError, "stage_ranges must be a {node: stage or (first, last)} mapping"),
])
def test_bad_stage_ranges_are_named(ranges, error, message):
    with pytest.raises(error) as info:
        split_dag(chain([1] * 4), 2, stage_ranges=ranges)
    assert message in str(info.value)


def test_strategies_without_constraints_refuse_stage_ranges():
    with pytest.raises(InvalidArgumentError, match="strategy 'greedy' cannot honour stage_ranges"):
        split_dag(chain([1] * 4), 2, "greedy", stage_ranges={"v1": 1})


def test_violations_name_a_node_outside_its_range():
    broken = constraint_violations(chain([1] * 4), {"v0": 0, "v1": 0, "v2": 1, "v3": 1}, 2,
                                   Constraints.build(stage_ranges={"v1": 1}))
    assert broken == ["stage_ranges 'v1': outside its stages 1..1"]


# --- pins ---------------------------------------------------------------------------------


def test_a_pin_starts_a_stage_even_off_balance():
    dag = chain([1] * 8)
    assert stages(split_dag(dag, 2, cut_before=["v2"])) == [0, 0, 1, 1, 1, 1, 1, 1]
    assert stages(split_dag(dag, 3, cut_before=["v2"])) == [0, 0, 1, 1, 1, 2, 2, 2]
    assert stages(split_dag(dag, 2, cut_before=["v0"])) == [0, 0, 0, 0, 1, 1, 1, 1]  # stage 0 starts there


def test_a_pin_is_a_prefix_of_program_order_for_every_strategy():
    # Two branches interleaved in program order; min-cut would rather cut between branches,
    # but the pin asks for exactly the nodes before b1 on the early side.
    dag = nx.DiGraph()
    for name, nbytes in (("x", 4), ("a1", 100), ("b1", 100), ("a2", 100), ("b2", 100)):
        dag.add_node(name, cost=0.0 if name == "x" else 1.0, bytes=float(nbytes), input=name == "x",
                     output=name in ("a2", "b2"))
    dag.add_edges_from([("x", "a1"), ("x", "b1"), ("a1", "a2"), ("b1", "b2")])
    for strategy in BOUNDED:
        result = split_dag(dag, 2, strategy, 1.0, cut_before=["b1"])
        assert result == {"x": 0, "a1": 0, "b1": 1, "a2": 1, "b2": 1}, strategy


def test_bad_pins_are_named():
    dag = chain([1] * 4)
    dag.add_node("x", cost=0.0, bytes=1.0, input=True)
    dag.add_edge("x", "v0")
    with pytest.raises(InfeasibleSplitError, match="cut_before asks for 3 boundaries but 3 stages have only 2"):
        split_dag(dag, 3, cut_before=["v1", "v2", "v3"])
    with pytest.raises(InvalidArgumentError, match="cut_before: 'x' is a model input"):
        split_dag(dag, 2, cut_before=["x"])
    with pytest.raises(InvalidArgumentError, match="cut_before: 'nope' is not a node"):
        split_dag(dag, 2, cut_before=["nope"])
    with pytest.raises(InvalidArgumentTypeError, match="cut_before must be a collection"):
        split_dag(dag, 2, cut_before="v1")


# --- together groups and preferences ------------------------------------------------------


def test_a_together_group_stays_whole():
    dag = chain([1] * 6)
    assert stages(split_dag(dag, 2, together=[["v2", "v3"]])) == [0, 0, 0, 0, 1, 1] or \
        stages(split_dag(dag, 2, together=[["v2", "v3"]])) == [0, 0, 1, 1, 1, 1]
    result = split_dag(dag, 3, together={"mid": ["v1", "v4"]})
    assert len({result[v] for v in ("v1", "v2", "v3", "v4")}) == 1  # and what lies between


def test_a_pin_inside_a_group_names_both():
    with pytest.raises(InfeasibleSplitError, match="cut_before 'v3' falls inside together group 'block'"):
        split_dag(chain([1] * 6), 2, cut_before=["v3"], together={"block": ["v2", "v4"]})


def test_groups_that_leave_too_few_nodes_name_the_constraints():
    with pytest.raises(InfeasibleSplitError,
                       match=r"no split of program order into 3 non-empty stages meets together groups \['all'\]"):
        split_dag(chain([1] * 4), 3, together={"all": ["v0", "v3"]})


def test_groups_that_leave_too_few_cuts_say_how_many_stages_fit():
    with pytest.raises(InfeasibleSplitError, match=r"leaves 2 places to cut, so at most 3 stages; ask for at most 3"):
        split_dag(chain([1] * 6), 4, together={"a": ["v0", "v2"], "b": ["v4", "v5"]})


def test_labelled_pins_are_named_by_their_labels():
    dag = chain([1] * 6)
    with pytest.raises(InfeasibleSplitError, match=r"cut_before 'layers\.3' falls inside together group 'block', .*; "
                                                   r"cut before the group's first node 'v2' instead"):
        split_dag(dag, 2, cut_before={"v3": "layers.3"}, together={"block": ["v2", "v4"]})
    with pytest.raises(InfeasibleSplitError, match=r"have only 1 \('a', 'b'\)"):
        split_dag(dag, 2, cut_before={"v3": "a", "v4": "b"})
    assert split_dag(dag, 2, cut_before={"v3": "a"}) == split_dag(dag, 2, cut_before=["v3"])


def test_preferences_are_kept_when_the_bound_allows_and_reported_when_not():
    dag = chain([1] * 8)
    kept = split_dag(dag, 2, tolerance=0.0, prefer_together={"near": ["v1", "v2"]}, return_info=True)
    assert kept.assignment["v1"] == kept.assignment["v2"] and kept.info.separated == ()
    # v0..v7 together would leave one stage empty; v3 and v4 together would unbalance 4 | 4.
    split = split_dag(dag, 2, tolerance=0.0, prefer_together={"far": ["v0", "v7"], "mid": ["v3", "v4"]},
                      return_info=True)
    assert stages(split.assignment) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert split.info.separated == ("far", "mid")
    loose = split_dag(dag, 2, tolerance=0.5, prefer_together={"mid": ["v3", "v4"]}, return_info=True)
    assert loose.assignment["v3"] == loose.assignment["v4"] and loose.info.separated == ()


@pytest.mark.parametrize("strategy", ["min-cut", "fixed-order", "exact"])
def test_a_preference_sharing_a_hard_groups_label_does_not_replace_it(strategy):
    split = split_dag(chain([1] * 6), 3, strategy, tolerance=0.0, together={"block": ["v1", "v2"]},
                      prefer_together={"block": ["v0", "v1"]})
    assert split["v1"] == split["v2"]


def test_group_labels_that_read_the_same_are_refused():
    with pytest.raises(InvalidArgumentError, match="several groups labelled '1'"):
        split_dag(chain([1] * 6), 2, together={1: ["v1", "v2"], "1": ["v3", "v4"]})


def test_strategies_without_constraints_refuse_hard_ones_but_report_preferences():
    dag = chain([1] * 4)
    with pytest.raises(InvalidArgumentError, match="strategy 'greedy' cannot honour together; use one of min-cut"):
        split_dag(dag, 2, "greedy", together=[["v0", "v1"]])
    result = split_dag(dag, 2, "uniform", prefer_together={"t": ["v1", "v2"]}, return_info=True)
    assert result.info.separated == ("t",) and result.info.bound is None


# --- capacities and memory ----------------------------------------------------------------


def test_capacities_balance_cost_per_speed():
    dag = chain([1] * 8)
    result = split_dag(dag, 2, tolerance=0.0, capacities=[1, 3], return_info=True)
    assert stages(result.assignment) == [0, 0, 1, 1, 1, 1, 1, 1]
    assert result.info.bottleneck == 2.0 and result.info.bound == pytest.approx(2.0)
    assert stages(split_dag(dag, 2, capacities=[3])) == [0, 0, 0, 0, 1, 1, 1, 1]  # one value: all alike
    assert split_dag(dag, 2, tolerance=0.0, capacities=np.array([1.0, 3.0])) == result.assignment  # an array too


@pytest.mark.parametrize("kwargs", [{"capacities": [2, 2]}, {"memory_budgets": [1, 1]}])
def test_the_bound_search_holds_costs_to_float_resolution_not_the_round_off_allowance(kwargs):
    # total / sum(capacities) passed within the allowance though no split reaches it, and the split
    # found there, 10 + 3e-8 | 10, set the bound where 10 + 1.5e-8 | 1.5e-8 + 10 is reachable.
    dag = chain([10, 1.5e-8, 1.5e-8, 10], memory=[0, 0, 0, 0])
    best = 10 + 1.5e-8 if "memory_budgets" in kwargs else (10 + 1.5e-8) / 2
    result = split_dag(dag, 2, "fixed-order", 0.0, return_info=True, **kwargs)
    assert result.info.bound == pytest.approx(best, rel=1e-12)


def test_memory_budgets_move_cuts_off_the_cost_balance():
    dag = chain([1] * 6, memory=[5, 1, 1, 1, 1, 1])
    assert stages(split_dag(dag, 2, tolerance=0.0)) == [0, 0, 0, 1, 1, 1]
    constrained = split_dag(dag, 2, tolerance=0.0, memory_budgets=[6, 6], return_info=True)
    assert stages(constrained.assignment) == [0, 0, 1, 1, 1, 1]
    assert constrained.info.bottleneck == 4.0
    check_constraints(dag, constrained.assignment, 2, Constraints.build(memory_budgets=[6, 6]))
    assert split_dag(dag, 2, tolerance=0.0, memory_budgets=6) == constrained.assignment  # one for all


def test_memory_budgets_a_node_or_the_whole_needs_exactly_are_met():
    """v0 needs all of stage 0's budget and the nodes all of both: the checks before the split compare
    with <= (and round-off room), as the split does."""
    dag = chain([1] * 6, memory=[5, 1, 1, 1, 1, 1])
    assignment = split_dag(dag, 2, tolerance=0.0, memory_budgets=[5, 5])
    check_constraints(dag, assignment, 2, Constraints.build(memory_budgets=[5, 5]))


@pytest.mark.parametrize("k, kwargs, error, message", [
    (2, {"memory_budgets": [3, 3]}, InfeasibleSplitError, "memory_budgets sum to 6 but the nodes need 10"),
    (3, {"memory_budgets": [4, 4, 4]}, InfeasibleSplitError, "node 'v0' needs memory 5, more than the largest"),
    (2, {"memory_budgets": [1, 2, 3]}, InvalidArgumentError, "memory_budgets has 3 entries for 2 stages"),
    (2, {"memory_budgets": [-1, 20]}, InvalidArgumentError, r"memory_budgets\[0\] is -1"),
    (2, {"capacities": [1, 0]}, InvalidArgumentError, "capacities must be > 0"),
    (2, {"capacities": "fast"}, InvalidArgumentTypeError, "capacities must be a list of numbers"),
    (2, {"together": "v1"}, InvalidArgumentTypeError, "together must be a list or a"),
    (2, {"together": [["v1", "zz"]]}, InvalidArgumentError, r"together 'together\[0\]': 'zz' is not a node"),
])
def test_bad_limits_are_named(k, kwargs, error, message):
    with pytest.raises(error, match=message):
        split_dag(chain([1] * 6, memory=[5, 1, 1, 1, 1, 1]), k, **kwargs)


def test_memory_amounts_in_the_refusals_read_as_numbers():
    dag = chain([1] * 4, memory=[4096, 1024, 1024, 1024])
    with pytest.raises(InfeasibleSplitError, match="memory_budgets sum to 6,000 but the nodes need 7,168 in total"):
        split_dag(dag, 2, memory_budgets=[3000, 3000])
    with pytest.raises(InfeasibleSplitError, match="node 'v0' needs memory 4,096, more than the largest memory "
                                                   "budget 4,000.5"):
        split_dag(dag, 2, memory_budgets=[4000.5, 4000.5])
    big = chain([1] * 4, memory=[4096 * 1024, 1024 * 1024, 1024 * 1024, 1024 * 1024])  # budgets of "3.6MiB" ...
    with pytest.raises(InfeasibleSplitError, match="memory_budgets sum to 6,291,457 but"):  # not 6.29146e+06
        split_dag(big, 2, memory_budgets=[3145728.4, 3145728.4])
    with pytest.raises(InfeasibleSplitError, match=r"memory_budgets \[4,300,000; 3,050,001\]"):  # not 4.3e+06
        split_dag(big, 2, memory_budgets=[4300000.4, 3050000.6])


def test_memory_budgets_need_a_memory_attribute_on_every_node():
    with pytest.raises(InvalidGraphError, match="node 'v0' has no 'memory' attribute"):
        split_dag(chain([1] * 4), 2, memory_budgets=[10, 10])


def in_flight_chain() -> nx.DiGraph:
    """Six unit-cost nodes holding 1 byte of weights each and 2 bytes of activations per microbatch."""
    dag = chain([1] * 6, memory=[1] * 6)
    for v in dag.nodes:
        dag.nodes[v][ACTIVATION_MEMORY] = 2.0
    return dag


@pytest.mark.parametrize("strategy", BOUNDED)
def test_microbatches_in_flight_make_early_stages_hold_fewer_nodes(strategy):
    # Stage 0 keeps 3 microbatches (7 bytes a node), stage 1 keeps 1 (3 bytes a node); budgets
    # of 21 let stage 0 take 3 nodes, as balance wants, but not 4.
    dag = in_flight_chain()
    balanced = split_dag(dag, 2, strategy, 1.0, memory_budgets=[21, 21], memory_in_flight=[3, 1])
    assert stages(balanced) == [0, 0, 0, 1, 1, 1]
    # With budgets of 14 stage 0 holds 2 nodes; the loose tolerance lets the split go there.
    squeezed = split_dag(dag, 2, strategy, 1.0, memory_budgets=[14, 14], memory_in_flight=[3, 1],
                         return_info=True)
    assert stages(squeezed.assignment) == [0, 0, 1, 1, 1, 1]
    c = Constraints.build(memory_budgets=[14, 14], memory_in_flight=[3, 1])
    check_constraints(dag, squeezed.assignment, 2, c)
    assert constraint_violations(dag, balanced, 2, c) == ["memory: a stage exceeds its budget"]
    # Reversed in-flight counts turn the stage that must stay small around.
    assert stages(split_dag(dag, 2, strategy, 1.0, memory_budgets=14, memory_in_flight=[1, 3])) == [
        0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("strategy", BOUNDED)
def test_one_microbatch_in_flight_everywhere_is_plain_memory_budgets(strategy):
    dag = chain([1] * 6, memory=[5, 1, 1, 1, 1, 1])  # no activation_memory: it counts 0
    plain = split_dag(dag, 2, strategy, 0.0, memory_budgets=[6, 6])
    assert split_dag(dag, 2, strategy, 0.0, memory_budgets=[6, 6], memory_in_flight=[1, 1]) == plain
    assert split_dag(dag, 2, strategy, 0.0, memory_budgets=[6, 6], memory_in_flight=1) == plain
    assert stages(plain) == [0, 0, 1, 1, 1, 1]


def test_activation_memory_counts_only_with_memory_in_flight():
    dag = in_flight_chain()  # 1 byte held per node; activations would add 2 per microbatch
    assert stages(split_dag(dag, 2, tolerance=0.0, memory_budgets=3)) == [0, 0, 0, 1, 1, 1]


def test_a_position_dependent_memory_budget_no_split_meets_names_both_options():
    # Stage 0 holds at most 2 nodes (7 bytes each), stage 1 at most 3 (3 bytes each): 5 < 6.
    with pytest.raises(InfeasibleSplitError, match=r"no split of program order into 2 non-empty stages meets "
                       r"memory_budgets \[20; 11\] and memory_in_flight \[3; 1\]"):
        split_dag(in_flight_chain(), 2, memory_budgets=[20, 11], memory_in_flight=[3, 1])


def test_in_flight_memory_that_cannot_fit_in_total_or_per_node_is_named():
    dag = in_flight_chain()
    with pytest.raises(InfeasibleSplitError, match=r"memory_budgets sum to 20 but the nodes need 30 in total "
                       r"even with activations counted for 2 microbatches, the fewest any stage keeps in flight "
                       r"\(memory_in_flight per stage: 2, 2\)"):
        split_dag(dag, 2, memory_budgets=[10, 10], memory_in_flight=[2, 2])
    with pytest.raises(InfeasibleSplitError, match=r"need 18 in total even with activations counted for 1 "
                       r"microbatch, the fewest any stage keeps in flight \(memory_in_flight per stage: 3, 1\)"):
        split_dag(dag, 2, memory_budgets=[8, 8], memory_in_flight=[3, 1])
    dag.nodes["v0"][ACTIVATION_MEMORY] = 10.0
    with pytest.raises(InfeasibleSplitError, match=r"node 'v0' needs memory 1 plus 10 per microbatch in flight, "
                       r"more than any stage holds under memory_budgets \[20; 20; 20\] with "
                       r"memory_in_flight \[2; 2; 2\]"):
        split_dag(dag, 3, memory_budgets=20, memory_in_flight=2)
    with pytest.raises(InfeasibleSplitError, match=r"together group 'g' needs memory 2 plus 12 per microbatch"):
        split_dag(dag, 3, memory_budgets=25, memory_in_flight=2, together={"g": ["v0", "v1"]})


def test_a_stage_without_microbatches_in_flight_keeps_no_activations():
    dag = in_flight_chain()  # stage 0 needs 1 byte a node, stage 1 needs 7
    result = split_dag(dag, 2, tolerance=1.0, memory_budgets=[30, 7], memory_in_flight=[0, 3])
    assert stages(result) == [0, 0, 0, 0, 0, 1]
    check_constraints(dag, result, 2, Constraints.build(memory_budgets=[30, 7], memory_in_flight=[0, 3]))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"memory_in_flight": [1, 1]}, InvalidArgumentError, "memory_in_flight only scales activation memory under "
                                                         "memory_budgets; give memory_budgets too"),
    ({"memory_budgets": 50, "memory_in_flight": [1, 2, 3]}, InvalidArgumentError,
     "memory_in_flight has 3 entries for 2 stages"),
    ({"memory_budgets": 50, "memory_in_flight": [1, -2]}, InvalidArgumentError, r"memory_in_flight\[1\] is -2"),
    ({"memory_budgets": 50, "memory_in_flight": "1F1B"}, InvalidArgumentTypeError,
     "memory_in_flight must be a list of numbers"),
])
def test_bad_in_flight_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        split_dag(in_flight_chain(), 2, **kwargs)


@pytest.mark.parametrize("strategy", BOUNDED)
def test_a_missing_activation_memory_counts_zero_and_a_bad_one_is_named(strategy):
    dag = in_flight_chain()  # with in-flight [1, 3] stage 1 needs 7 bytes a node: one fits in 10
    options = {"memory_budgets": [30, 10], "memory_in_flight": [1, 3]}
    assert stages(split_dag(dag, 2, strategy, 1.0, **options)) == [0, 0, 0, 0, 0, 1]
    del dag.nodes["v5"][ACTIVATION_MEMORY]  # now v5 needs 1 byte there, and v4 fits beside it
    assert stages(split_dag(dag, 2, strategy, 1.0, **options)) == [0, 0, 0, 0, 1, 1]
    dag.nodes["v2"][ACTIVATION_MEMORY] = -1.0
    with pytest.raises(InvalidGraphError, match="node 'v2' has 'activation_memory'=-1.0"):
        split_dag(dag, 2, strategy, **options)


def test_violations_name_each_broken_rule():
    dag = chain([1] * 4, memory=[1, 1, 1, 1])
    c = Constraints.build(cut_before=["v1"], together=[["v2", "v3"]], memory_budgets=[1, 10])
    broken = constraint_violations(dag, {"v0": 0, "v1": 0, "v2": 1, "v3": 1}, 2, c, bound=math.inf)
    assert broken == ["memory: a stage exceeds its budget", "cut_before 'v1': no boundary falls there"]
    assert constraint_violations(dag, {"v0": 0, "v1": 1, "v2": 1, "v3": 1}, 2, c, bound=3.0) == []
    assert constraint_violations(dag, {"v0": 0, "v1": 1, "v2": 1, "v3": 1}, 2, c, bound=2.0) == [
        "cost: a stage exceeds its budget"]


@pytest.mark.parametrize("seed", range(4))
def test_overlapping_groups_act_as_one_even_when_refinement_moves_nodes(seed):
    dag = layered_graph(40, seed=seed)
    groups = {"a": ["n3", "n12"], "b": ["n12", "n25"]}
    for strategy in BOUNDED:
        result = split_dag(dag, 3, strategy, 0.5, together=groups)
        assert len({result[v] for v in ("n3", "n12", "n25")}) == 1, strategy
        check_constraints(dag, result, 3, Constraints.build(together=groups))


def test_a_group_member_pinned_by_the_corridor_still_holds_the_group():
    # v1 must stay with the input in0 (stage 0); refinement's corridor pins v1 to the later
    # stage, which must make the corridor unusable rather than split the group.
    dag = nx.DiGraph()
    dag.add_node("in0", cost=0.0, bytes=1.0, input=True)
    for v in ("v0", "v1", "v2"):
        dag.add_node(v, cost=0.0, bytes=0.0)
    dag.add_edge("in0", "v2")
    result = split_dag(dag, 2, "min-cut", 0.0, together={"g": ["in0", "v1"]})
    assert result["v1"] == 0
    check_constraints(dag, result, 2, Constraints.build(together={"g": ["in0", "v1"]}))
