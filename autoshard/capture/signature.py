"""How the model was called on the example, and the thin module both front ends capture.

Every example argument becomes a named argument of the captured graph, in call order. Those that
hold tensors are graph inputs; the others (``None``, flags, ints, strings, configs) are constants
that the capture bakes in, and the graph checks that later calls pass the same values. A container
holding tensors keeps the layout and the non-tensor values it had (``capture.structure``).

Front ends capture a generated wrapper that holds the model as its child ``model`` and calls it
exactly as the example did. Capturing the model as a child rather than as the root is what lets
decorated forwards (transformers wraps every ``forward``) trace: tracers read the root's own
argument list, which a decorator hides.
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import keyword
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from autoshard.capture.host_random import host_draws
from autoshard.capture.guard import DimSpec, InputGuard
from autoshard.capture.structure import (
    CACHE_ADVICE, ArgumentStructure, CapturedCallable, check_visible_tensors, holds_tensors, plain_object,
    same_constant)
from autoshard.errors import ExampleInputsError, InvalidArgumentError, suggest
from autoshard.isolation import PLAIN_VALUES, cloned, isolated

#: The wrapper's attribute holding the model; stripped from every captured name.
MODEL_ATTR = "model"


@dataclass(frozen=True)
class CallArgument:
    """One argument of the example call."""

    name: str
    value: Any
    positional: bool

    @property
    def is_graph_input(self) -> bool:
        return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(self.value))


def forward_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature of ``model.forward`` (None when Python cannot tell it)."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _named_positional(signature: inspect.Signature | None) -> list[str]:
    params = signature.parameters.values() if signature is not None else ()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _positional_names(model: nn.Module, count: int) -> list[str]:
    """The names example arguments passed by position get: their parameters', ``arg{i}`` beyond."""
    named = _named_positional(forward_signature(model))
    return [named[i] if i < len(named) else f"arg{i}" for i in range(count)]


def argument_names(signature: inspect.Signature, bound: Mapping[str, Any]) -> dict[str, Any]:
    """A binding of ``signature`` (``BoundArguments.arguments``) by the names the capture gives
    the example's arguments: each parameter's own, the entries of ``**kwargs`` by their keys,
    extra positional ones ``arg{i}`` as ``_positional_names`` names them."""
    named: dict[str, Any] = {}
    positional = len(_named_positional(signature))
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"arg{positional + i}": item for i, item in enumerate(value)})
        else:
            named[name] = value
    return named


