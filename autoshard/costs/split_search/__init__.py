"""The split search: a ``SplitRequest`` in, the best ``Partition`` the strategy finds out.

It places tied weights (``placements``), holds ``max_memory`` exactly and, for ``cost=memory``
with a strategy cheap enough to probe, balances training memory by a bisection (``bisection``).
The split passes are adapters: options and the run's cost models in, a request, this search.
"""

from __future__ import annotations

import dataclasses

from autoshard.costs.models import param_costs
from autoshard.costs.split_search.bisection import (
    MEMORY_SEARCH_STEPS,
    MEMORY_SEARCH_STRATEGIES,
    balances_training_memory,
    memory_balanced,
)
from autoshard.costs.split_search.placements import split_placing_ties
from autoshard.costs.split_search.request import (
    MemoryCount, SplitRequest, summed_memory, training_memory, weighted_in_order,
)
from autoshard.errors import InfeasibleSplitError
from autoshard.graph import Partition

__all__ = [
    "MEMORY_SEARCH_STEPS", "MEMORY_SEARCH_STRATEGIES", "MemoryCount", "SplitRequest", "search_split",
    "summed_memory", "training_memory", "weighted_in_order",
]


def search_split(request: SplitRequest) -> Partition:
    """The split ``request`` asks for: ties placed, budgets held, training memory balanced."""
    if not balances_training_memory(request):
        return split_placing_ties(request)
    try:
        partition = split_placing_ties(request)
    except InfeasibleSplitError:
        if not request.max_memory:
            raise
        # The budgeted search starts from per-node sums and may miss what the bound search finds, so
        # the plan made without budgets is planned when it fits (its fullest stage was 0.7x the other's).
        free = search_split(dataclasses.replace(request, max_memory=()))
        if not within_budgets(request, free):
            raise
        return free
    balanced, plain = memory_balanced(request, partition), weights_balanced(request)
    return plain if plain is not None and plain.info.bottleneck < balanced.info.bottleneck else balanced


def weights_balanced(request: SplitRequest) -> Partition | None:
    """The split the default cost (weight bytes) makes under ``request``'s constraints, scored in
    training memory; None where it breaks a budget or no such split exists. The bound search's
    probes are budgeted splits, a heuristic: on the GPT-style LM they cut inside a block (two values
    sent, their receive buffers doubled), and ``cost=memory`` came out fuller than this split."""
    dag = request.dag
    if "weights" not in dag.graph and not all("param_bytes" in data for _, data in dag.nodes(data=True)):
        return None  # a DAG built by hand without weights: no such split to weigh
    # split by weight bytes, scored (bottleneck per capacity, tie placements ranked) in training memory
    by_weights = dataclasses.replace(request, node_costs=lambda apart: param_costs(dag, apart), charges_weights=True,
                                     training_memory_cost=False, max_memory=())
    try:
        split = split_placing_ties(by_weights)
    except InfeasibleSplitError:
        return None
    if split.info is None or not within_budgets(request, split):
        return None
    return dataclasses.replace(split, info=dataclasses.replace(split.info, bound=split.info.bottleneck))


def within_budgets(request: SplitRequest, split: Partition) -> bool:
    """Whether every stage of ``split`` fits ``request``'s ``max_memory`` as its memory count scores
    it (no budgets: it does; budgets but no count to judge by: it does not)."""
    if not request.max_memory:
        return True
    return request.memory is not None and all(
        need <= cap for need, cap in zip(request.memory.stage_totals(split.assignment),
                                         request.each_stage(request.max_memory)))
