"""Hooks changed since capture on a module the capture traced through: its stages would not run them.

The stages run a traced module's body, not its call, so a hook registered on it after sharding
(``model.h[3].register_forward_hook(record)``) would silently not run, and the outputs it changes
would differ from the model's; one it held at capture may be traced into the graph (by torch.export,
or a pre-hook of the model itself), which would go on running it once removed. A module called whole
(a leaf) runs its hooks. So the hook dicts of the modules traced through must stay as they were:
empty, or holding the same hooks. A change raises ``SpecializationMismatch``, so the model is
captured again as it is now (traced through with its forward hooks run after the body, or kept
whole); a specialisation made before serves the hooks it was made with again. Forward hooks run
after the body are read at each call, so that plan serves any forward hooks of the module, or none
(a feature extractor registering a hook of its own making before each call, removing it after). Global hooks
(``register_module_forward_hook``, which PyTorch's ``ModuleTracker`` and ``FlopCounterMode`` install
to observe a call) are not checked: they run for every module called, the stages themselves
included, which a capture cannot make the model's.

Checking every dict on every call would cost a test per module. Every hook registration, of a
module's, a tensor's or a global one, takes a new id from ``RemovableHandle.next_id``, so the first
stage's kept check compares that one counter by identity (``counter_read``) and each dict that held
hooks with a copy of it (a removal takes no id), and only a moved counter makes it look at the dicts
(``after_difference``; then it keeps the new counter and checks its other reads again). A model or
runtime whose call registers hooks (a module with full backward hooks registers its tensors', FSDP
its outputs') moves it on every call, and so looks at the dicts on every call, never running the
full check for it."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from autoshard.capture.held_state import HOOK_DICTS, Read, StayAsCaptured


class HooksAtCapture:
    """Which hook dicts of the modules a capture traced through were empty, and
    which of the modules whose code it runs (``run``; ``called`` whole, the others traced through)
    held hooks. ``hooks_run``: the modules traced through whose forward hooks the graph runs after
    their body as they are at each call (``run_forward_hooks``), which any hook serves, or none."""

    def __init__(self, run: Iterable[nn.Module] = (), called: Iterable[nn.Module] = (),
                 hooks_run: Iterable[nn.Module] = ()) -> None:
        called_ids, live = set(map(id, called)), set(map(id, hooks_run))
        run = tuple(run)
        #: the modules whose code the graph holds traced (the model itself, a block)
        self.traced_through = tuple(module for module in run if id(module) not in called_ids)
        #: those and the containers between them and the modules the graph calls (a ``ModuleList`` a loop
        #: iterated): whose submodules the traced code reached
        self.reaching = _reaching(self.traced_through, {id(module) for module in run})
        #: the modules the graph calls whole
        self.called = tuple(module for module in run if id(module) in called_ids)
        pairs = [(module, name) for module in run for name in HOOK_DICTS]
        self.held = tuple((module, name) for module, name in pairs if vars(module).get(name))
        #: the dicts of the modules traced through, to stay empty or hold the hooks the graph ran
        self.traced = StayAsCaptured(((module, vars(module), name) for module, name in pairs
                                      if id(module) not in called_ids
                                      and not (name == "_forward_hooks" and id(module) in live)), keep_held=True)

    def changed(self) -> tuple[nn.Module, str, bool] | None:
        """A module, the kind of hook it holds now other than at capture, and whether it held any then
        (False: one gained; True: one removed, replaced or added); None if none does."""
        changed = self.traced.changed()
        if changed is None:
            return None
        module, name = changed
        return module, HOOK_DICTS[name], any(m is module and n == name for m, n in self.held)

    def held_unlike(self, other: HooksAtCapture) -> tuple[tuple[nn.Module, str], ...]:
        """The modules and kinds of hook this capture's held and ``other``'s did not."""
        theirs = {(id(module), name) for module, name in other.held}
        return tuple((module, HOOK_DICTS[name]) for module, name in self.held if (id(module), name) not in theirs)

    def counter_read(self) -> tuple[list[Read], list[Any]]:
        """The reads a passing check makes (``StayAsCaptured.counter_read``)."""
        return self.traced.counter_read()

    def dict_reads(self) -> tuple[list[Read], list[Any]]:
        """The hook dicts watched, as reads, and what each is to find (``StayAsCaptured.dict_reads``)."""
        return self.traced.dict_reads()

    def after_difference(self, full: Callable[[Any], Any], again: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """What a check that read the counter runs on a difference (``StayAsCaptured.after_difference``)."""
        return self.traced.after_difference(full, again)


def _reaching(traced: tuple[nn.Module, ...], run: set[int]) -> tuple[nn.Module, ...]:
    """``traced``, and the submodules of theirs whose code does not run (``run``: ids of those that do),
    theirs in turn: the containers the traced code went through or iterated."""
    found, pending = list(traced), list(traced)
    seen = {id(module) for module in traced}
    while pending:
        for child in pending.pop()._modules.values():
            if child is not None and id(child) not in run and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
                pending.append(child)
    return tuple(found)
