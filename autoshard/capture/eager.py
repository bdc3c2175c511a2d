"""Capture's own runs of the user's model: an attribute patched while capturing, and the check
that the model runs on its example at all.

Both leave the model as it was, through ``autoshard.isolation`` (``isolated``, ``cloned``), which
the cost modules and verify share.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from autoshard.errors import ExampleInputsError
from autoshard.isolation import called_on_copies, detached_values, isolated


@contextlib.contextmanager
def swapped_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` until exit (a function or method patched while capturing), set in
    ``owner``'s own ``__dict__`` and put back there as it was: the original is read from that dict, so
    a classmethod such as ``torch.autograd.Function.apply`` comes back as itself, not bound to
    ``owner``; where it had none of its own (a module's ``forward`` found on its class, a class's
    inherited ``__getattribute__``) the patch is removed, so nothing of the capture's is left on it."""
    own = vars(owner).get(name, _NONE)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _NONE:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


_NONE = object()


def check_model_runs(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The model's output on its example; ``ExampleInputsError`` if the model fails there too: then
    no capture or pass is to blame, and the model's own error is the one to show. Run without grad,
    as it is cheaper, and again with it where that failed: code that registers a tensor hook in the
    forward runs only with grad."""
    try:
        with isolated(model), torch.no_grad():
            return called_on_copies(model, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises is reported as it is
        if torch.is_grad_enabled():
            try:
                with isolated(model):
                    return detached_values(called_on_copies(model, args, kwargs))
            except Exception:  # noqa: BLE001 - the first error is the one to show
                pass
        raise ExampleInputsError(
            f"{type(model).__name__} itself raises on the example inputs ({type(exc).__name__}: {exc}); "
            "give inputs it runs on: model(*example_args, **example_kwargs) must work") from exc
