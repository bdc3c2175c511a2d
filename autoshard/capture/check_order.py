"""Run each check a capture left in the graph as early as what it reads allows.

The tracer records a check (``check_condition``: a branch on ``x.shape[0] > 4``) where the model's
code branched, which may be late in the forward: after the split, in a later stage. A call the check
refuses has then run the stages before it, and in training mode those stages updated their
batch-norm statistics, so the call cannot be run again on another plan (``specialize.rerun_of``);
and the input the check reads crossed every boundary up to it, for the check alone. Moved to just
after the last tensor its condition is computed from (the model's input, here), the check runs in
the first stage, before anything computes; the sizes it reads are the same there, since no node in
between writes that tensor (or one sharing its memory: a view of it, or the tensor itself under another
node, ``h.contiguous()``).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard.capture.guard import CHECK_SITE_ARGUMENT
from autoshard.fx_helpers import runs_model_code
from autoshard.lowering.from_fx import holds_tensor
from autoshard.lowering.inplace import memory_root, written_inputs

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
#: torch.export's operators reading a tensor's metadata only. Not every operator that returns no tensor and
#: writes nothing: ``aten.item`` reads the data, which a write through a view of the tensor may change after
#: the tensor's own node (moved before that write, the value and everything computed from it would differ).
_PURE_OPERATORS = frozenset({
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
})


def _pure_non_tensor(node: fx.Node) -> bool:
    """Whether ``node`` computes a value that is not a tensor, and does nothing else."""
    if holds_tensor(node) is not False:
        return False
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    if node.op != "call_function":
        return False
    return node.target in _PURE_FUNCTIONS or node.target in _PURE_OPERATORS


def condition_and_operands(check: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes computing ``check``'s condition that are pure and hold no tensor, and the nodes they (and
    the check) read: the tensors, inputs and other values the condition starts from."""
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
    return list(computing), list(operands)


class _Writes:
    """Which tensors each node of ``gm`` may write in place (so change the sizes of), by the memory they are
    (``inplace.memory_root``: ``g = h.contiguous()`` is ``h``, so ``g.unsqueeze_(0)`` changes ``h``'s sizes):
    by what it calls or as the example's run saw it (a module kept whole writing its input, or a tensor of a
    list it is given), or any it is given where it is the model's own code kept whole. Found once per graph,
    not once per check (a 12-layer GPT-2's hoisting: 20 ms, then 10 ms)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.root = {node: memory_root(gm, node) for node in gm.graph.nodes}
        self.written = {node: {self.root[w] for w in written_inputs(gm, node)} for node in gm.graph.nodes}
        self.given = {node: {self.root[g] for g in node.all_input_nodes} for node in gm.graph.nodes
                      if runs_model_code(gm, node)}

    def any_of(self, node: fx.Node, roots: set[fx.Node]) -> bool:
        """Whether ``node`` may write a tensor whose memory is one of ``roots``."""
        return not (self.written[node].isdisjoint(roots) and self.given.get(node, set()).isdisjoint(roots))


def hoist_checks(gm: fx.GraphModule) -> None:
    """Move each of ``gm``'s checks (``CHECK_SITE_ARGUMENT``), with the nodes computing its condition, to
    just after the last of the placeholders, the condition's operands and the nodes that may write one of
    them (or a tensor sharing its memory) in place. Needs ``shape-prop``'s facts: a node not known to hold no
    tensor is an operand, as is a value computed otherwise than by ``_PURE_FUNCTIONS``, ``_PURE_METHODS``
    and ``_PURE_OPERATORS``, so without them nothing moves."""
    graph = gm.graph
    checks = [n for n in graph.nodes if n.op == "call_function" and n.target in CHECK_SITE_ARGUMENT]
    if not checks:
        return
    writes = _Writes(gm)
    for check in checks:
        computing, operands = condition_and_operands(check)
        computed, roots = set(computing), {writes.root[operand] for operand in operands}
        # back from the check to the last node it must follow, picking up the condition's nodes on the way: a
        # walk as long as the distance the check moves, not the graph's length (once per check: quadratic)
        moved, after = [check], check.prev
        while after.op != "root" and not (
                after.op == "placeholder" or after in operands or writes.any_of(after, roots)):
            if after in computed:
                moved.append(after)
            after = after.prev
        if after.op == "root":
            continue
        for node in reversed(moved):
            after.append(node)
            after = node
    graph.lint()
