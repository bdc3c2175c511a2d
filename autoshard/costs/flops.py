"""FLOPs per graph node, counted by ``torch.utils.flop_counter`` while the graph runs.

One ``FlopCounterMode`` stays open for the whole run and each node is charged the count it
added, so the per-node numbers sum exactly to what the counter sees for the whole graph. A leaf
module (``call_module``) runs whole under the counter, so everything inside it is counted. The
counter works on real, fake and meta tensors alike: it reads shapes, not values.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from autoshard.costs.execution import NodeCall


class NodeFlopCounter:
    """Context manager; ``measure(call)`` runs a node and records the FLOPs it added."""

    def __init__(self) -> None:
        self._counter = FlopCounterMode(display=False)
        self.per_node: dict[str, int] = {}

    def __enter__(self) -> "NodeFlopCounter":
        self._counter.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._counter.__exit__(kind, exc, tb)

    def measure(self, call: NodeCall) -> Any:
        before = self._counter.get_total_flops()
        if call.node.op == "call_module" or isinstance(call.node.target, torch._ops.HigherOrderOperator):
            # The counter's module tracker hooks every module call (a leaf's, a torch.cond's branches)
            # and fails on an argument that requires grad without a grad_fn (a view of a parameter
            # taken under no_grad, torch 2.13); the values are the same without.
            value = call.run(*tree_map_only(torch.Tensor, torch.Tensor.detach, (call.args, call.kwargs)))
            if value is NotImplemented:  # an operator the counter does not know (while_loop): uncounted
                with _disable_current_modes():
                    value = call.run()
        else:
            value = call.run()
        self.per_node[call.node.name] = int(self._counter.get_total_flops() - before)
        return value
