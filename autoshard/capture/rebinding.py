"""A module, parameter or buffer that a stage calls or reads, rebound in the model after sharding: the
stage refuses.

A stage holds the model's modules and the parameters and buffers its code reads as they were at
sharding. One assigned anew in the model (``model.lm_head = nn.Linear(...)``, ``norm.weight =
nn.Parameter(...)``, ``load_state_dict(sd, assign=True)`` of a weight or buffer the capture traced
through), or a container on the way to it, is not what the stage calls: it would go on computing with
the old one, silently. PyTorch's global registration hooks report every such assignment, so watching
costs a call nothing: a stage whose model rebinds one of its paths refuses its calls from then on
(``HeldState.refuse``). A parameter or buffer inside a module the stage calls whole is read from that
module on every call (a cache it replaces, too), so it is not watched. Writes from autoshard's own
code (a capture's stand-ins, put back after) are no rebinding; ``model._modules[name] = m``, which
bypasses the hooks, is not seen.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Iterable

from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook, register_module_module_registration_hook,
    register_module_parameter_registration_hook)

from autoshard.capture.held_state import HeldState

#: container -> attribute name -> the watching stages' states -> what it held at sharding, all weakly
#: (a state gone drops out by itself; one watching a step of many paths is there once).
_WATCHED: weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.WeakKeyDictionary[HeldState, weakref.ref]]] = (
    weakref.WeakKeyDictionary())
_HOOKS: list[Any] = []


def watch(model: nn.Module, state: HeldState, paths: Iterable[str]) -> None:
    """Have ``state`` refuse once the model rebinds a step of one of ``paths`` (the modules a stage
    calls, the parameters and buffers its code reads; from the model, dotted)."""
    if not _HOOKS:
        _HOOKS.extend(register(_on_registration) for register in (
            register_module_module_registration_hook, register_module_parameter_registration_hook,
            register_module_buffer_registration_hook))
    for path in paths:
        owner: Any = model
        for name in path.split("."):
            found = next((registry[name] for registry in (owner._modules, owner._parameters, owner._buffers)
                          if name in registry), None)
            if found is None:
                break  # a path of the capture's own making
            _WATCHED.setdefault(owner, {}).setdefault(name, weakref.WeakKeyDictionary())[state] = weakref.ref(found)
            if not isinstance(found, nn.Module):
                break
            owner = found


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    watchers = _WATCHED.get(module, {}).get(name)
    if not watchers or _written_by_autoshard():
        return
    for watching, held in list(watchers.items()):
        if held() is not value:
            watching.refuse(assigned_anew(module, name, value))


def assigned_anew(owner: nn.Module, name: str, value: Any) -> str:
    """The refusal of a call after ``owner.name`` was assigned ``value`` in the model after sharding."""
    return (f"the model's {type(owner).__name__}.{name} was assigned anew after sharding ({name} = "
            f"{type(value).__name__}), but the stage computes with the one it was sharded with; shard the model "
            "again after such a change (an update in place, load_state_dict(sd) or an optimizer step, is seen)")


def _written_by_autoshard() -> bool:
    """Whether the assignment comes from autoshard's own code (past ``torch.nn``'s frames)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch."):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("autoshard.")
