"""Small torch.fx helpers shared by capture, costs, lowering and emit: low enough for any layer.

Kept out of ``lowering.from_fx`` (which imports the cost modules) so that the modules it builds
on can use them without an import cycle.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn


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
