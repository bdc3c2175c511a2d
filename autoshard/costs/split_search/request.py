"""``SplitRequest``: what the split search needs, as plain values and callables.

The split passes build one from their options and the run's cost models (``passes.analyses``
resolves and caches those), so the search reads no pass context and costs/ imports no passes/.
Module-level constraints arrive resolved to nodes (``graph.scopes``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import networkx as nx

from autoshard.costs.memory import (
    ContiguousStages, StageFloor, StageMemory, memory_shortfall, stage_floor, stage_memory)
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.ties import TieGroup
from autoshard.graph.constraints import ACTIVATION_MEMORY, MEMORY, StageRange
from autoshard.graph.indexed import IndexedDag
from autoshard.graph.partition import costs_as_placed, stage_between

#: ``apart`` (shared weights charged to every reader) -> each node's cost.
NodeCosts = Callable[[frozenset[str]], Mapping[str, float]]
#: A plan's assignment -> each stage's total, every shared weight once per stage holding it.
StageTotals = Callable[[Mapping[str, int]], Sequence[float]]
#: (j, a, b) -> stage j's total when it runs ``rest[a:b]`` of a contiguous split (``MemoryCount.stages_in_order``).
StageInOrder = Callable[[int, int, int], float]


@dataclass(frozen=True)
class MemoryCount:
    """How the memory ``max_memory`` limits is counted.

    ``node_attributes(apart)`` gives the node attributes the splitter sums per stage (``MEMORY``
    held once; ``ACTIVATION_MEMORY`` times ``in_flight[j]`` for training memory); ``stage_totals``
    scores a finished plan; ``shortfall(assignment, budgets)``, when set, is the model's own
    message for a stage over budget (else one naming the model ``name``); ``in_order(inputs, rest)``, when
    set, counts one stage at a time of the splits of ``rest`` into contiguous stages, faster than
    ``stage_totals`` (the exact search's judgments: ``stages_in_order``). ``floor()``, when set, is what a
    stage holds at least (``costs.memory.StageFloor``), by which the exact search prunes: made when first
    asked for, as only a budget about to be refused asks.
    """

    name: str
    node_attributes: Callable[[frozenset[str]], dict[str, Mapping[str, float]]]
    stage_totals: StageTotals
    in_flight: tuple[float, ...] | None = None
    shortfall: Callable[[Mapping[str, int], tuple[float, ...]], str] | None = None
    floor: Callable[[], StageFloor] | None = None
    in_order: Callable[[Sequence[str], Sequence[str]], StageInOrder] | None = None

    def stages_in_order(self, inputs: Sequence[str], rest: Sequence[str]) -> StageInOrder:
        """(j, a, b) -> stage j's memory when it runs ``rest[a:b]`` of a split of ``rest`` into contiguous
        stages (the model ``inputs`` in the first): what comes before in stage j - 1, after in j + 1
        (``graph.partition.stage_between``), as what it receives and sends depends only on its cuts."""
        if self.in_order is not None:
            return self.in_order(inputs, rest)
        return lambda j, a, b: self.stage_totals(stage_between(inputs, rest, j, a, b))[j]


def summed_memory(name: str, node_costs: NodeCosts, stage_totals: StageTotals) -> MemoryCount:
    """Memory as the cost model ``name`` counts it: each node's cost, held once."""
    return MemoryCount(name, lambda apart: {MEMORY: node_costs(apart)}, stage_totals)


def training_memory(
    dag: nx.DiGraph, k: int, model: MemoryModel,
    parts: Callable[[frozenset[str]], tuple[Mapping[str, float], Mapping[str, float]]],
) -> MemoryCount:
    """Training memory (``costs.memory``): weight state once per stage, activations once per
    microbatch in flight. ``parts(apart)`` is ``costs.models.memory_parts`` under ``model``."""

    def attributes(apart: frozenset[str]) -> dict[str, Mapping[str, float]]:
        held, kept = parts(apart)
        return {MEMORY: held, ACTIVATION_MEMORY: kept}

    @functools.cache
    def stages(assignment: tuple[tuple[str, int], ...]) -> list[StageMemory]:
        # the search scores a plan both as the balanced cost and against the budgets, and its probes
        # often come back to a plan already scored; counting one is the costliest step outside the splitter
        return stage_memory(dag, dict(assignment), k, model)

    def totals(assignment: Mapping[str, int]) -> list[float]:
        return [stage.total for stage in stages(tuple(assignment.items()))]

    def shortfall(assignment: Mapping[str, int], budgets: tuple[float, ...]) -> str:
        return memory_shortfall(stages(tuple(assignment.items())), budgets) or ""

    def in_order(inputs: Sequence[str], rest: Sequence[str]) -> StageInOrder:
        stages = ContiguousStages(dag, inputs, rest, k, model)
        return lambda j, a, b: stages.stage(j, a, b).total

    floor = functools.cache(lambda: stage_floor(dag, k, model))
    return MemoryCount("memory", attributes, totals, model.all_in_flight(k), shortfall, floor, in_order)


@dataclass(frozen=True)
class SplitRequest:
    """One split to search: the DAG cut along ``order`` into ``k`` stages by ``strategy``.

    ``node_costs`` and ``stage_totals`` are the balanced cost model; ``charges_weights`` says it
    counts weights, so where a tie's readers go changes it. ``capacities`` and ``max_memory`` hold
    one value per stage or one for all (``memory`` counts what ``max_memory`` limits; the
    training-memory count when ``training_memory_cost`` says the balanced cost is training memory).
    ``together`` (no-split groups by label), ``cut_before`` (node -> the path written) and
    ``stage_ranges`` are the constraints resolved to nodes; ``ties`` the shared-weight groups.
    ``costed_dags`` keeps what ``costed`` made, for every request ``dataclasses.replace`` makes of this one.
    """

    dag: nx.DiGraph
    order: Sequence[str]
    k: int
    strategy: str
    node_costs: NodeCosts
    stage_totals: StageTotals
    charges_weights: bool = False
    tolerance: float = 0.0
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    capacities: tuple[float, ...] = ()
    max_memory: tuple[float, ...] = ()
    memory: MemoryCount | None = None
    training_memory_cost: bool = False
    keep_tied: bool = True
    ties: tuple[TieGroup, ...] = ()
    together: Mapping[str, frozenset[str]] = field(default_factory=dict)
    cut_before: Mapping[str, str] = field(default_factory=dict)
    stage_ranges: Mapping[str, StageRange] = field(default_factory=dict)
    costed_dags: dict[tuple[Any, ...], IndexedDag] = field(default_factory=dict, compare=False, repr=False)

    def each_stage(self, values: tuple[float, ...]) -> tuple[float, ...]:
        return per_stage(values, self.k)

    def costed(self, apart: frozenset[str], budgeted: bool) -> IndexedDag:
        """The DAG in ``order`` with each node's cost, and when ``budgeted`` the memory count's node
        attributes, as they are with the weights ``apart`` charged to every reader; indexed. Made once
        for each cost model, memory count and placement: the bisection's probes and the tightening
        rounds differ only in budgets, and rebuilding it (with its index and orders) for each of them
        took about a third of the search."""
        attributes = self.memory.node_attributes if budgeted else None
        key = (self.dag, tuple(self.order), self.node_costs, attributes, apart)
        if key not in self.costed_dags:
            extra = attributes(apart) if attributes else None
            self.costed_dags[key] = IndexedDag(weighted_in_order(self.dag, self.order, self.node_costs(apart), extra))
        return self.costed_dags[key]


def weighted_in_order(
    dag: nx.DiGraph, order: Sequence[str], costs: Mapping[str, float],
    extra: Mapping[str, Mapping[str, float]] | None = None,
) -> nx.DiGraph:
    """A copy of ``dag`` with ``cost`` and each ``extra`` attribute set, inserted in ``order``; each weighs
    where a partition places its node (``costs_as_placed``: a recomputed size's with its first reader)."""
    weighted = nx.DiGraph()
    costs = costs_as_placed(dag, costs)
    extra = {name: costs_as_placed(dag, per_node) for name, per_node in (extra or {}).items()}
    for node in order:
        values = {name: per_node[node] for name, per_node in extra.items()}
        weighted.add_node(node, **{**dag.nodes[node], "cost": costs[node], **values})
    weighted.add_edges_from(dag.edges(data=True))
    return weighted


def per_stage(values: tuple[float, ...], k: int) -> tuple[float, ...]:
    """One value per stage of ``k``: a split option's single value (``split{max-memory=40e9}``) applies
    to every stage (the splitter checks the length of the rest)."""
    return values * k if len(values) == 1 else values
