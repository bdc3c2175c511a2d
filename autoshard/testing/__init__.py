"""A public test kit for splitters: property checks and brute-force oracles.

``autoshard.testing.strategies`` holds hypothesis strategies for contract-satisfying graphs; it
needs ``hypothesis`` and is therefore not imported here.
"""

from autoshard.testing.properties import (
    BRUTE_FORCE_MAX_NODES,
    all_partitions,
    brute_force_fixed_order_bottleneck,
    brute_force_min_bottleneck,
    brute_force_min_bytes,
    check_splitter,
    contiguous_partitions,
)

__all__ = [
    "BRUTE_FORCE_MAX_NODES",
    "all_partitions",
    "brute_force_fixed_order_bottleneck",
    "brute_force_min_bottleneck",
    "brute_force_min_bytes",
    "check_splitter",
    "contiguous_partitions",
]
