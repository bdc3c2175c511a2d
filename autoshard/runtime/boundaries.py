"""Refuse plans whose stage boundaries carry something other than tensors.

``torch.distributed.pipelining`` sends tensors only. A boundary value known to be something else
(an int from ``x.size(0)``, a shape, a tuple used whole) must be caught on every
rank before the first send, or the receiving rank waits forever. What a value is comes from the
plan's metadata when shapes were propagated (the DAG's ``value_meta`` or ``tensor=False``, or
the fx node's ``val``/``tensor_meta``/``type``), else from the operation that makes it: size and
shape queries, ``len`` and arithmetic on such results are never tensors. Values nothing is known
about pass. The model's own output, which the last stage hands to ``loss_fn``, is held to the same
rule (see ``wire.OutputTensors``), as far as the plan's metadata describes it.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autoshard.costs.values import ConstantMeta, StructureMeta, ValueMeta
from autoshard.errors import BoundaryValueError, shown
from autoshard.runtime.wire import Wire, value_meta, wire_layout
from autoshard.sharded import ShardedModel

#: Tensor methods whose result is never a tensor.
_NON_TENSOR_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "item", "tolist", "stride",
    "is_contiguous", "is_floating_point", "is_complex", "__len__", "get_device", "storage_offset",
})
#: Tensor attributes whose value is never a tensor.
_NON_TENSOR_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"})
_OPERATORS = frozenset(f for f in vars(operator).values() if callable(f) and not isinstance(f, type))


def _describe_structure(meta: Any) -> str:
    """``"tensor"`` for a plain tensor's metadata, else what the value is (a tuple, an int 3)."""
    if hasattr(meta, "shape") and hasattr(meta, "dtype"):
        return "tensor"
    if hasattr(meta, "type_name"):
        return f"{meta.type_name} {meta}"
    return f"{getattr(meta, 'kind', type(meta).__name__)} {meta}"


def _from_metadata(node: fx.Node, dag_attrs: dict[str, Any]) -> str | None:
    if dag_attrs.get("value_meta") is not None:  # shapes were propagated: the value's structure
        return _describe_structure(dag_attrs["value_meta"])
    if dag_attrs.get("tensor") is False:
        return "a non-tensor value"
    for key in ("val", "example_value"):
        if key in node.meta:
            value = node.meta[key]
            return "tensor" if isinstance(value, torch.Tensor) else shown(value)
    if node.meta.get("tensor_meta") is not None:
        return "tensor" if not isinstance(node.meta["tensor_meta"], (tuple, list, dict)) else "a container"
    kind = node.meta.get("type")
    if isinstance(kind, type):
        return "tensor" if issubclass(kind, torch.Tensor) else kind.__name__
    return None


def _from_operation(node: fx.Node) -> str | None:
    """``"int or shape"`` when the op can only make a non-tensor, else None (unknown)."""
    if node.op == "call_method" and node.target in _NON_TENSOR_METHODS:
        return f"the result of .{node.target}()"
    if node.op == "call_function" and node.target is builtins.len:
        return "the result of len()"
    if node.op == "call_function" and node.target is builtins.getattr and node.args[1:2] and \
            node.args[1] in _NON_TENSOR_ATTRIBUTES:
        return f"the .{node.args[1]} attribute"
    if node.op == "call_function" and node.target in _OPERATORS:
        sources = node.all_input_nodes
        if sources and all(_from_operation(source) for source in sources):
            return f"{getattr(node.target, '__name__', node.target)} of sizes"
    return None


def _producers(sharded: ShardedModel) -> dict[str, fx.Node]:
    """Each value's first node in stage order: where it is made (later stages only receive it)."""
    found: dict[str, fx.Node] = {}
    for stage in sharded.stages:
        for node in stage.graph.nodes:
            if node.op != "output":
                found.setdefault(node.name, node)
    return found


def value_kind(sharded: ShardedModel, name: str, producers: dict[str, fx.Node] | None = None) -> str | None:
    """``"tensor"``, a description of a non-tensor value, or None when nothing is known."""
    node = (producers or _producers(sharded))[name]
    dag = sharded.plan.dag
    return _from_metadata(node, dict(dag.nodes[name]) if name in dag else {}) or _from_operation(node)


def _item_kind(sharded: ShardedModel, wire: Wire) -> str | None:
    meta = value_meta(sharded, wire.name)
    items = getattr(meta, "items", ())
    return _describe_structure(items[wire.index]) if wire.index < len(items) else None


def _non_tensor_leaves(meta: ValueMeta | None) -> list[ConstantMeta]:
    """The leaves of a described value that are neither tensors nor ``None`` (the stage drops those)."""
    if isinstance(meta, StructureMeta):
        return [leaf for item in meta.items for leaf in _non_tensor_leaves(item)]
    return [meta] if isinstance(meta, ConstantMeta) and meta.type_name != "NoneType" else []


def _output_problems(sharded: ShardedModel) -> list[str]:
    """What the model returns that is known not to be a tensor (the last stage must return tensors)."""
    output = next(node for node in sharded.stages[-1].graph.nodes if node.op == "output")
    problems = []
    for leaf in tree_leaves(output.args[0]):  # fx argument structures are pytrees of nodes
        if leaf is None:  # the last stage drops it
            continue
        if not isinstance(leaf, fx.Node):
            problems.append(f"the constant {leaf!r}")
            continue
        meta = value_meta(sharded, leaf.name)
        problems += [f"'{leaf.name}' holding {c.type_name} {c}" for c in _non_tensor_leaves(meta)]
    return problems


def boundary_wires(sharded: ShardedModel) -> list[list[Wire]]:
    """The tensors each boundary sends (see ``wire``); ``BoundaryValueError`` naming every one
    known not to be a tensor."""
    producers = _producers(sharded)
    names = dict.fromkeys(name for boundary in sharded.plan.boundaries for name in boundary)
    kinds = {name: value_kind(sharded, name, producers) for name in names}
    layout = wire_layout(sharded, {name: kind == "tensor" for name, kind in kinds.items()})
    problems = []
    for index, wires in enumerate(layout):
        for wire in wires:
            kind = kinds[wire.name] if wire.index is None else _item_kind(sharded, wire)
            if kind is not None and kind != "tensor":
                problems.append(f"'{wire}' ({kind}) from stage {index} to stage {index + 1}")
    if problems:
        raise BoundaryValueError(
            "torch.distributed.pipelining sends only tensors between stages, but the plan sends "
            + "; ".join(problems)
            + ". A tuple or list of tensors crosses as its items; sizes are recomputed where they are "
            "used once shapes are known (shard with example_inputs). Otherwise compute such a value from "
            "a tensor inside the stage that needs it, or return tensors from the code that makes it")
    returned = _output_problems(sharded)
    if returned:
        raise BoundaryValueError(
            "a pipeline's last stage may return only tensors (PyTorch hands them to loss_fn), but the "
            "model returns " + "; ".join(returned) + ". Make the model return tensors only (for "
            "Hugging Face models: use_cache=False), or wrap it in a module that does")
    return layout
