"""The layout of a container argument (a list, tuple, dict or NamedTuple holding tensors).

A capture takes such an argument as one graph input and fixes what it saw in it: how many
elements and which keys (torch.export reads the tensors by position), the dtype of each tensor
(code may branch on it), and every value in it that is not a tensor (a flag, a size, None), which
neither front end follows. ``ArgumentStructure`` records that and names what a later call changes
(a dict's keys in another order too: the model's code may read them in order).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import types
from collections import OrderedDict, abc
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import torch
from torch.utils._pytree import (
    SUPPORTED_NODES, TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_unflatten)

from autoshard.errors import ExampleInputsError, brief
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


def _leaves_in_layout(value: Any, spec: TreeSpec, leaves: list[Any]) -> bool:
    """Add ``value``'s leaves to ``leaves`` where it is laid out as ``spec`` exactly (what
    ``tree_flatten`` gives when ``_same_spec`` holds), reading only the dicts, lists and tuples calls
    pass, without building a spec to compare (a call's guard, a third of its time). False where it
    meets another container (a namedtuple, a type registered with pytree): flatten it then."""
    kind = spec.type
    if kind is None:
        leaves.append(value)
        return not (type(value) in SUPPORTED_NODES or isinstance(value, tuple))
    if type(value) is not kind:
        return False
    if kind is dict:
        keys = spec.context
        if list(value) != keys:
            return False
        for key, then in zip(value, keys):
            if type(key) is not type(then):  # 1 == 1.0 == True
                return False
        items: Iterable[Any] = value.values()
    elif kind is list or kind is tuple:
        if len(value) != spec.num_children:
            return False
        items = value
    else:
        return False
    for item, child in zip(items, spec.children()):
        if not _leaves_in_layout(item, child, leaves):
            return False
    return True


def _same_spec(spec: TreeSpec, captured: TreeSpec) -> bool:
    """Whether ``spec`` is ``captured`` exactly: the same container types (the same classes), keys
    equal and of the same repr in the same order, as many items, all the way down; its leaves then
    come in the captured order. Stricter than ``TreeSpec.__eq__``, which compares the types' names."""
    return spec is captured or (
        spec.type is captured.type and spec.num_children == captured.num_children
        and spec.context == captured.context and repr(spec.context) == repr(captured.context)
        and all(map(_same_spec, spec.children(), captured.children())))


#: A shape given as a ``torch.Size`` or a tuple: the same constant to torch's functions.
_SHAPES = {tuple, torch.Size}


def same_constant(value: Any, expected: Any) -> bool:
    """Whether a call's ``value`` is the constant the capture fixed: the same object, or an equal
    one of the same type, a ``torch.Size`` and a tuple alike (a numpy array: the same shape, dtype and
    items; a zero: of the same sign;
    nan: nan; a tuple, list or dict: item by item; a function: the same code, globals, defaults and
    closed-over values; a ``functools.partial``: the same function and arguments; a bound method: the same
    function, bound to an object like the one expected; an object with no ``==`` of its own: its attributes)."""
    if value is expected:
        return True
    if type(expected) is CapturedCallable:
        return expected.computes_as(value)
    if {type(value), type(expected)} <= _SHAPES:  # torch's pytree rebuilds a Size as a tuple (a copy of the inputs)
        return len(value) == len(expected) and all(map(same_constant, value, expected))
    if type(value) is not type(expected) or isinstance(expected, torch.Tensor):  # a tensor: the one the graph holds
        return False
    if isinstance(expected, np.ndarray):  # (its == compares item by item)
        return (value.shape, value.dtype) == (expected.shape, expected.dtype) and np.array_equal(
            value, expected, equal_nan=expected.dtype.kind in "fc")
    if isinstance(expected, (float, np.floating)) and expected == 0.0:  # -0.0 == 0.0, but 1 / x tells them apart
        return value == expected and math.copysign(1.0, value) == math.copysign(1.0, expected)
    if isinstance(expected, (float, np.floating)) and math.isnan(expected):  # nan != nan, but computes as nan
        return math.isnan(value)
    if type(expected) in (tuple, list):  # item by item, so that their zeros and nans are told as above
        return len(value) == len(expected) and all(map(same_constant, value, expected))
    if type(expected) is dict:
        return list(value) == list(expected) and all(map(same_constant, value.values(), expected.values()))
    if type(expected) in (types.FunctionType, functools.partial):  # made anew for each call: the same code, values
        held = _callable_values(expected)
        return _same_code(value, expected) and _frozen(held) and same_constant(_callable_values(value), held)
    if type(expected) is types.MethodType:  # (its ``==`` compares the objects bound by identity)
        return value.__func__ is expected.__func__ and same_constant(value.__self__, expected.__self__)
    if plain_object(expected):  # (its ``==`` is identity): what it holds
        return _same_attributes(value, expected)
    try:
        return bool(value == expected)
    except Exception:  # noqa: BLE001 - an object without a usable == is only equal to itself
        return False


@dataclass(frozen=True)
class CapturedCallable:
    """A function or ``functools.partial`` as a capture met it: what it computed with then (its closure's values,
    defaults, a partial's arguments), deep-copied, so that the same object changed since (a closed-over list
    changed in place, a ``nonlocal`` rebound) is told apart (``same_constant``)."""

    function: Any
    values: Any

    @staticmethod
    def of(function: Any) -> CapturedCallable | None:
        """``function`` as it is now (``copied``: the containers among its values copied); None where it computes
        with nothing but its code (no closure, defaults or arguments)."""
        values = _callable_values(function)
        return CapturedCallable(function, copied(values)) if any(values) else None

    def computes_as(self, value: Any) -> bool:
        """Whether ``value`` computes as the function did at capture: the same code (a partial: function) and
        globals, with values like those it held then."""
        return (type(value) is type(self.function) and _same_code(value, self.function)
                and same_constant(_callable_values(value), self.values))

    def __repr__(self) -> str:
        return repr(self.function)


def _same_code(value: Any, expected: Any) -> bool:
    """Whether ``value``, a function or partial of ``expected``'s type, runs ``expected``'s code: the same code and
    globals (a partial: the same function)."""
    if type(expected) is functools.partial:
        return value.func is expected.func
    return value.__code__ is expected.__code__ and value.__globals__ is expected.__globals__


def _callable_values(function: Any) -> tuple[Any, ...]:
    """What a function (``_function_values``) or partial (its arguments) computes with besides its code."""
    if type(function) is functools.partial:
        return function.args, tuple(function.keywords.items())
    return _function_values(function)


#: The containers whose items a check compares (a mapping's keys and values).
SEQUENCES = (tuple, list, collections.deque, abc.Set, abc.MutableSequence)


def copied(value: Any) -> Any:
    """``value`` as read, to tell later whether it changed in place: where it holds something that changes
    so (a list, dict, set, deque, mapping or array, at any depth), a deep copy of it, of its own classes,
    sharing every other item with it; else ``value`` itself, and also where no equal copy can be made (a
    class of its own making)."""
    if not _changes_in_place(value):
        return value
    kept = {id(item): item for item in _items(value)}  # (``deepcopy``'s memo: these are not copied)
    try:
        copy = deepcopy(value, kept)
    except Exception:  # noqa: BLE001 - a class that cannot be copied: watched by identity alone
        return value
    return copy if same_constant(copy, value) else value


def _items(value: Any) -> Iterator[Any]:
    """The items of the containers ``value`` is or holds, at any depth (a mapping's keys and values)."""
    for item in (value if isinstance(value, SEQUENCES) else [*value, *value.values()]
                 if isinstance(value, abc.Mapping) else ()):
        if isinstance(item, (*SEQUENCES, abc.Mapping)):
            yield from _items(item)
        elif not isinstance(item, np.ndarray):
            yield item


def _changes_in_place(value: Any) -> bool:
    """Whether ``value`` is or holds a container that changes in place (not a tuple or frozenset), or an array."""
    if isinstance(value, (tuple, frozenset)):
        return any(map(_changes_in_place, value))
    return isinstance(value, (*SEQUENCES, abc.Mapping, np.ndarray))


def plain_object(value: Any) -> bool:
    """Whether ``value`` is an object of a class of the user's with no ``==`` of its own, holding attributes
    (a settings object, a helper the forward calls): not a module, tensor, class, function or module of code."""
    return type(value).__eq__ is object.__eq__ and hasattr(value, "__dict__") and not isinstance(
        value, (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, functools.partial))


#: The pairs of objects ``_same_attributes`` is comparing, by id: one met again (an object holding itself) is
#: compared there already.
_COMPARING: set[tuple[int, int]] = set()


def _same_attributes(value: Any, expected: Any) -> bool:
    pair = (id(value), id(expected))
    if pair in _COMPARING:
        return True
    _COMPARING.add(pair)
    try:
        return same_constant(vars(value), vars(expected))
    finally:
        _COMPARING.discard(pair)


def _function_values(function: types.FunctionType) -> tuple[Any, ...]:
    """What ``function`` computes with besides its code and globals: its defaults, keyword defaults and
    the values its closure holds now (a cell not yet filled: a marker of its own)."""
    values = []
    for cell in function.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            values.append(_EMPTY_CELL)
    return function.__defaults__, tuple((function.__kwdefaults__ or {}).items()), tuple(values)


_EMPTY_CELL = object()


def _frozen(value: Any) -> bool:
    """Whether ``value`` cannot change in place: plain values, dtypes, devices, built-in functions and
    classes, and tuples and dicts of them. What a function made anew closes over must be so to be
    compared by value: a dict it shares with the captured one may have changed since (and a Python
    function there, itself perhaps, is compared by identity only)."""
    if type(value) is tuple:
        return all(map(_frozen, value))
    return value is None or value is _EMPTY_CELL or isinstance(value, (
        *PLAIN_VALUES, bytes, torch.dtype, torch.device, types.BuiltinFunctionType, type))


def _kind(leaf: Any) -> str:
    return f"a {str(leaf.dtype).removeprefix('torch.')} tensor" if isinstance(leaf, torch.Tensor) else brief(leaf)


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

    def flattened(self, name: str, value: Any) -> Flattened:
        """``value`` (argument ``name`` of a call) flattened once for all of the call's checks: its
        leaves in the captured order, or what its layout changes that the capture fixed and a capture
        made with it would serve (its lengths, keys, their order, container types). A value of the
        captured layout (the same containers, compared by ``_same_spec``) is read as it comes; any
        other is flattened again with its paths, to name what differs. A dict's keys in another order
        differ: the model's code may read them in order (``d.values()``), which the capture fixed."""
        leaves: list[Any] = []
        if _leaves_in_layout(value, self.spec, leaves):
            return Flattened(leaves)
        leaves, spec = tree_flatten(value)
        if _same_spec(spec, self.spec):
            return Flattened(leaves)
        flat, spec = tree_flatten_with_path(value)
        entries = [keystr(path) for path, _ in flat]
        if _layout(spec) == _layout(self.spec):
            if entries == list(self.paths):
                return Flattened([leaf for _, leaf in flat])
            return Flattened([], (
                f"{name} holds its entries in another order ({', '.join(name + e for e in entries)}) than when the "
                f"plan was captured ({', '.join(name + p for p in self.paths)}), and the model's code may read a "
                "dict in its order (d.values(), a loop), which the capture fixed"))
        if sorted(entries) == sorted(self.paths):
            return Flattened([], (
                f"{name} holds the same entries as when the plan was captured, in other containers (a "
                f"{type(value).__name__} at the top, then a {getattr(self.spec.type, '__name__', self.spec.type)}); "
                "container types are fixed"))
        return Flattened([], (
            f"{name} holds {', '.join(name + e for e in entries) or 'nothing'}, but the plan was captured with "
            f"{', '.join(name + p for p in self.paths) or 'nothing'} (lengths and keys are fixed)"))

    def layout_problem(self, name: str, flat: Flattened) -> str | None:
        """What argument ``name`` (``flat``, as ``flattened`` read it) changes that the capture fixed
        and a capture made with it would serve (its layout, a value that is no tensor, a tensor where
        there was none or none where there was one), or None."""
        if flat.problem is not None:
            return flat.problem
        for path, captured, leaf in zip(self.paths, self.leaves, flat.leaves):
            if isinstance(captured, torch.dtype):
                if not isinstance(leaf, torch.Tensor):
                    return f"{name}{path} is {_kind(leaf)}, but the plan was captured with a {captured} tensor there"
            elif isinstance(leaf, torch.Tensor) or not same_constant(leaf, captured):
                return (f"{name}{path} is {_kind(leaf)}, but the plan was captured with {brief(captured)} there, "
                        "which it computes with")
        return None

    def dtype_problem(self, name: str, leaves: list[Any]) -> str | None:
        """A tensor of another dtype than the capture's among ``leaves`` (``Flattened.leaves`` of a
        value with the captured layout: ``layout_problem`` found none), or None."""
        for path, captured, leaf in zip(self.paths, self.leaves, leaves):
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

    def leaf_values(self, name: str, leaves: list[Any]) -> dict[str, Any]:
        """Each of ``leaves`` (``Flattened.leaves``) under its full name (``d['x']``)."""
        return {name + path: leaf for path, leaf in zip(self.paths, leaves)}


class Flattened(NamedTuple):
    """A container argument of one call as ``ArgumentStructure.flattened`` read it."""

    #: its leaves in the order of the captured paths (none where its layout differs)
    leaves: list[Any]
    #: what its layout changes, where it differs from the captured one
    problem: str | None = None


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
                f"argument {name} is a {type(leaf).__name__}, a generation cache: the model writes each "
                "call's keys and values into it, so capturing would fix its contents as constants of the "
                "example, and a stage pipeline cannot carry a cache object between stages or from one call to "
                f"the next; {CACHE_ADVICE} (the sharded model then computes the whole sequence on every call)")
        if not isinstance(leaf, torch.Tensor) and holds_tensors(leaf):
            raise ExampleInputsError(
                f"argument {name} holds tensors inside a {type(leaf).__name__}, which torch's pytree does not "
                "look into, so the plan could only fix them as they are; pass them as arguments (model(**enc) for "
                "a BatchEncoding), in a dict, tuple or NamedTuple, or register the type with "
                "torch.utils._pytree.register_dataclass / register_pytree_node")
