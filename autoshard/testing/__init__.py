"""A public test kit for splitters: property checks and brute-force oracles.

``autoshard.testing.strategies`` holds hypothesis strategies for contract-satisfying graphs and
``autoshard.testing.modules`` strategies for random ``nn.Module``s built from them; they need
``hypothesis`` (and torch) and are therefore not imported here. ``autoshard.testing.graphs``
builds large seeded workload graphs for benchmarks.
"""

from autoshard.testing.properties import (
    BRUTE_FORCE_MAX_NODES,
    all_partitions,
    brute_force_fixed_order_bottleneck,
    brute_force_min_bottleneck,
    brute_force_constrained,
    brute_force_min_bytes,
    check_constraints,
    check_splitter,
    constraint_violations,
    contiguous_partitions,
    relative_bottleneck,
)

__all__ = [
    "BRUTE_FORCE_MAX_NODES",
    "all_partitions",
    "brute_force_fixed_order_bottleneck",
    "brute_force_min_bottleneck",
    "brute_force_constrained",
    "brute_force_min_bytes",
    "check_constraints",
    "check_splitter",
    "constraint_violations",
    "contiguous_partitions",
    "relative_bottleneck",
]
