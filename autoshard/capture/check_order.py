"""Run each check a capture left in the graph as early as what it reads allows.

The tracer records a check (``check_condition``: a branch on ``x.shape[0] > 4``) where the model's
code branched, which may be late in the forward: after the split, in a later stage. A call the check
refuses has then run the stages before it, and in training mode those stages updated their
batch-norm statistics, so the call cannot be run again on another plan (``specialize.rerun_of``);
and the input the check reads crossed every boundary up to it, for the check alone. Moved to just
after the last tensor its condition is computed from (the model's input, here), the check runs in
the first stage, before anything computes; the sizes it reads are the same there, since no node in
between writes that tensor.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard.capture.guard import CHECK_SITE_ARGUMENT
from autoshard.costs.facts import node_facts
from autoshard.fx_helpers import writes_in_place
from autoshard.lowering.from_fx import holds_tensor

#: Functions computing a value that is not a tensor from others without side effects (a size's arithmetic,
#: comparisons, reading ``x.shape``): a check's condition may be computed anywhere after its operands.
_PURE_FUNCTIONS = frozenset({
    operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.xor, operator.not_,
    operator.truth, operator.contains, getattr, len, int, float, bool, min, max, abs, math.ceil, math.floor,
    torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not,
})
#: Tensor methods reading metadata only.
_PURE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "is_contiguous",
                           "is_floating_point", "element_size"})


def _pure_non_tensor(node: fx.Node) -> bool:
    """Whether ``node`` computes a value that is not a tensor, and does nothing else."""
    if holds_tensor(node) is not False:
        return False
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):  # torch.export's ``aten.sym_size.int``
        return not node.target._schema.is_mutable
    return node.target in _PURE_FUNCTIONS


def _condition_and_operands(check: fx.Node, position: dict[fx.Node, int]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes computing ``check``'s condition that are pure and hold no tensor, in graph order, and the
    nodes they (and the check) read: the tensors, inputs and other values the condition starts from."""
    computing: dict[fx.Node, None] = {}
    operands: dict[fx.Node, None] = {}
    pending = list(check.all_input_nodes)
    while pending:
        node = pending.pop()
        if node in computing or node in operands:
            continue
        if _pure_non_tensor(node):
            computing[node] = None
            pending.extend(node.all_input_nodes)
        else:
            operands[node] = None
    return sorted(computing, key=position.__getitem__), list(operands)


def _writes(gm: fx.GraphModule, node: fx.Node, operands: list[fx.Node]) -> bool:
    """Whether ``node`` may write in place (so change the sizes of) one of ``operands``: by what it calls
    (``h.unsqueeze_(0)``), or as the example's run saw it (a module kept whole writing its input)."""
    if node.args and node.args[0] in operands and writes_in_place(gm, node):
        return True
    facts = node_facts(node)
    return facts is not None and any(operand.name in facts.written_inputs for operand in operands)


def hoist_checks(gm: fx.GraphModule) -> None:
    """Move each of ``gm``'s checks (``CHECK_SITE_ARGUMENT``), with the nodes computing its condition, to
    just after the last of the placeholders, the condition's operands and the nodes that write one of them
    in place. Needs ``shape-prop``'s facts: a node not known to hold no tensor is an operand, as is a value
    computed otherwise than by ``_PURE_FUNCTIONS`` and ``_PURE_METHODS``, so without them nothing moves."""
    graph = gm.graph
    for check in [n for n in graph.nodes if n.op == "call_function" and n.target in CHECK_SITE_ARGUMENT]:
        position = {node: i for i, node in enumerate(graph.nodes)}
        computing, operands = _condition_and_operands(check, position)
        after = None
        for node in graph.nodes:
            if node is check:
                break
            if node.op == "placeholder" or node in operands or _writes(gm, node, operands):
                after = node
        if after is None:
            continue
        for node in [node for node in (*computing, check) if position[node] > position[after]]:
            after.append(node)
            after = node
    graph.lint()
