"""The ``export`` pass: capture the model with ``torch.export``, wrapping only what cannot be exported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.passes.trace import FUSED_PATHS_HELP, example_call


@dataclass(frozen=True)
class ExportPass(Pass):
    """Capture the model with torch.export (non-strict), keeping untraceable leaves opaque.

    Goes through top-level forwards that fx cannot trace (mask builders, input checks); a module
    or free function that branches on tensor values is kept opaque and runs eagerly in its stage.
    Every input dimension is exported as dynamic; sizes the model pins are checked on every call.
    Example: ``export,build-dag,linearize,split{stages=4},emit,verify``.
    """

    name: ClassVar[str] = "export"
    requires: ClassVar[frozenset[str]] = frozenset({"model", "example_inputs"})
    provides: ClassVar[frozenset[str]] = frozenset({"traced"})

    fused_paths: bool = option(True, help=FUSED_PATHS_HELP)

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        from autoshard.capture.export import export_with_leaves  # slow to import: only when used

        traced = export_with_leaves(program.model, *example_call(program), fused_paths=self.fused_paths)
        return dataclasses.replace(program, traced=traced)
