"""The ``verify`` pass: run the model and the stages on the example inputs and compare."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from autoshard.errors import InvalidArgumentError
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.verify import verify_stages


@dataclass(frozen=True)
class VerifyPass(Pass):
    """Compare the chained stages with the original model; name the first stage that differs.

    Runs eagerly on the example inputs with one random seed for both runs and restores buffers
    afterwards, so the model is left as it was. Exact by default (``rtol=0 atol=0``).
    Example: ``...,emit,verify{atol=1e-6}``.
    """

    name: ClassVar[str] = "verify"
    requires: ClassVar[frozenset[str]] = frozenset({"model", "example_inputs", "traced", "sharded"})
    provides: ClassVar[frozenset[str]] = frozenset({"verification"})

    rtol: float = option(0.0, help="relative tolerance (0: exact)")
    atol: float = option(0.0, help="absolute tolerance (0: exact)")
    seed: int = option(0, help="random seed replayed for every run (dropout)")

    def check_options(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"verify's {name} must be finite and >= 0, got {value!r}")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        inputs = program.example_inputs
        sharded = program.sharded
        summary = verify_stages(
            program.model, program.traced.graph_module, list(sharded.stages), sharded.plan.boundaries,
            tuple(inputs.args), dict(inputs.kwargs), rtol=self.rtol, atol=self.atol, seed=self.seed,
        )
        return dataclasses.replace(program, verification=summary)
