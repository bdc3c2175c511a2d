"""Graph capture front ends: turn an ``nn.Module`` into a ``torch.fx.GraphModule``.

``trace_with_leaves`` (torch.fx) and ``export_with_leaves`` (torch.export) yield the same graph
contract; ``capture`` picks between them. Names load lazily: the export machinery (sympy, a
custom op) costs half a second to import, which an fx-only run need not pay.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FRONT_ENDS": "autoshard.capture.auto",
    "capture": "autoshard.capture.auto",
    "export_with_leaves": "autoshard.capture.export",
    "trace_with_leaves": "autoshard.capture.fx",
    "TraceResult": "autoshard.capture.result",
    "WrappedLeaf": "autoshard.capture.result",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autoshard.capture' has no attribute {name!r}")
