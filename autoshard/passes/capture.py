"""The ``capture`` pass: try both front ends and keep the capture with fewer opaque leaves."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from autoshard.capture.auto import capture
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.passes.trace import FUSED_PATHS_HELP, TRACE_HOOKS_HELP, example_call


@dataclass(frozen=True)
class CapturePass(Pass):
    """Capture with fx and torch.export and keep the graph that wraps fewer modules (fx on a tie).

    fx is tried first; when it wraps nothing export is skipped. Without example inputs only fx
    can run. The result says which front end won and how the other fared.
    Example: ``capture,build-dag,linearize,split{stages=4},emit,verify``.
    """

    name: ClassVar[str] = "capture"
    requires: ClassVar[frozenset[str]] = frozenset({"model"})
    provides: ClassVar[frozenset[str]] = frozenset({"traced"})

    fused_paths: bool = option(True, help=FUSED_PATHS_HELP)
    trace_hooks: bool = option(False, help=TRACE_HOOKS_HELP)

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        traced = capture(program.model, *example_call(program), fused_paths=self.fused_paths,
                         trace_hooks=self.trace_hooks)
        return dataclasses.replace(program, traced=traced)
