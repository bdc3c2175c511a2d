"""The ``linearize`` pass: choose the topological order the split cuts along."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from autoshard.graph.linearize import ORDERS
from autoshard.passes.base import Pass, PassContext, ShardProgram, option


@dataclass(frozen=True)
class LinearizePass(Pass):
    """Fix a deterministic topological order of the DAG (default: program order).

    Stages are contiguous runs of this order. ``live-bytes`` schedules so that fewer values are
    alive at once, which can give cheaper cuts. Example: ``linearize{order=live-bytes}``.
    """

    name: ClassVar[str] = "linearize"
    requires: ClassVar[frozenset[str]] = frozenset({"dag"})
    provides: ClassVar[frozenset[str]] = frozenset({"order"})

    order: Literal["program", "live-bytes", "dfs"] = option("program", help="which topological order")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return dataclasses.replace(program, order=tuple(ORDERS[self.order](program.dag)))
