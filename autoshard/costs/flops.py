"""FLOPs per graph node, counted by ``torch.utils.flop_counter`` while the graph runs.

One ``FlopCounterMode`` counts each node while it runs, so the per-node numbers sum exactly
to what the counter would see for the whole graph. A leaf
module (``call_module``) runs whole under the counter, so everything inside it is counted. The
counter works on real, fake and meta tensors alike: it reads shapes, not values.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from autoshard.costs.execution import NodeCall

#: Kernels the counter has no formula for, each counted as its twin (same leading arguments). On
#: the CPU, ``scaled_dot_product_attention`` runs the first (torch 2.13): uncounted, attention would
#: cost nothing in a plan made with real tensors and its full count in one made on the meta device.
_TWINS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
}


class _GlobalOnly:
    """The counter's module tracker, tracking no module: every count goes to ``"Global"``, the total each
    node is charged the change of. torch's ``ModuleTracker`` hooks the gradients of every module input
    that requires grad (``register_multi_grad_hook``, mode ``"all"``); the training probe runs nodes
    with gradients under the open counter, and ``autograd.grad`` over a module's leaf inputs (the
    weights a parametrization is handed) then failed in that hook, leaving the node's backward
    unprobed (weight-normed Linears 0.735x), and the hooks' closures outlived the run."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _OpCountingFlopCounterMode(FlopCounterMode):
    """torch's counter, also counting the kernels it runs (``ops``, after decompositions): how many
    operators a node dispatches, which is what running it on fake tensors costs (``TrainingProbe``).
    ``_count_flops`` is the counter's one call per kernel (torch 2.13); it has no public hook."""

    ops = 0

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        self.ops += 1
        return super()._count_flops(func_packet, out, args, kwargs)


def flop_counter_mode() -> FlopCounterMode:
    """torch's counter, with a formula for the kernels it misses (unless this torch has its own).
    The registry holds each formula wrapped to take shapes; the counter wraps what it is given."""
    registry = flop_counter.flop_registry
    missing = {op: inspect.unwrap(registry[twin]) for op, twin in _TWINS.items() if op not in registry}
    counter = _OpCountingFlopCounterMode(display=False, custom_mapping=missing)
    counter.mod_tracker = _GlobalOnly()
    return counter


class NodeFlopCounter:
    """``measure(call)`` runs a node under torch's counter and records the FLOPs it performed, and
    the kernels it ran (``ops_per_node``).

    The counter is open only while a node runs: the code between nodes (shape propagation's
    bookkeeping, the training probe) then dispatches through no Python mode. Open for the whole
    run, every tensor that code made (a generator's state, read after each node) went through the
    counter's Python dispatch: on a 12-layer GPT-2 the state reads took 0.21-0.26 s of shape
    propagation's ~1.9 s, 0.05-0.07 s now, against 0.05-0.08 s more for entering the counter per node."""

    def __init__(self) -> None:
        self._counter = flop_counter_mode()
        self.per_node: dict[str, int] = {}
        self.ops_per_node: dict[str, int] = {}

    def measure(self, call: NodeCall) -> Any:
        self._counter.ops = 0
        with self._counter:  # entering clears its counts: what it holds after is this node's
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
        self.per_node[call.node.name] = int(self._counter.get_total_flops())
        self.ops_per_node[call.node.name] = self._counter.ops
        return value
