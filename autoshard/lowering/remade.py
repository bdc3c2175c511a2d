"""Values each stage that reads them makes again instead of receiving: weightless values of the model's inputs.

A decoder builds its attention mask before its first layer, a ``(batch, 1, sequence, sequence)`` tensor, from
its input's size (or its padding mask), and every layer reads it. Sent, it crossed every boundary beside the
hidden states: at 4,096 tokens and width 4,096 in bf16, half their bytes. Such a value reads no weight, draws
no random number and nothing writes into it, so a stage that reads it can compute it again from what it was
computed from: the model's inputs, sizes (``shape_carriers``) and constants. Where those are fewer bytes than
the value, they cross instead (``from_fx.route_around``) and emit copies the value's code into each stage
that reads it (``emit._stage_graph``), as it does for a size. A rotary embedding's cosines and sines are made
again the same way from its inverse frequencies, a buffer nothing writes: the few bytes read from it cross.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.fx_helpers import writes_in_place
from autoshard.lowering.inplace import written_values
from autoshard.lowering.randomness import TORCH_MODULES, draws_random


def remakeable(gm: fx.GraphModule) -> set[str]:
    """The nodes of ``gm`` a stage may run again, by name: a torch operation (not a module, not a function
    kept whole, not one of autoshard's own checks) that draws no random number and whose memory, and that
    of what it reads, nothing writes into (made again later, it would read the write). Whether one is made
    again depends on what it is computed from (``from_fx.route_around``)."""
    written = written_values(gm)
    return {node.name for node in gm.graph.nodes
            if _is_torch_operation(node)
            and not written.intersection({node.name, *(n.name for n in node.all_input_nodes)})
            and not writes_in_place(gm, node) and not draws_random(gm, node)}


def _is_torch_operation(node: fx.Node) -> bool:
    """A tensor's method (one writing in place is left out by the caller), an operator, a torch function, or
    an aten operator that writes none of its arguments (torch.export's)."""
    if node.op == "call_method":
        return True
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable
    objclass = getattr(target, "__objclass__", None)  # ``torch.Tensor.expand`` called as a function
    if isinstance(objclass, type) and issubclass(objclass, torch._C.TensorBase):
        return True
    module = getattr(target, "__module__", None)
    return module == "_operator" or module in TORCH_MODULES
