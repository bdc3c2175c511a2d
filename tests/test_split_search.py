"""The split search (autoshard.costs.split_search) on small hand-made DAGs: no capture, no pass context.

Costs come as the callables a split pass would give: ``node_costs(apart)`` charges a shared weight
to its first reader (to every reader when named in ``apart``), ``stage_totals`` counts it once per
stage holding it, which is what makes the tie search and the memory bisection necessary.
"""

import dataclasses

import networkx as nx
import pytest

from autoshard.costs.split_search import MemoryCount, SplitRequest, search_split, summed_memory, weighted_in_order
from autoshard.costs.split_search import placements
from autoshard.costs.split_search.placements import attempt
from autoshard.costs.ties import TiePlacement, tie_groups
from autoshard.errors import InfeasibleSplitError
from autoshard.graph.constraints import ACTIVATION_MEMORY, MEMORY

NODES = [f"n{i}" for i in range(6)]


def chain(weights=None):
    """x -> n0 -> ... -> n5; ``weights`` maps a node to the weight names it reads."""
    dag = nx.DiGraph()
    dag.add_node("x", cost=0.0, bytes=8.0, input=True)
    previous = "x"
    for node in NODES:
        dag.add_node(node, cost=0.0, bytes=8.0, weights=tuple((weights or {}).get(node, ())))
        dag.add_edge(previous, node)
        previous = node
    dag.nodes[previous]["output"] = True
    return dag


def tied_request(**options):
    """Six nodes of cost 1; n0 and n5 share a weight of cost 6 (an embedding tied to the head)."""
    dag = chain({"n0": ("w",), "n5": ("w",)})
    own = {"x": 0.0, **{node: 1.0 for node in NODES}}

    def node_costs(apart):
        return {**own, "n0": 7.0, "n5": 7.0 if "w" in apart else 1.0}

    def stage_totals(assignment):
        totals = [0.0, 0.0]
        for node, stage in assignment.items():
            totals[stage] += own[node]
        for stage in {assignment["n0"], assignment["n5"]}:
            totals[stage] += 6.0
        return totals

    return SplitRequest(dag, ["x", *NODES], 2, "fixed-order", node_costs, stage_totals, charges_weights=True,
                        ties=tie_groups(dag), **options)


def test_a_separated_tie_is_split_again_and_the_best_true_bottleneck_kept():
    request = tied_request()
    first = attempt(request, TiePlacement(preferred=request.ties))
    assert first.partition.info.bottleneck == 11  # charged to n0 alone: n0 | n1..n5, the head pays 6 again
    found = search_split(request)
    # Best over every cut of the chain: 3 nodes + the weight on each side.
    assert found.info.bottleneck == 9 == min(max(a + 6, 6 - a + 6) for a in range(1, 6))
    assert found.info.separated == ("w",)
    assert [found.assignment[node] for node in NODES] == [0, 0, 0, 1, 1, 1]


def test_keep_tied_false_charges_the_first_reader_and_searches_nothing():
    found = search_split(tied_request(keep_tied=False))
    assert found.info.bottleneck == 11 and found.info.separated == ("w",)
    assert [found.assignment[node] for node in NODES] == [0, 1, 1, 1, 1, 1]


def test_a_budget_no_split_fits_names_the_stage_short_and_by_how_much():
    request = tied_request()
    memory = summed_memory("toy", request.node_costs, request.stage_totals)
    with pytest.raises(InfeasibleSplitError, match=r"no split into 2 stages fits max_memory .*stage \d needs "
                                                   r"\d+ under memory-cost 'toy' but max_memory\[\d\] is 8: \d+ short"):
        search_split(tied_request(max_memory=(8.0,), memory=memory))
    fitting = search_split(tied_request(max_memory=(9.0,), memory=memory))
    assert fitting.info.bottleneck == 9


def test_resolved_constraints_reach_the_splitter():
    found = search_split(tied_request(cut_before={"n5": "head"}, together={"body": frozenset({"n1", "n2"})}))
    assert [found.assignment[node] for node in NODES] == [0, 0, 0, 0, 0, 1]
    assert found.info.bottleneck == 11


