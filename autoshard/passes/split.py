"""The ``split`` pass: a thin adapter from the program to ``autoshard.graph.split_dag``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Sequence

import networkx as nx

from autoshard.errors import InvalidArgumentError
from autoshard.graph import Partition, split_dag
from autoshard.passes.analyses import node_costs
from autoshard.passes.base import Pass, PassContext, ShardProgram, option


def weighted_in_order(dag: nx.DiGraph, order: Sequence[str], costs: dict[str, float]) -> nx.DiGraph:
    """A copy of ``dag`` with ``cost`` set, whose node insertion order is ``order``."""
    weighted = nx.DiGraph()
    for node in order:
        weighted.add_node(node, **{**dag.nodes[node], "cost": costs[node]})
    weighted.add_edges_from(dag.edges(data=True))
    return weighted


@dataclass(frozen=True)
class SplitPass(Pass):
    """Cut the ordered DAG into exactly k stages: smallest bottleneck, then fewest boundary bytes.

    The bottleneck (the costliest stage) is at most (1 + tolerance) times the best achievable
    for the given order; among such splits the one with the fewest bytes crossing boundaries
    wins. Values used several stages later are carried through. Example:
    ``split{stages=4 cost=params}``.
    """

    name: ClassVar[str] = "split"
    requires: ClassVar[frozenset[str]] = frozenset({"dag", "order"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})

    stages: int | None = option(None, help="number of stages k (shard_model fills it in)")
    cost: str = option("params", help="registered cost model to balance (params, nodes)")
    strategy: str = option("min-cut", help="splitting strategy of autoshard.graph.split_dag")
    tolerance: float = option(0.0, help="allowed bottleneck above the optimum, as a fraction")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        if self.stages is None:
            raise InvalidArgumentError(f"'{self.name}' needs a stage count: write {self.name}{{stages=K}}")
        weighted = weighted_in_order(program.dag, program.order, node_costs(program, ctx, self.cost))
        assignment = split_dag(weighted, self.stages, strategy=self.strategy, tolerance=self.tolerance)
        return dataclasses.replace(program, partition=Partition.from_assignment(weighted, assignment, self.stages))
