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
import inspect
import keyword
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autoshard.capture.eager import PLAIN_VALUES
from autoshard.capture.guard import DimSpec, InputGuard
from autoshard.capture.structure import ArgumentStructure, check_visible_tensors
from autoshard.errors import InvalidArgumentError

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


def _snapshots(constants: Mapping[str, Any]) -> dict[str, Any]:
    """Copies of the mutable constants that have an ``==`` (a config dataclass, a list of flags)."""
    found = {}
    for name, value in constants.items():
        if isinstance(value, PLAIN_VALUES) or type(value).__eq__ is object.__eq__:
            continue
        try:
            found[name] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is compared by identity only
            continue
    return found


def _check_name(name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
        raise InvalidArgumentError(
            f"example argument name {name!r} cannot name a graph input; pass it under a Python identifier")
    return name


@dataclass(frozen=True)
class CallSignature:
    """The example call: its arguments in order, each a graph input or a constant."""

    arguments: tuple[CallArgument, ...]

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
        return cls(tuple(arguments))

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

    def guard(self, shapes: Mapping[str, tuple[DimSpec, ...]] | None = None, *, dtypes: bool = True) -> InputGuard:
        """The check that later calls pass these constants, containers of this layout, and tensors of
        these dtypes (unless ``dtypes`` is false) and shapes; a tensor in a container is named by its
        path, ``d['x']``."""
        structures = self.containers
        kinds = {a.name: a.value.dtype for a in self.graph_inputs if isinstance(a.value, torch.Tensor)}
        kinds.update({name + path: dtype for name, structure in structures.items()
                      for path, dtype in zip(structure.paths, structure.leaves) if isinstance(dtype, torch.dtype)})
        return InputGuard(tuple(a.name for a in self.arguments), tuple(a.name for a in self.graph_inputs),
                          self.constants, kinds if dtypes else {}, dict(shapes or {}), structures,
                          _snapshots(self.constants))

    def wrapper(self, model: nn.Module) -> nn.Module:
        """A module whose forward takes the graph inputs and calls ``model`` as the example did."""
        params = ", ".join(["self", *(a.name for a in self.graph_inputs)])
        call = [a.name if a.is_graph_input else f"constants[{a.name!r}]" for a in self.arguments]
        passed = [c if a.positional else f"{a.name}={c}" for a, c in zip(self.arguments, call)]
        source = (f"def forward({params}):\n"
                  f"    constants = self._autoshard_constants\n"
                  f"    return self.{MODEL_ATTR}({', '.join(passed)})\n")
        namespace: dict[str, Any] = {}
        exec(compile(source, f"<autoshard call of {type(model).__name__}>", "exec"), namespace)  # noqa: S102
        cls = type(f"{type(model).__name__}Call", (nn.Module,), {"forward": namespace["forward"]})
        wrapper = cls()
        setattr(wrapper, MODEL_ATTR, model)
        wrapper._autoshard_constants = self.constants
        return wrapper