def training_request(strategy="fixed-order", **options):
    """Six nodes, each holding 1 byte of state and keeping 1 byte per microbatch; stage 0 has 2 in flight."""
    dag = chain()
    held = {"x": 0.0, **{node: 1.0 for node in NODES}}

    def stage_totals(assignment):
        totals = [0.0, 0.0]
        for node, stage in assignment.items():
            totals[stage] += held[node] * (1 + (2, 1)[stage])
        return totals

    memory = MemoryCount("memory", lambda apart: {MEMORY: held, ACTIVATION_MEMORY: held}, stage_totals, (2.0, 1.0))
    one_microbatch = {node: 2 * cost for node, cost in held.items()}
    return SplitRequest(dag, ["x", *NODES], 2, strategy, lambda apart: one_microbatch, stage_totals,
                        charges_weights=True, memory=memory, **options)


def test_training_memory_is_balanced_with_every_microbatch_in_flight():
    """Balanced one microbatch at a time, 3 | 3 nodes cost 9 | 6; the bisection finds 2 | 4: 6 | 8."""
    assert search_split(training_request()).info.bottleneck == 9
    found = search_split(training_request(training_memory_cost=True))
    assert found.info.bottleneck == 8
    assert [found.assignment[node] for node in NODES] == [0, 0, 1, 1, 1, 1]
    assert found.info.bound == pytest.approx(8, rel=1e-3)  # the plan is held to the memory bound found


def test_the_dag_costed_under_a_placement_is_made_once_for_all_budgets_and_holds_what_it_is_made_of():
    """The bisection's probes replace only the budgets, and share the costed DAG; another placement,
    another cost model or the memory attributes get their own, each as a fresh copy would be."""
    request = tied_request()
    charged_first = request.costed(frozenset(), budgeted=False)
    assert dataclasses.replace(request, max_memory=(20.0,)).costed(frozenset(), budgeted=False) is charged_first
    other_costs = dataclasses.replace(request, node_costs=lambda apart: dict.fromkeys(["x", *NODES], 2.0))
    for changed, apart, budgeted in ((request, frozenset({"w"}), False), (other_costs, frozenset(), False),
                                     (training_request(), frozenset(), True)):
        made = changed.costed(apart, budgeted)
        assert made is not charged_first
        extra = changed.memory.node_attributes(apart) if budgeted else None
        fresh = weighted_in_order(changed.dag, changed.order, changed.node_costs(apart), extra)
        assert list(made.dag.nodes(data=True)) == list(fresh.nodes(data=True))


def test_a_strategy_too_costly_to_probe_balances_one_microbatch():
    found = search_split(training_request(training_memory_cost=True, strategy="greedy"))
    assert found.info.bottleneck == 9


def test_a_budget_only_a_split_squeezing_the_stage_under_it_too_meets_is_planned(monkeypatch):
    """Six nodes holding 1, 4, 4, 5, 3, 6 bytes; each cut adds what the sums miss on each side (received
    values, one backward). Under budgets 18 | 9 only 5 | 1 nodes fits (18 | 6); 3 | 3 nodes overflows
    stage 1 (15 | 15), 4 | 2 stage 0 (22 | 9). Rounds that tighten only the stage over its budget swing
    between those two and the budget was refused; squeezing the stage under its budget as well moves
    the cut to the split that fits."""
    dag = chain()
    held = {"x": 0.0, **dict(zip(NODES, (1.0, 4.0, 4.0, 5.0, 3.0, 6.0)))}
    missed = {1: (4.0, 6.0), 2: (0.0, 0.0), 3: (6.0, 1.0), 4: (8.0, 0.0), 5: (1.0, 0.0)}  # by nodes in stage 0

    def stage_totals(assignment):
        totals = [0.0, 0.0]
        for node, stage in assignment.items():
            totals[stage] += held[node]
        extra = missed[sum(assignment[node] == 0 for node in NODES)]
        return [totals[0] + extra[0], totals[1] + extra[1]]

    def request():
        memory = MemoryCount("memory", lambda apart: {MEMORY: held}, stage_totals)
        return SplitRequest(dag, ["x", *NODES], 2, "min-cut", lambda apart: held, stage_totals, memory=memory,
                            max_memory=(18.0, 9.0))

    found = search_split(request())
    assert [found.assignment[node] for node in NODES] == [0, 0, 0, 0, 0, 1]
    tightened = placements._tightened
    monkeypatch.setattr(placements, "_tightened", lambda request, placement, found, tried, squeeze_the_rest:
                        found if squeeze_the_rest else tightened(request, placement, found, tried, False))
    with pytest.raises(InfeasibleSplitError):
        search_split(request())
