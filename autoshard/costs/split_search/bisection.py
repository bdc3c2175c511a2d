"""Balancing training memory: a bisection on a memory bound held as per-stage budgets.

Training memory counts activations once per microbatch in flight at a stage (1F1B), which no
sum of per-node costs can say, so ``cost=memory`` is balanced by searching the least bound B that
a split holds every stage to (B x its capacity, capped by ``max_memory``) and splitting within it.
Each probe is a budgeted split (``placements.split_placing_ties``), held by the whole model, the
re-split under tightened budgets included, so the bound found is one a plan really meets. Only for
the strategies cheap enough to probe many times.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.costs.split_search.placements import split_placing_ties
from autoshard.costs.split_search.request import SplitRequest
from autoshard.errors import InfeasibleSplitError
from autoshard.graph import Partition

#: Strategies whose ``cost=memory`` split searches the training-memory bound, and how many halvings.
MEMORY_SEARCH_STRATEGIES = ("min-cut", "fixed-order")
MEMORY_SEARCH_STEPS = 12


def balances_training_memory(request: SplitRequest) -> bool:
    """Whether ``request`` balances training memory by the bound search (else by one-microbatch node costs)."""
    return request.training_memory_cost and request.strategy in MEMORY_SEARCH_STRATEGIES


def memory_balanced(request: SplitRequest, first: Partition) -> Partition:
    """The split whose costliest stage in training memory is within the tolerance of the least any
    probe reaches; ``first`` is a split whose costliest stage bounds the search. The probes split
    without moves; where the last split, with them, meets no plan at the bound found (its tightening
    takes another path), the probe that met it is kept, else ``first``: a plan without budgets was
    refused naming a ``max_memory`` the caller never gave."""
    speeds = request.each_stage(request.capacities or (1.0,))
    caps = request.each_stage(request.max_memory) if request.max_memory else (math.inf,) * request.k
    fast = {"moves": False} if "moves" in request.strategy_options else {}

    def within(bound: float, **options: bool) -> SplitRequest:
        return dataclasses.replace(request, max_memory=tuple(min(bound * s, c) for s, c in zip(speeds, caps)),
                                   strategy_options={**request.strategy_options, **options})

    def fitting(bound: float) -> Partition | None:
        try:
            split = split_placing_ties(within(bound, **fast), exact=False)
        except InfeasibleSplitError:
            return None
        return split if split.info.bottleneck <= bound * (1 + 1e-9) else None

    low, high, met = 0.0, first.info.bottleneck, first
    for _ in range(MEMORY_SEARCH_STEPS):
        middle = (low + high) / 2
        probe = fitting(middle)
        low, high, met = (low, middle, probe) if probe is not None else (middle, high, met)
    bound = high * (1 + request.tolerance)
    try:
        split = split_placing_ties(within(bound), exact=False)
    except InfeasibleSplitError:
        split = met
    # The inner split's bound is on one microbatch's memory; the plan is held to this one.
    return dataclasses.replace(split, info=dataclasses.replace(split.info, bound=bound))
