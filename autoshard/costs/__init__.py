"""What a plan costs: value structures, FLOPs, measured times, training memory, shared weights.

One module per job; the ``shape-prop`` and ``profile`` passes record measurements on the traced
graph, ``lowering.from_fx`` copies them onto the DAG, and ``costs.models`` turns them into the
per-node and per-stage costs the split balances and the plan reports.

This package namespace imports no torch (the DAG-level models, memory and ties work with
networkx alone); ``costs.values``, ``execution``, ``flops``, ``propagation`` and ``timing`` do.
"""

from autoshard.costs.memory import StageMemory, check_memory_budgets, stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.models import DAG_COST_MODELS, stage_totals
from autoshard.costs.ties import SharedWeight, shared_weights

__all__ = [
    "DAG_COST_MODELS", "MemoryModel", "SharedWeight", "StageMemory", "check_memory_budgets", "shared_weights",
    "stage_memory", "stage_totals",
]
