"""PyTorch's ``MemTracker``, as autoshard's probes and measurements use it.

In a module of their own, imported where a probe or a measurement runs: importing
``torch.distributed._tools`` pulls in torch's compiler stack (2-3 s here), which commands that
plan nothing (``autoshard inspect plan.json``, ``--help``, a process that runs saved stages) need
not pay.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker

#: What each of ``MemTracker``'s kinds of storage is, in a measurement's parts.
PART_OF = {
    _MemRefType.PARAM: "weights", _MemRefType.BUFFER: "weights", _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations", _MemRefType.OTH: "received",
    _MemRefType.TEMP: "temporaries",
}


def _total(snapshot: Any) -> int:
    """All bytes of a ``MemTracker`` snapshot, every device."""
    return sum(int(by_type.get("Total", 0)) for by_type in snapshot.values())


class _ForwardModTracker(ModTracker):
    """``ModTracker`` following modules through their forwards only. Its gradient hooks on a module's
    inputs (``register_multi_grad_hook``, mode ``"all"``) keep the inputs' autograd nodes in a closure
    that the nodes hold in turn, a cycle through C++ the collector cannot see: every stage input
    that required grad outlived ``measure_stage_memory`` (torch 2.13), and inputs of modules inside a
    stage their nodes. The backward hooks serve per-module statistics, which nothing here reads
    (whether a backward runs, which decides temporaries from activations, the engine tells)."""

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        self._get_append_fn(weakref.ref(mod), self._get_mod_name(mod), False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
        if self._user_post_fw_hook is not None:
            self._user_post_fw_hook(mod, input, output)
        self._get_pop_fn(weakref.ref(mod), self._get_mod_name(mod), False)()


class QuietMemTracker(MemTracker):
    """``MemTracker`` without its gradient hooks: it puts one on every parameter of a module it sees
    run, which a frozen parameter refuses; the gradients they would catch are found anyway (they
    are made inside the tracker, or handed to ``track_external``). Its modules are followed through
    their forwards only (``_ForwardModTracker``)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _ForwardModTracker()

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    def forget_modules(self) -> None:
        """Forget the modules earlier nodes ran, before the next node runs: their stats (the tracker
        refuses a module it saw run before: a block's one dropout, used twice), and the modules it
        counts as still running: one whose forward a failed probe left half-run stayed, and the next
        module of its type warned that the tracking may be wrong (torch then replaced
        ``warnings.formatwarning`` for the whole process)."""
        self.reset_mod_stats()
        self._mod_tracker.parents = {"Global"}
        self._mod_tracker._active_module_cnt.clear()

    def total(self, kind: str) -> int:
        """All bytes of the tracker's ``"current"`` or ``"peak"`` snapshot, every device."""
        return _total(self.get_tracker_snapshot(kind))


class KeptGradientsTracker(QuietMemTracker):
    """Also the peak of a run where storages ``kept`` so far (bytes) had been freed as they came: a
    backward that keeps its weights' gradients (the step's first, after ``zero_grad``) gives, in the
    same run, the peak of one that adds each into the existing gradient and frees it; and that peak
    where the ``released`` bytes so far (gradients the backward started from, which the probe holds)
    had been freed too (``alone_peak``). The peaks are taken after each operator, as ``MemTracker``
    takes its own."""

    kept = 0
    released = 0
    freed_peak = 0
    alone_peak = 0

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        self.freed_peak = max(self.freed_peak, _total(self._curr_mem_snap) - self.kept)
        self.alone_peak = max(self.alone_peak, _total(self._curr_mem_snap) - self.kept - self.released)
