"""Resolve a CLI TARGET: a built-in example name or ``package.module:factory``."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from autoshard.errors import AutoshardError, InvalidArgumentError, InvalidArgumentTypeError
from autoshard.examples import EXAMPLES, Example, load_example


class TargetError(AutoshardError):
    """A TARGET could not be imported or its factory failed."""


def _call_factory(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise InvalidArgumentError(
            f"TARGET {target!r} is neither a built-in example ({', '.join(sorted(EXAMPLES))}) "
            "nor of the form package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - report any import failure the same way
        raise TargetError(f"cannot import {module_name!r} from TARGET {target!r}: {type(exc).__name__}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise TargetError(f"module {module_name!r} has no attribute {attr!r} (TARGET {target!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TargetError(f"{target!r} is not callable; point TARGET at a function that returns the model")
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
        raise TargetError(f"the factory {target!r} failed: {type(exc).__name__}: {exc}") from exc


def load_target(target: str) -> Example:
    """Return ``(model, example_args, example_kwargs)`` for a TARGET."""
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
        f"the factory {target!r} returned {type(made).__name__}; return a model, (model, example_args) "
        "or (model, example_args, example_kwargs)")
