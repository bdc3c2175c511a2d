"""Graph capture front ends: turn an ``nn.Module`` into a ``torch.fx.GraphModule``."""

from autoshard.capture.fx import TraceResult, WrappedLeaf, trace_with_leaves

__all__ = ["TraceResult", "WrappedLeaf", "trace_with_leaves"]
