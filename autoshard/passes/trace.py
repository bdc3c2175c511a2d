"""The ``trace`` pass: capture the model as an fx graph, wrapping only what cannot be traced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from autoshard.capture.fx import trace_with_leaves
from autoshard.capture.result import TraceResult
from autoshard.passes.base import Pass, PassContext, ShardProgram, option

__all__ = ["FUSED_PATHS_HELP", "TRACE_HOOKS_HELP", "TracePass", "TraceResult", "example_call"]

FUSED_PATHS_HELP = ("in eval mode, keep modules with a fused inference path (nn.TransformerEncoderLayer, "
                    "nn.MultiheadAttention, a padded nn.TransformerEncoder) whole, so stages run the model's "
                    "kernels; false traces through them for a finer split")
TRACE_HOOKS_HELP = ("trace through modules with forward hooks, running the hooks as a node after the body on every "
                    "call, instead of keeping them whole; re-specialisation sets it, so that a plan split inside "
                    "layers that gained hooks since (Transformers' output recorders) serves such calls. A hook "
                    "that uses weights its module's forward does not is not supported")


def example_call(program: ShardProgram) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example's positional and keyword arguments (none when there is no example)."""
    inputs = program.example_inputs
    return (tuple(inputs.args), dict(inputs.kwargs)) if inputs is not None else ((), {})


@dataclass(frozen=True)
class TracePass(Pass):
    """Trace the model with torch.fx, wrapping the innermost untraceable modules or functions.

    When tracing fails, the innermost module whose own forward failed becomes a leaf, or, if the
    failure is inside a free function called from a forward, only that call is kept opaque; then
    tracing is retried. With example inputs the model is traced as it was called (non-tensor
    arguments become constants) and the example runs alongside, so shape and dtype code traces.
    The result lists every wrapped module and function with its error.
    Example: ``trace,build-dag,linearize,split{stages=4},emit``.
    """

    name: ClassVar[str] = "trace"
    requires: ClassVar[frozenset[str]] = frozenset({"model"})
    provides: ClassVar[frozenset[str]] = frozenset({"traced"})

    pin_sizes: bool = option(False, help="code that turns a size into a Python number (int(), range()) takes "
                                         "the example's, guarded, instead of being kept whole")
    fused_paths: bool = option(True, help=FUSED_PATHS_HELP)
    trace_hooks: bool = option(False, help=TRACE_HOOKS_HELP)

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        traced = trace_with_leaves(program.model, *example_call(program), pin_sizes=self.pin_sizes,
                                   fused_paths=self.fused_paths, trace_hooks=self.trace_hooks)
        return dataclasses.replace(program, traced=traced)
