"""Split a weighted dataflow DAG into k ordered pipeline stages; networkx and numpy, no torch.

The graph contract (node attributes ``cost``, ``bytes``, optional ``input`` / ``output``) is
described in ``invariants.check_dag``; ``split_dag`` is the entry point.
"""

from autoshard.graph.balance import min_bottleneck
from autoshard.graph.constraints import Constraints, StageRange
from autoshard.graph.invariants import check_dag, check_partition
from autoshard.graph.partition import (
    Partition,
    SplitInfo,
    bottleneck,
    boundary_bytes,
    boundary_values,
    stage_costs,
    total_boundary_bytes,
)
from autoshard.graph.problem import Outcome, SplitProblem
from autoshard.graph.split import SplitResult, register_strategy, split_dag, strategies

__all__ = [
    "Constraints",
    "Outcome",
    "Partition",
    "SplitInfo",
    "SplitProblem",
    "SplitResult",
    "StageRange",
    "bottleneck",
    "boundary_bytes",
    "boundary_values",
    "check_dag",
    "check_partition",
    "min_bottleneck",
    "register_strategy",
    "split_dag",
    "stage_costs",
    "strategies",
    "total_boundary_bytes",
]
