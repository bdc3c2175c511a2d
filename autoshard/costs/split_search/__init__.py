"""The split search: a ``SplitRequest`` in, the best ``Partition`` the strategy finds out.

It places tied weights (``placements``), holds ``max_memory`` exactly and, for ``cost=memory``
with a strategy cheap enough to probe, balances training memory by a bisection (``bisection``).
The split passes are adapters: options and the run's cost models in, a request, this search.
"""

from __future__ import annotations

import dataclasses

from autoshard.costs.split_search.bisection import (
    MEMORY_SEARCH_STEPS,
    MEMORY_SEARCH_STRATEGIES,
    balances_training_memory,
    memory_balanced,
)
from autoshard.costs.split_search.placements import split_placing_ties, weighted_in_order
from autoshard.costs.split_search.request import MemoryCount, SplitRequest, summed_memory, training_memory
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
        need = request.memory.stage_totals(free.assignment) if request.memory else ()
        if not need or any(m > b for m, b in zip(need, request.each_stage(request.max_memory))):
            raise
        return free
    return memory_balanced(request, partition)
