"""Hooks gained since capture by a module the capture traced through: its stages would not run them.

The stages run a traced module's body, not its call, so a hook registered on it after sharding
(``model.h[3].register_forward_hook(record)``) would silently not run, and the outputs it changes
would differ from the model's. A module called whole (a leaf) runs its hooks, and forward hooks a
module traced with ``trace_hooks`` had at capture run from its hook dict on every call; the hook
dicts that were empty at capture must stay so. A hook gained raises ``SpecializationMismatch``, so
the model is captured again with it (traced through with its forward hooks run after the body, or
kept whole). Global hooks (``register_module_forward_hook``, which PyTorch's ``ModuleTracker`` and
``FlopCounterMode`` install to observe a call) are not checked: they run for every module called,
the stages themselves included, which a capture cannot make the model's.

Checking every dict on every call would cost a test per module. Every hook registration, of a
module's, a tensor's or a global one, takes a new id from ``RemovableHandle.next_id``, so the
first stage's kept check compares that one counter by identity (``counter_read``), and only a
moved counter makes it look at the dicts (``after_difference``; then it keeps the new counter and
checks its other reads again). A model or runtime whose call registers hooks (a module with full
backward hooks registers its tensors', FSDP its outputs') moves it on every call, and so looks at
the dicts on every call, never running the full check for it."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from autoshard.capture.held_state import HOOK_DICTS, Read, StayEmpty


class HooksAtCapture:
    """Which hook dicts of the modules a capture traced through were empty, and
    which of the modules whose code it runs (``run``; ``called`` whole, the others traced through)
    held hooks."""

    def __init__(self, run: Iterable[nn.Module] = (), called: Iterable[nn.Module] = ()) -> None:
        called_ids = set(map(id, called))
        pairs = [(module, name) for module in run for name in HOOK_DICTS]
        self.held = tuple((module, name) for module, name in pairs if vars(module).get(name))
        #: the dicts of the modules traced through that are to stay empty
        self.empty = StayEmpty((module, vars(module), name) for module, name in pairs if id(module) not in called_ids)

    def gained(self) -> tuple[nn.Module, str] | None:
        """A module and the kind of hook it holds now where it held none at capture; None if none does."""
        gained = self.empty.gained()
        return None if gained is None else (gained[0], HOOK_DICTS[gained[1]])

    def held_unlike(self, other: HooksAtCapture) -> tuple[tuple[nn.Module, str], ...]:
        """The modules and kinds of hook this capture's held and ``other``'s did not."""
        theirs = {(id(module), name) for module, name in other.held}
        return tuple((module, HOOK_DICTS[name]) for module, name in self.held if (id(module), name) not in theirs)

    def counter_read(self) -> tuple[list[Read], list[Any]]:
        """The read of the hook id counter a passing check makes (``StayEmpty.counter_read``)."""
        return self.empty.counter_read()

    def after_difference(self, full: Callable[[Any], Any], again: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """What a check that read the counter runs on a difference (``StayEmpty.after_difference``)."""
        return self.empty.after_difference(full, again)
