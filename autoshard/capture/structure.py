"""The layout of a container argument (a list, tuple, dict or NamedTuple holding tensors).

A capture takes such an argument as one graph input and fixes what it saw in it: how many
elements and which keys (torch.export reads the tensors by position), the dtype of each tensor
(code may branch on it), and every value in it that is not a tensor (a flag, a size, None), which
neither front end follows. ``ArgumentStructure`` records that, names what a later call changes,
and rebuilds a dict passed with its keys in another order in the order captured.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch.utils._pytree import (
    TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_unflatten)

from autoshard.errors import ExampleInputsError
from autoshard.isolation import PLAIN_VALUES, contents

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

    def layout_problem(self, name: str, value: Any) -> str | None:
        """What ``value`` changes that the capture fixed and a capture made with it would serve (its
        layout, a value that is no tensor, a tensor where there was none or none where there was
        one), or None."""
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
                if not isinstance(leaf, torch.Tensor):
                    return f"{name}{path} is {_kind(leaf)}, but the plan was captured with a {captured} tensor there"
            elif isinstance(leaf, torch.Tensor) or not same_constant(leaf, captured):
                return (f"{name}{path} is {_kind(leaf)}, but the plan was captured with {captured!r} there, "
                        "which it computes with")
        return None

    def dtype_problem(self, name: str, leaves: Mapping[str, Any]) -> str | None:
        """A tensor of another dtype than the capture's among ``leaves`` (``leaf_values`` of a value
        with the captured layout: ``layout_problem`` found none), or None."""
        for path, captured in zip(self.paths, self.leaves):
            leaf = leaves[name + path]
            if isinstance(captured, torch.dtype) and leaf.dtype != captured:
                return f"{name}{path} is {_kind(leaf)}, but the plan was captured with a {captured} tensor there"
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as a value of the layout with numbered leaves, flattened again where it is loaded:
        loading a pickled ``TreeSpec`` warns in torch 2.13 (a ``FutureWarning`` about ``LeafSpec``),
        once in every process a plan was sent to, and ``treespec_dumps`` names neither a namedtuple
        nor a dict keyed by tuples or dtypes."""
        try:
            shell = tree_unflatten(list(range(self.spec.num_leaves)), self.spec)
        except Exception:  # noqa: BLE001 - a node type that checks its leaves: the TreeSpec itself, which warns
            return ArgumentStructure, (self.spec, self.paths, self.leaves)
        return _rebuilt, (shell, self.paths, self.leaves)

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


def _rebuilt(shell: Any, paths: tuple[str, ...], leaves: tuple[Any, ...]) -> ArgumentStructure:
    return ArgumentStructure(tree_flatten(shell)[1], paths, leaves)


def _children(value: Any) -> Iterable[Any]:
    """What ``value`` holds where a tensor may hide: what ``contents`` finds (a container's items, a
    dataclass's fields, a slice's bounds), else a plain object's attributes (not a module's, a
    class's or a function's)."""
    if isinstance(value, (tuple, list, set, frozenset, Mapping, slice)) or dataclasses.is_dataclass(value):
        return contents(value)
    if isinstance(value, (torch.nn.Module, type)) or callable(value) or not hasattr(value, "__dict__"):
        return ()
    return vars(value).values()


def holds_tensors(value: Any) -> bool:
    """Whether a tensor hides anywhere in ``value``, however deep in plain objects' attributes (a
    ``DynamicCache`` keeps them in ``cache.layers[i].keys``)."""
    seen: set[int] = set()
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            return True
        if isinstance(item, PLAIN_VALUES) or id(item) in seen:
            continue
        seen.add(id(item))
        pending.extend(_children(item))
    return False


def is_generation_cache(value: Any) -> bool:
    """A Hugging Face generation cache (``DynamicCache``, ``EncoderDecoderCache``, any subclass of
    ``transformers.cache_utils.Cache``), told by its class without importing transformers."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


#: What to do about a generation cache (reused wherever one turns up).
CACHE_ADVICE = "leave it out and call the model with use_cache=False"


def check_visible_tensors(name: str, value: Any) -> None:
    """Refuse a generation cache (the model writes each call's keys and values into it), and an
    argument holding tensors where torch's pytree does not look (a dataclass, a ``UserDict`` such as
    Hugging Face's ``BatchEncoding``, a plain object's attributes, however deep): the capture would
    take them for constants of the example, refusing other tensors and computing with the example's.
    Both are refused before anything runs, so the capture cannot leave traced values in them."""
    for leaf in tree_leaves(value):
        if is_generation_cache(leaf):
            raise ExampleInputsError(
                f"example argument {name} is a {type(leaf).__name__}, a generation cache: the model writes each "
                "call's keys and values into it, so capturing would fix its contents as constants of the "
                "example, and a stage pipeline cannot carry a cache object between stages or from one call to "
                f"the next; {CACHE_ADVICE} (the sharded model then computes the whole sequence on every call)")
        if not isinstance(leaf, torch.Tensor) and holds_tensors(leaf):
            raise ExampleInputsError(
                f"example argument {name} holds tensors inside a {type(leaf).__name__}, which torch's pytree does not "
                "look into, so the plan could only fix them as they are; pass them as arguments (model(**enc) for "
                "a BatchEncoding), in a dict, tuple or NamedTuple, or register the type with "
                "torch.utils._pytree.register_dataclass / register_pytree_node")
