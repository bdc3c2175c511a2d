"""The layout of a container argument (a list, tuple, dict or NamedTuple holding tensors).

A capture takes such an argument as one graph input and fixes what it saw in it: how many
elements and which keys (torch.export reads the tensors by position), the dtype of each tensor
(code may branch on it), and every value in it that is not a tensor (a flag, a size, None), which
neither front end follows. ``ArgumentStructure`` records that, names what a later call changes,
and rebuilds a dict passed with its keys in another order in the order captured.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, keystr, tree_flatten_with_path, tree_leaves, tree_unflatten

from autoshard.capture.eager import holds
from autoshard.errors import ExampleInputsError

#: Containers whose keys make their layout, in whatever order they come.
_KEYED = (dict, OrderedDict)


def _layout(spec: TreeSpec) -> Any:
    """``spec`` as a comparable value in which the order of a dict's keys does not count."""
    if spec.is_leaf():
        return None
    children = [_layout(child) for child in spec.children()]
    if spec.type in _KEYED:
        return spec.type, tuple(sorted(zip(map(repr, spec.context), children)))
    return spec.type, spec.context, tuple(children)


def same_constant(value: Any, expected: Any) -> bool:
    """Whether a call's ``value`` is the constant the capture fixed: the same object, or an equal
    one of the same type."""
    if value is expected:
        return True
    if type(value) is not type(expected):
        return False
    try:
        return bool(value == expected)
    except Exception:  # noqa: BLE001 - an object without a usable == is only equal to itself
        return False


def _kind(leaf: Any) -> str:
    return f"a {str(leaf.dtype).removeprefix('torch.')} tensor" if isinstance(leaf, torch.Tensor) else repr(leaf)


@dataclass(frozen=True)
class ArgumentStructure:
    """A container argument as captured: its layout, each leaf's path, and what each leaf was (a
    tensor's dtype, or the value of anything else)."""

    spec: TreeSpec
    paths: tuple[str, ...]
    leaves: tuple[Any, ...]

    @classmethod
    def of(cls, value: Any) -> "ArgumentStructure":
        flat, spec = tree_flatten_with_path(value)
        return cls(spec, tuple(keystr(path) for path, _ in flat),
                   tuple(leaf.dtype if isinstance(leaf, torch.Tensor) else leaf for _, leaf in flat))

    def problem(self, name: str, value: Any) -> str | None:
        """What ``value`` changes that the capture fixed, or None."""
        flat, spec = tree_flatten_with_path(value)
        if _layout(spec) != _layout(self.spec):
            entries = [keystr(p) for p, _ in flat]
            if sorted(entries) == sorted(self.paths):
                return (f"{name} holds the same entries as when the plan was captured, in other containers (a "
                        f"{type(value).__name__} at the top, then a "
                        f"{getattr(self.spec.type, '__name__', self.spec.type)}); "
                        "container types are fixed")
            return (f"{name} holds {', '.join(name + e for e in entries) or 'nothing'}, but the plan was "
                    f"captured with {', '.join(name + p for p in self.paths) or 'nothing'} "
                    "(lengths and keys are fixed)")
        got = {keystr(path): leaf for path, leaf in flat}
        for path, captured in zip(self.paths, self.leaves):
            leaf = got[path]
            if isinstance(captured, torch.dtype):
                if not isinstance(leaf, torch.Tensor) or leaf.dtype != captured:
                    return f"{name}{path} is {_kind(leaf)}, but the plan was captured with a {captured} tensor there"
            elif isinstance(leaf, torch.Tensor) or not same_constant(leaf, captured):
                return (f"{name}{path} is {_kind(leaf)}, but the plan was captured with {captured!r} there, "
                        "which it computes with")
        return None

    def arranged(self, value: Any) -> Any:
        """``value`` with its dicts' keys in the captured order (the graph may read by position)."""
        flat, spec = tree_flatten_with_path(value)
        if spec == self.spec:
            return value
        got = {keystr(path): leaf for path, leaf in flat}
        return tree_unflatten([got[path] for path in self.paths], self.spec)

    def leaf_values(self, name: str, value: Any) -> dict[str, Any]:
        """Each leaf of ``value`` under its full name (``d['x']``)."""
        return {name + keystr(path): leaf for path, leaf in tree_flatten_with_path(value)[0]}


def _holds_in_attributes(value: Any) -> bool:
    """A plain object (not a module, class or function) keeping tensors in its attributes."""
    if isinstance(value, (torch.nn.Module, type)) or callable(value) or not hasattr(value, "__dict__"):
        return False
    return holds(vars(value), torch.Tensor)


def check_visible_tensors(name: str, value: Any) -> None:
    """Refuse an argument holding tensors where torch's pytree does not look (a dataclass, a
    ``UserDict`` such as Hugging Face's ``BatchEncoding``, a plain object's attributes): the capture
    would take them for constants of the example, refusing other tensors and computing with the
    example's."""
    for leaf in tree_leaves(value):
        if not isinstance(leaf, torch.Tensor) and (holds(leaf, torch.Tensor) or _holds_in_attributes(leaf)):
            raise ExampleInputsError(
                f"example argument {name} holds tensors inside a {type(leaf).__name__}, which torch's pytree does not "
                "look into, so the plan could only fix them as they are; pass them as arguments (model(**enc) for "
                "a BatchEncoding), in a dict, tuple or NamedTuple, or register the type with "
                "torch.utils._pytree.register_dataclass / register_pytree_node")
