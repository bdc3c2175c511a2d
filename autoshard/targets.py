"""Resolve a CLI TARGET: a built-in example name or ``package.module:factory``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from autoshard.capture.signature import forward_signature
from autoshard.errors import AutoshardError, InvalidArgumentError, InvalidArgumentTypeError, first_few, suggest
from autoshard.examples import EXAMPLES, Example, load_example


class TargetError(AutoshardError):
    """A TARGET could not be imported or its factory failed."""


#: What a factory TARGET returns to give example inputs, and all it may return; the help, the
#: refusals and the advice say it alike.
FACTORY_WITH_INPUTS = "(model, args) or (model, args, kwargs)"
FACTORY_RETURNS = f"a model, {FACTORY_WITH_INPUTS}"


def _import_from_cwd(module_name: str) -> Any:
    """Import as ``python -m`` would: the ``autoshard`` script alone does not see the current directory."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


def _refuse_a_file_path(module_name: str, attr: str) -> None:
    """``models.py:build``, ``src/models:build`` or ``models.py`` is a file path, which an import cannot
    read (it failed with "'models' is not a package"): say which module name to write instead, and,
    where no factory was named, that one is needed."""
    if not module_name.endswith(".py") and "/" not in module_name and os.sep not in module_name:
        return
    folder, _, stem = module_name.removesuffix(".py").replace(os.sep, "/").rpartition("/")
    where = f", with {folder!r} as the current directory or on PYTHONPATH" if folder not in ("", ".") else ""
    named = f"{module_name}:{attr}" if attr else module_name
    factory = f" (FACTORY: the function in it that returns {FACTORY_RETURNS})" if not attr else ""
    raise TargetError(f"TARGET {named} names a file, but TARGET is a module to import "
                      f"(package.module:factory): give {stem}:{attr or 'FACTORY'}{where}{factory}")


def _callables_defined(holder: Any, names: Sequence[str]) -> str:
    """`` (it defines: cnn, mlp)``: what a factory could be where no name is close to the one given, the
    functions and classes ``holder`` (a module) defines itself, not those it imports."""
    own = [name for name in names if callable(getattr(holder, name))
           and getattr(getattr(holder, name), "__module__", None) == getattr(holder, "__name__", "")]
    return f" (it defines: {first_few(own, 8)})" if own else ""


def _call_factory(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    _refuse_a_file_path(module_name, attr)
    if not module_name or not attr:
        raise TargetError(
            f"TARGET {target!r} is neither a built-in example{suggest(target, EXAMPLES)} "
            f"({', '.join(sorted(EXAMPLES))}) nor of the form package.module:factory")
    try:
        module = _import_from_cwd(module_name)
    except Exception as exc:  # noqa: BLE001 - report any import failure the same way
        raise TargetError(
            f"cannot import {module_name!r} from TARGET {target!r}: {type(exc).__name__}: {exc}. "
            "The module must be importable from the current directory or PYTHONPATH") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            names = [name for name in dir(factory) if not name.startswith("_")]
            close = suggest(part, names) or _callables_defined(factory, names)
            raise TargetError(f"module {module_name!r} has no attribute {attr!r}{close} (TARGET {target!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TargetError(f"{target!r} is not callable; point TARGET at a function that returns the model")
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
        raise TargetError(f"the factory {target!r} failed: {type(exc).__name__}: {exc}") from exc


def load_target(target: str) -> Example:
    """Return ``(model, example_args, example_kwargs)`` for a TARGET (no inputs: ``()`` and ``{}``)."""
    if target in EXAMPLES:
        return load_example(target)
    made = _call_factory(target)
    if isinstance(made, nn.Module):
        return made, (), {}
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        args = made[1] if isinstance(made[1], (tuple, list)) else (made[1],)
        kwargs = made[2] if len(made) == 3 else {}
        if not isinstance(kwargs, dict):
            raise InvalidArgumentTypeError(f"the factory {target!r} returned example kwargs that are not a dict")
        return made[0], tuple(args), kwargs
    raise InvalidArgumentTypeError(
        f"the factory {target!r} returned {type(made).__name__}; return {FACTORY_RETURNS}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    return type(value).__name__


def check_inputs_bind(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Fail before tracing when the example inputs could not be passed to ``model.forward``.

    Tracing or verifying with inputs that do not fit fails deep inside torch; binding them to the
    signature first names the mismatch and the signature.
    """
    signature = forward_signature(model)
    if signature is None:  # a forward without a readable signature: let tracing decide
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        given = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
        raise InvalidArgumentError(
            f"the example inputs do not match {type(model).__name__}.forward{signature}: {exc} "
            f"(given: {', '.join(given) or 'nothing'}); make the factory return inputs that forward accepts"
        ) from None
