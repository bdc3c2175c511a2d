"""Graph capture front ends: turn an ``nn.Module`` into a ``torch.fx.GraphModule``.

``trace_with_leaves`` (torch.fx) and ``export_with_leaves`` (torch.export) yield the same graph
contract; ``capture`` picks between them.
"""

from autoshard.capture.auto import FRONT_ENDS, capture
from autoshard.capture.export import export_with_leaves
from autoshard.capture.fx import trace_with_leaves
from autoshard.capture.result import TraceResult, WrappedLeaf

__all__ = ["FRONT_ENDS", "TraceResult", "WrappedLeaf", "capture", "export_with_leaves", "trace_with_leaves"]
