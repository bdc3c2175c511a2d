"""The split passes: thin adapters from the program to ``autoshard.graph.split_dag``.

``split`` takes the strategy as an option; ``split-greedy``, ``split-uniform``, ``split-exact``
and ``split-fixed-order`` fix it, so a pipeline names the policy it uses. All share the module-
level constraints, resolved here to node sets (``autoshard.graph.scopes``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import networkx as nx

from autoshard.errors import InvalidArgumentError
from autoshard.graph import Partition, split_dag
from autoshard.graph.constraints import MEMORY
from autoshard.graph.scopes import cut_before_nodes, no_split_groups, tied_groups
from autoshard.passes.analyses import node_costs
from autoshard.passes.base import Pass, PassContext, ShardProgram, option


def weighted_in_order(
    dag: nx.DiGraph, order: Sequence[str], costs: dict[str, float], memory: dict[str, float] | None = None
) -> nx.DiGraph:
    """A copy of ``dag`` with ``cost`` (and ``memory``) set, whose node insertion order is ``order``."""
    weighted = nx.DiGraph()
    for node in order:
        extra = {MEMORY: memory[node]} if memory is not None else {}
        weighted.add_node(node, **{**dag.nodes[node], "cost": costs[node], **extra})
    weighted.add_edges_from(dag.edges(data=True))
    return weighted


@dataclass(frozen=True)
class _SplitWithConstraints(Pass):
    """Shared options and behaviour of the split passes (not registered itself).

    Each subclass provides ``strategy``, the ``split_dag`` strategy: an option of ``split``, a
    class constant of the others.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"dag", "order"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})

    stages: int | None = option(None, help="number of stages k (shard_model fills it in)")
    cost: str = option("params", help="registered cost model to balance (params, nodes, flops, ...)")
    tolerance: float = option(0.0, help="allowed bottleneck above the optimum, as a fraction")
    cut_before: tuple[str, ...] = option((), help="module paths at whose first node a stage starts")
    no_split: tuple[str, ...] = option((), help="module paths or class names kept whole in one stage")
    capacities: tuple[float, ...] = option((), help="relative speed of each stage; cost / speed is balanced")
    max_memory: tuple[float, ...] = option((), help="memory budget per stage (one value: every stage)")
    memory_cost: str = option("memory", help="cost model that max-memory limits")
    keep_tied: bool = option(True, help="keep nodes sharing a weight in one stage when the balance allows")

    def strategy_options(self) -> dict[str, Any]:
        """Options for the strategy itself (none unless a subclass has some)."""
        return {}

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        if self.stages is None:
            raise InvalidArgumentError(f"'{self.name}' needs a stage count: write {self.name}{{stages=K}}")
        memory = node_costs(program, ctx, self.memory_cost) if self.max_memory else None
        weighted = weighted_in_order(program.dag, program.order, node_costs(program, ctx, self.cost), memory)
        result = split_dag(
            weighted, self.stages, self.strategy, self.tolerance,
            cut_before=cut_before_nodes(weighted, program.order, self.cut_before),
            together=no_split_groups(weighted, self.no_split),
            prefer_together=tied_groups(weighted) if self.keep_tied else {},
            capacities=self.capacities or None,
            memory_budgets=self.max_memory or None,
            return_info=True, **self.strategy_options(),
        )
        partition = Partition.from_assignment(weighted, result.assignment, self.stages, result.info)
        return dataclasses.replace(program, partition=partition)


@dataclass(frozen=True)
class SplitPass(_SplitWithConstraints):
    """Cut the ordered DAG into exactly k stages: smallest bottleneck, then fewest boundary bytes.

    The bottleneck (the costliest stage) is at most (1 + tolerance) times the best achievable
    for the given order; among such splits the one with the fewest bytes crossing boundaries
    wins. Values used several stages later are carried through. Example:
    ``split{stages=4 cost=params cut-before=layers.2 no-split=TransformerEncoderLayer}``.
    """

    name: ClassVar[str] = "split"

    strategy: str = option("min-cut", help="splitting strategy of autoshard.graph.split_dag")


@dataclass(frozen=True)
class SplitFixedOrderPass(_SplitWithConstraints):
    """Split as contiguous runs of the given order: the fixed-order optimum (no refinement).

    Same bound as ``split``; among the splits of the order itself, the fewest boundary bytes.
    Example: ``split-fixed-order{stages=4}``.
    """

    name: ClassVar[str] = "split-fixed-order"
    strategy: ClassVar[str] = "fixed-order"


@dataclass(frozen=True)
class SplitExactPass(_SplitWithConstraints):
    """Split by MILP: the fewest boundary bytes over all ordered splits within the bound.

    Warm-started from ``min-cut``; after ``time-limit`` seconds it keeps the best split found,
    and the partition's ``info.proven_optimal`` says whether HiGHS proved it optimal. Needs the
    ``exact`` extra (highspy). Example: ``split-exact{stages=8 time-limit=30}``.
    """

    name: ClassVar[str] = "split-exact"
    strategy: ClassVar[str] = "exact"

    time_limit: float = option(30.0, help="seconds the solver may search before keeping its best")

    def strategy_options(self) -> dict[str, Any]:
        return {"time_limit": self.time_limit}


@dataclass(frozen=True)
class SplitGreedyPass(_SplitWithConstraints):
    """fairscale's greedy rule, for comparison: close a stage once it reaches total / k.

    Ignores the tolerance and takes no constraints besides keep-tied (which it only reports).
    Example: ``split-greedy{stages=4}``.
    """

    name: ClassVar[str] = "split-greedy"
    strategy: ClassVar[str] = "greedy"


@dataclass(frozen=True)
class SplitUniformPass(_SplitWithConstraints):
    """Equal numbers of nodes per stage, ignoring costs, for comparison.

    Takes no constraints besides keep-tied (which it only reports). Example:
    ``split-uniform{stages=4}``.
    """

    name: ClassVar[str] = "split-uniform"
    strategy: ClassVar[str] = "uniform"
