"""The ``emit`` pass: build the stage GraphModules and the ``ShardedModel``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from autoshard.capture.signature import forward_signature
from autoshard.emit import emit_stages
from autoshard.graph import boundary_values
from autoshard.passes.analyses import memory_model
from autoshard.passes.base import Pass, PassContext, ShardProgram
from autoshard.sharded import ShardedModel, StagePlan


@dataclass(frozen=True)
class EmitPass(Pass):
    """Emit k fx stages holding the original parameters under their original names.

    Every stage but the last returns the tuple of values crossing its boundary; the last
    returns exactly what the model returns. Example: ``...,split{stages=2},emit``.
    """

    name: ClassVar[str] = "emit"
    requires: ClassVar[frozenset[str]] = frozenset({"traced", "dag", "partition"})
    provides: ClassVar[frozenset[str]] = frozenset({"sharded"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        partition = program.partition
        assignment = dict(partition.assignment)
        k = partition.num_stages
        boundaries = tuple(tuple(b) for b in boundary_values(program.dag, assignment, k))
        stages = emit_stages(program.traced.graph_module, assignment, boundaries, program.model.training)
        plan = StagePlan(assignment, boundaries, program.traced.wrapped, program.dag, partition.info,
                         memory_model(ctx), training=program.model.training)
        return dataclasses.replace(program, sharded=ShardedModel(stages, plan, forward_signature(program.model)))
