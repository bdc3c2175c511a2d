"""The split search: a ``SplitRequest`` in, the best ``Partition`` the strategy finds out.

It places tied weights (``placements``), holds ``max_memory`` exactly and, for ``cost=memory``
with a strategy cheap enough to probe, balances training memory by a bisection (``bisection``).
The split passes are adapters: options and the run's cost models in, a request, this search.
"""

from __future__ import annotations

from autoshard.costs.split_search.bisection import (
    MEMORY_SEARCH_STEPS,
    MEMORY_SEARCH_STRATEGIES,
    balances_training_memory,
    memory_balanced,
)
from autoshard.costs.split_search.placements import split_placing_ties, weighted_in_order
from autoshard.costs.split_search.request import MemoryCount, SplitRequest, summed_memory, training_memory
from autoshard.graph import Partition

__all__ = [
    "MEMORY_SEARCH_STEPS", "MEMORY_SEARCH_STRATEGIES", "MemoryCount", "SplitRequest", "search_split",
    "summed_memory", "training_memory", "weighted_in_order",
]


def search_split(request: SplitRequest) -> Partition:
    """The split ``request`` asks for: ties placed, budgets held, training memory balanced."""
    partition = split_placing_ties(request)
    if not balances_training_memory(request):
        return partition
    return memory_balanced(request, partition.info.bottleneck)
