"""What a capture front end hands to the rest of the pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from autoshard.capture.attribute_reads import AttributeRead


@dataclass(frozen=True)
class WrappedLeaf:
    """Something kept opaque in the graph, and the error that forced it; ``by_design`` when no
    error did (a module kept whole for PyTorch's fused inference path)."""

    kind: Literal["module", "function"]
    name: str
    reason: str
    by_design: bool = False


@dataclass(frozen=True)
class TraceResult:
    """The captured graph plus the record of every wrapped module or function.

    ``specialized`` lists the conditions on input shapes that the capture fixed to their value on
    the example (a guard in the graph refuses inputs that flip them); ``input_guard`` says which
    inputs the graph accepts, or is empty when it accepts any inputs of the traced signature;
    ``considered`` says how each front end tried by ``auto`` fared; ``attributes_read`` lists the plain
    attributes the traced code read (``capture.attribute_reads``), which the graph fixed.
    """

    graph_module: fx.GraphModule
    wrapped: tuple[WrappedLeaf, ...]
    front_end: str = "fx"
    specialized: tuple[str, ...] = ()
    input_guard: str = ""
    considered: tuple[str, ...] = ()
    attributes_read: tuple[AttributeRead, ...] = ()
    #: the graph inputs whose ``grad_fn`` or ``is_leaf`` the traced code asked (``sharded.ExampleTensors``)
    leafness_asked: frozenset[str] = frozenset()
    #: how the graph differs from the model on the example, where ``auto`` found every front end's capture
    #: differing and kept the least wrapped (the verify pass refuses it, saying why; without it, ``run_pipeline``)
    difference: str | None = None

    @property
    def wrapped_modules(self) -> tuple[WrappedLeaf, ...]:
        """The modules kept whole because the capture failed in them (not those kept by design)."""
        return tuple(w for w in self.wrapped if w.kind == "module" and not w.by_design)

    def describe(self) -> str:
        lines = [f"front end: {self.front_end}; {len(self.graph_module.graph.nodes)} nodes"]
        lines += [f"wrapped {w.kind} {w.name}: {w.reason}" for w in self.wrapped]
        lines += [f"specialized: {s}" for s in self.specialized]
        if self.input_guard:
            lines.append(f"accepts: {self.input_guard}")
        lines += [f"tried {c}" for c in self.considered]
        return "\n".join(lines)