def bind_as_called(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``signature.bind(*args, **kwargs).arguments``, its refusal of a keyword the function does not take
    named as Python names it (``got an unexpected keyword argument 'inp'``, with a "did you mean"): ``bind``
    reports the argument it then misses first, which hides the typo."""
    try:
        return signature.bind(*args, **kwargs).arguments
    except TypeError:
        parameters = signature.parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            takes = [name for name, p in parameters.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
            for key in kwargs:
                if key not in takes:
                    raise TypeError(f"got an unexpected keyword argument {key!r}{suggest(key, takes)}") from None
        raise


def parameter_default(signature: inspect.Signature, name: str) -> Any:
    """Parameter ``name``'s default (``inspect.Parameter.empty``: none, or no such parameter)."""
    parameter = signature.parameters.get(name)
    return inspect.Parameter.empty if parameter is None else parameter.default


def is_default(signature: inspect.Signature, name: str, value: Any) -> bool:
    """Whether ``value`` is the default of parameter ``name``: the same object, or an equal plain
    number, flag or string (a tensor default never counts: its values could have changed)."""
    default = parameter_default(signature, name)
    if default is inspect.Parameter.empty:
        return False
    return value is default or (type(value) is type(default) and isinstance(value, PLAIN_VALUES) and value == default)


def _snapshots(constants: Mapping[str, Any]) -> dict[str, Any]:
    """Copies of the mutable constants that have an ``==`` (a config dataclass, a list of flags), or hold attributes
    ``same_constant`` compares (a plain settings object, a method bound to one)."""
    found: dict[str, Any] = {}
    for name, value in constants.items():
        if type(value) in (types.FunctionType, functools.partial):
            captured = CapturedCallable.of(value)
            if captured is not None:
                found[name] = captured
            continue
        if isinstance(value, PLAIN_VALUES) or (type(value).__eq__ is object.__eq__ and not plain_object(value)):
            continue
        try:
            found[name] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is compared by identity only
            continue
    return found


#: Values a forward cannot write to: a constant made only of these needs no probe run.
_IMMUTABLE = (*PLAIN_VALUES, bytes, complex, range, enum.Enum, torch.dtype, torch.device, torch.Size, torch.layout,
              torch.memory_format)
#: ``_copied``'s answer for an object ``copy.deepcopy`` refuses.
_UNCOPYABLE = object()


def _may_be_written(value: Any) -> bool:
    """Whether a constant is an object a forward could store tensors in (a list, a dict, a plain
    object; not a number, a flag, a dtype, a function or a module, whose state capture restores)."""
    if isinstance(value, (*_IMMUTABLE, type, nn.Module)) or callable(value):
        return False
    if isinstance(value, (tuple, frozenset)):
        return any(_may_be_written(v) for v in value)
    return True


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied cannot be probed
        return _UNCOPYABLE


def _check_name(name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
        raise InvalidArgumentError(
            f"example argument name {name!r} cannot name a graph input; pass it under a Python identifier")
    return name


@dataclass(frozen=True)
class CallSignature:
    """The example call: its arguments in order, each a graph input or a constant; ``defaults``,
    the defaults of the parameters it left out, which the plan computes with."""

    arguments: tuple[CallArgument, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> "CallSignature":
        names = _positional_names(model, len(args))
        arguments = [CallArgument(_check_name(n), v, True) for n, v in zip(names, args)]
        arguments += [CallArgument(_check_name(n), v, False) for n, v in kwargs.items()]
        for argument in arguments:
            check_visible_tensors(argument.name, argument.value)
        seen = [a.name for a in arguments]
        if len(set(seen)) != len(seen):
            raise InvalidArgumentError(f"example arguments name the same parameter twice: {seen}")
        forward = forward_signature(model)
        left_out = {} if forward is None else {
            name: p.default for name, p in forward.parameters.items()
            if name not in seen and p.default is not inspect.Parameter.empty}
        signature = cls(tuple(arguments), left_out)
        signature._check_constants_unwritten(model)
        return signature

    def _check_constants_unwritten(self, model: nn.Module) -> None:
        """Refuse a constant the model stores tensors in during the call (an empty list it appends to,
        a cache object of its own kind): a capture hands the user's object to the traced code, which
        would fill it with traced values, and the plan would fix its contents as of the example. The
        model is run once on copies of the arguments to find out, so the user's objects stay as they
        were; a model that fails there is left for the capture to report."""
        copies = {a.name: _copied(a.value) for a in self.arguments
                  if not a.is_graph_input and _may_be_written(a.value)}
        probed = {name: value for name, value in copies.items() if value is not _UNCOPYABLE}
        if not probed:
            return
        tensors = cloned([a.value if a.is_graph_input else None for a in self.arguments])
        values = [copy if a.is_graph_input else probed.get(a.name, a.value) for a, copy in zip(self.arguments, tensors)]
        args = [v for a, v in zip(self.arguments, values) if a.positional]
        kwargs = {a.name: v for a, v in zip(self.arguments, values) if not a.positional}
        try:
            with isolated(model), torch.no_grad(), host_draws():  # leaves the user's generators too
                model(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the capture runs the model too, and reports its failure
            return
        for name, value in probed.items():
            if holds_tensors(value):
                raise ExampleInputsError(
                    f"the model stores tensors in example argument {name} (a {type(value).__name__}) during the "
                    "call: it keeps state there from one call to the next, which a capture would fill with traced "
                    "values and fix as it was on the example, and a stage pipeline cannot carry such an object "
                    f"between stages or calls; leave {name} out, or pass what the model reads from it as tensors "
                    f"(for a Hugging Face generation cache: {CACHE_ADVICE})")

    @property
    def graph_inputs(self) -> tuple[CallArgument, ...]:
        return tuple(a for a in self.arguments if a.is_graph_input)

    @property
    def constants(self) -> dict[str, Any]:
        return {a.name: a.value for a in self.arguments if not a.is_graph_input}

    @property
    def containers(self) -> dict[str, ArgumentStructure]:
        """The graph inputs that are containers, with their layouts."""
        return {a.name: ArgumentStructure.of(a.value) for a in self.graph_inputs
                if not isinstance(a.value, torch.Tensor)}

    def guard(self, shapes: Mapping[str, tuple[DimSpec, ...]] | None = None, *, dtypes: bool = True,
              ranks: bool = False) -> InputGuard:
        """The check that later calls pass these constants, containers of this layout, and tensors of
        these dtypes (unless ``dtypes`` is false), shapes, and, with ``ranks``, each tensor's number of
        dimensions where ``shapes`` fixes none of its sizes; a tensor in a container is named by its
        path, ``d['x']``."""
        structures = self.containers
        tensors = self.tensors()
        kinds = {name: tensor.dtype for name, tensor in tensors.items()}
        fixed = {name: (DimSpec(),) * tensor.dim() for name, tensor in tensors.items()} if ranks else {}
        return InputGuard(tuple(a.name for a in self.arguments), tuple(a.name for a in self.graph_inputs),
                          self.constants, kinds if dtypes else {}, {**fixed, **(shapes or {})}, structures,
                          _snapshots(self.constants), default_snapshots=self.default_snapshots())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The example's tensor inputs by name, those in a container by their path (``d['x']``)."""
        structures = self.containers
        tensors = {a.name: a.value for a in self.graph_inputs if isinstance(a.value, torch.Tensor)}
        tensors.update({a.name + keystr(path): leaf for a in self.graph_inputs if a.name in structures
                        for path, leaf in tree_flatten_with_path(a.value)[0] if isinstance(leaf, torch.Tensor)})
        return tensors

    def default_snapshots(self) -> dict[str, tuple[Any, Any]]:
        """For each left-out parameter whose default is a mutable object with an ``==``: the default
        and a copy of it now, which the plan computes with."""
        plain = {name: value for name, value in self.defaults.items()
                 if _may_be_written(value) and not holds_tensors(value)}  # a tuple of ints cannot change
        return {name: (plain[name], copied) for name, copied in _snapshots(plain).items()
                if same_constant(plain[name], copied)}  # an ``==`` that fails on a copy cannot tell a change

    def wrapper(self, model: nn.Module, around: Callable[..., ContextManager[Any]] | None = None) -> nn.Module:
        """A module whose forward takes the graph inputs and calls ``model`` as the example did; inside
        ``around(**graph inputs)`` where given (``layout_reads.LayoutReads.watching``)."""
        params = ", ".join(["self", *(a.name for a in self.graph_inputs)])
        call = [a.name if a.is_graph_input else f"constants[{a.name!r}]" for a in self.arguments]
        passed = [c if a.positional else f"{a.name}={c}" for a, c in zip(self.arguments, call)]
        inputs = ", ".join(f"{a.name}={a.name}" for a in self.graph_inputs)
        source = (f"def forward({params}):\n"
                  f"    constants = self._autoshard_constants\n"
                  + (f"    with self._autoshard_around({inputs}):\n    " if around is not None else "")
                  + f"    return self.{MODEL_ATTR}({', '.join(passed)})\n")
        namespace: dict[str, Any] = {}
        exec(compile(source, f"<autoshard call of {type(model).__name__}>", "exec"), namespace)  # noqa: S102
        cls = type(f"{type(model).__name__}Call", (nn.Module,), {"forward": namespace["forward"]})
        wrapper = cls()
        setattr(wrapper, MODEL_ATTR, model)
        wrapper._autoshard_constants = self.constants
        wrapper._autoshard_around = around
        return wrapper
