"""The ``shape-prop`` pass: run the traced graph on the example inputs and record, per node,
its value's structure (tensor shapes, dtypes, bytes, nested tuples/lists/dicts), FLOPs and what
autograd saves: the ``facts`` artifact, also carried on the graph's nodes (``costs.facts``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal

from autoshard.capture.check_order import hoist_checks
from autoshard.capture.eager import check_model_runs
from autoshard.lowering.shape_carriers import carry_shapes
from autoshard.capture.size_conditions import check_early
from autoshard.passes.annotate import annotated_copy
from autoshard.costs.execution import resolve_mode
from autoshard.costs.propagation import propagate
from autoshard.errors import ShapePropagationError, SpecializationMismatch
from autoshard.passes.base import Pass, PassContext, ShardProgram, option


@dataclass(frozen=True)
class ShapePropPass(Pass):
    """Run the graph on the example inputs; record each value's shape, dtype, bytes and FLOPs.

    With ``mode=auto`` a model or inputs on the meta device run as fake tensors (nothing is
    allocated, so models larger than memory can be planned); others run for real, which also
    follows control flow that reads tensor values. ``build-dag`` turns the record into real
    boundary sizes and lets non-tensor values be recomputed instead of crossing a boundary.
    Example: ``trace,shape-prop,build-dag,linearize,split{stages=4 cost=flops},emit``.
    """

    name: ClassVar[str] = "shape-prop"
    requires: ClassVar[frozenset[str]] = frozenset({"model", "traced", "example_inputs"})
    provides: ClassVar[frozenset[str]] = frozenset({"traced", "facts"})

    mode: Literal["auto", "real", "fake"] = option("auto", help="tensors to run with (auto: fake on meta)")
    seed: int = option(0, help="random seed for a real run (dropout)")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        traced, inputs = program.traced, program.example_inputs
        try:
            facts = propagate(traced.graph_module, inputs, self.mode, self.seed)
        except (ShapePropagationError, SpecializationMismatch):  # (a condition export kept, broken by the example)
            if resolve_mode(program.model, inputs, self.mode) == "real":
                check_model_runs(program.model, inputs.args, inputs.kwargs)  # its own error says more
            raise
        annotated = annotated_copy(traced.graph_module, program.model, facts=facts)
        hoist_checks(annotated)  # as early as the facts show their conditions may run
        if program.model.training:  # and those on sizes computed, over the inputs' sizes (``size_conditions``)
            check_early(annotated, inputs)
        carry_shapes(annotated, facts)  # a read of a size lets a zero-byte carrier cross, not the tensor
        annotated.recompile()
        return dataclasses.replace(program, traced=dataclasses.replace(traced, graph_module=annotated),
                                   facts=MappingProxyType(facts))
