"""A module, parameter or buffer that a stage calls or reads, rebound in the model after sharding: the
stage refuses.

A stage holds the model's modules and the parameters and buffers its code reads as they were at
sharding. One assigned anew in the model (``model.lm_head = nn.Linear(...)``, ``norm.weight =
nn.Parameter(...)``, ``load_state_dict(sd, assign=True)`` of a weight or buffer the capture traced
through, ``model.half()``, which puts a new tensor in place of each floating buffer), or a container on the
way to it, is not what the stage calls: it would go on computing with the old one, silently. PyTorch's
global registration hook reports every module assigned, so watching the modules costs a call nothing: a
stage whose model rebinds a module on one of its paths refuses its calls from then on
(``HeldState.refuse``); writes from autoshard's own code (a capture's stand-ins, put back after) are
none, and ``model._modules[name] = m`` (torch.ao's conversions) is seen by the first stage's check
(``sharded.StateAtCapture``). A tensor is put in place without the hooks (``_apply`` writes ``_buffers``
as a dict), so the stage reads each parameter and buffer its code reads from its owner in the model on
every call (``HeldState.hold_model_tensor``: one identity test a tensor). A parameter or buffer inside a
module the stage calls whole is read from that module on every call (a cache it replaces, too), so it
is not watched.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Iterable

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from autoshard.capture.held_state import HeldState, assigned_anew

#: container -> attribute name -> the watching stages' states -> what it held at sharding, all weakly
#: (a state gone drops out by itself; one watching a step of many paths is there once).
_WATCHED: weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.WeakKeyDictionary[HeldState, weakref.ref]]] = (
    weakref.WeakKeyDictionary())
_HOOKS: list[Any] = []


def watch(model: nn.Module, state: HeldState, paths: Iterable[str]) -> None:
    """Have ``state`` refuse once the model rebinds a step of one of ``paths`` (the modules a stage
    calls, the parameters and buffers its code reads; from the model, dotted)."""
    if not _HOOKS:
        _HOOKS.append(register_module_module_registration_hook(_on_registration))
    for path in paths:
        owner: Any = model
        for name in path.split("."):
            registry = next((found for found in (owner._modules, owner._parameters, owner._buffers) if name in found),
                            None)
            if registry is None or registry[name] is None:
                break  # a path of the capture's own making
            if registry is not owner._modules:
                state.hold_model_tensor(registry, name, owner)
                break
            _WATCHED.setdefault(owner, {}).setdefault(name, weakref.WeakKeyDictionary())[state] = (
                weakref.ref(registry[name]))
            owner = registry[name]


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    watchers = _WATCHED.get(module, {}).get(name)
    if not watchers or _written_by_autoshard():
        return
    for watching, held in list(watchers.items()):
        if held() is not value:
            watching.refuse(assigned_anew(module, name, value))


def _written_by_autoshard() -> bool:
    """Whether the assignment comes from autoshard's own code (past ``torch.nn``'s frames)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch."):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("autoshard.")
