"""Small torch.fx helpers shared by capture, costs, lowering and emit: low enough for any layer.

Kept out of ``lowering.from_fx`` (which imports the cost modules) so that the modules it builds
on can use them without an import cycle.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch import nn


#: Attributes and methods that read only a tensor's shape (``w.shape``, ``w.size(0)``, ``w.dim()``):
#: what a parameter or buffer keeps as long as it is that object (a conversion changes its dtype
#: and device, never its shape; assigning another one is refused by the rebinding watch).
SHAPE_ATTRIBUTES = frozenset({"shape", "ndim"})
SHAPE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})
#: What else a read of a tensor's metadata alone reads: the same for the tensor's zero-element
#: carrier (``lowering.shape_carriers``), though not for a weight a conversion may change.
METADATA_ATTRIBUTES = SHAPE_ATTRIBUTES | {"dtype", "device"}


def shape_read(node: fx.Node, attributes: frozenset[str] = SHAPE_ATTRIBUTES) -> bool:
    """Whether ``node`` reads only the shape of its first argument, every other argument a constant:
    ``getattr(w, "shape")``, ``w.size(1)``, ``w.dim()``, ``w.numel()``. Such a read of a weight uses
    none of its values: it is no reason for a stage to hold the weight. ``attributes``: those read
    as the shape is (``metadata_read``)."""
    if node.op == "call_function" and node.target is getattr:
        reads_shape = len(node.args) == 2 and node.args[1] in attributes
    else:
        reads_shape = node.op == "call_method" and node.target in SHAPE_METHODS
    return reads_shape and bool(node.args) and isinstance(node.args[0], fx.Node) and len(node.all_input_nodes) == 1


def metadata_read(node: fx.Node) -> bool:
    """Whether ``node`` reads only its first argument's shape, dtype or device (``x.device``, ``x.size(-1)``)."""
    return shape_read(node, METADATA_ATTRIBUTES)


def resolve(root: Any, target: str) -> Any:
    """The object at a dotted attribute path (``root`` itself for the empty path)."""
    value = root
    for part in target.split(".") if target else ():
        value = getattr(value, part)
    return value


def target_name(node: fx.Node) -> str:
    """A node's target by name (``module.qualname``), the same in every process: never its repr,
    which for an object without a qualified name (a higher-order op such as ``cond``) holds its address."""
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__qualname__
    return f"{module}.{name}".lstrip(".")


def canonical_tensor_names(root: nn.Module) -> dict[int, str]:
    """One name per parameter/buffer object: its first qualified name (tied weights share it)."""
    names: dict[int, str] = {}
    for name, tensor in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


#: Python's in-place operators, as fx records ``x += y`` and ``x[i] = y``.
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
})


def writes_in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into its first input, by what it calls: a method or torch function
    named with a trailing underscore (``y.copy_(x)``, ``torch.relu_``), an in-place operator
    (``+=``, ``x[i] = y``), ``inplace=True``, a module with ``inplace`` set, an aten operator whose
    schema writes its first argument (export)."""
    target: Any = node.target
    if node.op == "call_method":
        return isinstance(target, str) and target.endswith("_") and not target.startswith("_")
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(target), "inplace", False))
    if node.op != "call_function":
        return False
    if target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return True
    schema = getattr(target, "_schema", None)  # an aten operator (export): its schema says
    if schema is not None:
        return bool(schema.arguments) and schema.arguments[0].alias_info is not None \
            and schema.arguments[0].alias_info.is_write
    name = getattr(target, "__name__", "")
    return getattr(target, "__module__", "") == "torch" and name.endswith("_") and not name.startswith("_")


#: The top-level packages whose code a graph calls that is no model's code (``runs_model_code``).
_LIBRARY_PACKAGES = frozenset({"torch", "builtins", "_operator", "operator", "math", "autoshard"})


def runs_model_code(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` calls the model's own code kept whole (a module or function the capture did not trace
    through), whose effects on what it is given neither its name nor a run's version counters show: it may
    rebind a tensor's ``.data`` (new sizes), or call ``F.batch_norm`` on a buffer (whose kernel moves no
    version counter)."""
    if node.op == "call_module":
        code = type(gm.get_submodule(str(node.target))).__module__
    elif node.op == "call_function":
        code = getattr(node.target, "__module__", None) or ""
    else:
        return False
    return code.split(".")[0] not in _LIBRARY_PACKAGES
