"""Writes a forward makes to its module's state, which a captured graph cannot replay.

A graph records operations on values; it records no attribute assignment. A forward that rebinds
a buffer to a computed value (``self.steps += 1`` under fx), keeps a tensor for its next call
(``self.previous = y``) or registers one as a buffer would, captured, compute with the old value
forever: a silently wrong
sharded model. While a front end traces, ``refusing_state_writes`` makes such an assignment
raise ``StateWrite``, so the module that makes it is kept whole (run as it is, state included),
like any other code the front end cannot capture.

A number, flag or string kept on ``self`` is state when the code changing it has read it first
(``self.steps += 1``; ``if not self.ready: ...; self.ready = True``) and the call has not set it
before (``TraceWrites``): Funnel sets ``self.pooling_mult = 1`` and then doubles it, which
carries nothing to the next call.

One write is safe: a scratch attribute that a forward fills before it reads it (RAFT builds its
correlation pyramid on ``self`` and reads it later in the same call). If the attribute held
tensors and no operation of the trace has read them before the write, the graph never reads the
value a previous call left, so the write is allowed. An attribute that held no tensor (None) gives
no such evidence (``if self.previous is not None`` reads it without an operation) and stays refused.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import itertools
import os
import sys
import types
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from autoshard.capture.eager import swapped_attribute
from autoshard.capture.leaves import MACHINERY_DIRS, TORCH_DIR
from autoshard.isolation import PLAIN_VALUES, TRACE_VALUES, scalar_changed

#: ``computed(module, name, value)``: whether assigning ``value`` stores something the trace computed.
Computed = Callable[[nn.Module, str, Any], bool]


#: Where a count the top-level forward moves on every call serves (each value would take a capture).
COUNT_ELSEWHERE = ("count outside the forward (around the call), or in a submodule of its own, which the plan calls "
                   "whole (it writes its own state), and read the count there, not in the code around it")


class StateWrite(RuntimeError):
    """Model code stored a value it computed in a parameter, buffer or attribute of its module.
    Not a ``TraceError``: the code is kept whole like any other untraceable code."""


class ScalarStateWrite(StateWrite):
    """Model code changed a number, flag, string or None on its module that it reads on its next
    call: no graph records it (export too freezes the branch it drives)."""


def kind_of(module: nn.Module, name: str) -> str:
    for kind in ("parameter", "buffer"):
        if name in module.__dict__.get(f"_{kind}s", {}):
            return kind
    return "attribute"


def current_value(module: nn.Module, name: str) -> Any:
    """What ``module.name`` holds now, without running ``__getattr__`` hooks (None if unset)."""
    kind = kind_of(module, name)
    return module.__dict__.get(name) if kind == "attribute" else module.__dict__[f"_{kind}s"][name]


@functools.lru_cache(maxsize=None)
def instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """``code``'s instructions, disassembled once (tracing asks for the same callers again and again)."""
    return tuple(dis.get_instructions(code))


_CAPTURE_DIR = os.path.dirname(os.path.abspath(__file__))


def _reads(instructions_: Iterable[dis.Instruction], names: frozenset[str]) -> bool:
    """Whether ``instructions_`` read one of attributes ``names``: ``self.ready``, or by name as a
    constant (``getattr(self, "ready")``, ``self.__dict__["ready"]``)."""
    return any(ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST") and ins.argval in names
               for ins in instructions_)


def _names_read_as(module: nn.Module, name: str) -> frozenset[str]:
    """``name`` and the properties of ``module`` whose getter reads it (``self.ready`` reading
    ``self._ready``)."""
    found = {name}
    for owner in type(module).__mro__:
        for attribute, value in vars(owner).items():
            if isinstance(value, property) and value.fget is not None and hasattr(value.fget, "__code__") \
                    and _reads(instructions(value.fget.__code__), frozenset({name})):
                found.add(attribute)
    return frozenset(found)


def _read_earlier(frame: types.FrameType | None, names: frozenset[str], entered: Sequence[nn.Module]) -> bool:
    """Whether the model read one of ``names`` (an attribute and what reads it) before ``frame``
    stores it: code on the stack before the point it is at (``self.steps += 1``; a flag set once,
    ``if not self.ready: ...; self.ready = True``, even when the check sits in a caller), or the
    forward of a module ``entered`` earlier in the trace that has returned (children reading a
    flag their parent sets after them). Static: a read the code skipped counts too (keeping a
    module whole is safe)."""
    on_stack = set()
    while frame is not None and (frame.f_code.co_filename == __file__  # a setter run by our guard
                                 or not frame.f_code.co_filename.startswith(_CAPTURE_DIR)):
        on_stack.add(frame.f_code)
        if not frame.f_code.co_filename.startswith((TORCH_DIR, _CAPTURE_DIR)) and _reads(
                itertools.takewhile(lambda ins: ins.offset < frame.f_lasti, instructions(frame.f_code)), names):
            return True
        frame = frame.f_back
    forwards = {getattr(type(m).forward, "__code__", None) for m in entered} - on_stack - {None}
    return any(_reads(instructions(code), names) for code in forwards)


_UNSET = object()


class TraceWrites:
    """Which plain numbers, flags and strings of modules a trace changes as state for the next call,
    and which attributes code run for real inside it set (``set_by_runs``).

    A step counter (``self.steps += 1``) reads the value the previous call left and stores
    another: a graph would take the branch it drives once and never advance it. A scratch value
    the call sets afresh before updating it (Funnel's ``self.pooling_mult = 1`` then ``*= 2``)
    carries nothing over. So a change counts as state when the model has read the attribute before
    it in this call (``_read_earlier``: code on the stack, or modules that ran and returned) and
    the trace has not written it before.
    """

    def __init__(self) -> None:
        self.written: set[tuple[int, str]] = set()
        #: attributes set by code run for real (a module kept whole, run for its output sizes): traced code
        #: reading one after it ran reads what the call set, and a call's check compares what it held before
        self.set_by_runs: set[tuple[int, str]] = set()
        self.entered: dict[int, nn.Module] = {}  # modules whose forward the trace ran, in order

    def enter(self, module: nn.Module, args: Any) -> None:
        self.entered.setdefault(id(module), module)

    def carried(self, module: nn.Module, name: str, value: Any, frame: types.FrameType) -> bool:
        key = (id(module), name)
        first = key not in self.written
        self.written.add(key)
        old = module.__dict__.get(name, _UNSET)
        return (first and old is not _UNSET and (scalar_changed(old, value) or (  # a size kept from the first call
                    old is None and isinstance(value, TRACE_VALUES)))
                and _read_earlier(frame, _names_read_as(module, name), list(self.entered.values())))


#: Values that hold no tensor, passed to operations at every turn.
_NO_TENSORS = (*PLAIN_VALUES, torch.dtype, torch.device, torch.Size)


class _TensorsRead(TorchFunctionMode):
    """Notes (by id) every tensor an operation reads while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for value in itertools.chain(args, kwargs.values()):  # flattened only where nested: it runs per operation
            if isinstance(value, torch.Tensor):
                self.ids.add(id(value))
            elif not isinstance(value, _NO_TENSORS):
                self.ids.update(id(leaf) for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))
        return func(*args, **kwargs)


def _unread_scratch(module: nn.Module, name: str, read: _TensorsRead) -> bool:
    """Whether ``module.name`` is a plain attribute holding tensors that nothing has read yet."""
    if kind_of(module, name) != "attribute":
        return False
    old = [leaf for leaf in tree_leaves(current_value(module, name)) if isinstance(leaf, torch.Tensor)]
    return bool(old) and not any(id(tensor) in read.ids for tensor in old)


def _constructing(module: nn.Module, frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs inside ``module``'s own ``__init__``: a module the forward builds on
    the spot (``CrossEntropyLoss(weight=self.class_weights)``) stores its arguments, no state a
    later call reads; the next call builds another."""
    while frame is not None:
        if frame.f_code.co_name == "__init__" and frame.f_code.co_argcount \
                and frame.f_locals.get(frame.f_code.co_varnames[0]) is module:
            return True
        frame = frame.f_back
    return False


_REAL_RUNS = [0]


@contextlib.contextmanager
def real_run() -> Iterator[None]:
    """Code run for real inside a trace (an opaque module, for its output sizes) writes its state
    as on any call; capture sets the model back afterwards (``eager.module_state_restored``)."""
    _REAL_RUNS[0] += 1
    try:
        yield
    finally:
        _REAL_RUNS[0] -= 1


def is_real_run() -> bool:
    """Whether code inside a trace is running for real now (``real_run``)."""
    return bool(_REAL_RUNS[0])


@contextlib.contextmanager
def refusing_state_writes(computed: Computed, follow_modules: bool = False,
                          kept_whole: Callable[[nn.Module], bool] | None = None,
                          replayed: Callable[[nn.Module, str, Any], bool] | None = None,
                          ) -> Iterator[TraceWrites]:
    """``nn.Module.__setattr__`` and ``register_buffer`` raise ``StateWrite`` where ``computed``
    says so, until exit; yields what the trace writes (``TraceWrites``).
    ``follow_modules``: note the modules whose forward runs (a global forward pre-hook, which fx
    runs through but ``torch.cond``'s compilation under export refuses), so a flag read by modules
    that ran before it is set counts as state. ``kept_whole(module)``: whether the graph calls
    ``module`` whole, so that any write onto it is state: it reads its own attributes when it runs,
    and the graph does not replay the write (RecurrentGemma's block resets its kept-whole
    recurrence's ``recurrent_states`` to None; the next call started from the last one's).
    ``replayed(module, name, value)``: whether a changed number, flag or string that is state is
    written back by each call the plan serves instead (the top-level module's: nothing keeps it whole)."""
    setattr_, register_buffer = nn.Module.__setattr__, nn.Module.register_buffer
    read, scalars = _TensorsRead(), TraceWrites()
    replaying: set[tuple[int, str]] = set()  # the writes ``replayed`` took

    def refuse_state(module: nn.Module, name: str, value: Any, caller: types.FrameType) -> None:
        if _REAL_RUNS[0]:
            scalars.set_by_runs.add((id(module), name))
            return
        if caller.f_code.co_filename.startswith(MACHINERY_DIRS):  # torch's own (export lifting a constant)
            return
        if kept_whole is not None and kept_whole(module) and not _constructing(module, caller):
            raise StateWrite(f"the forward sets {name!r} on a {type(module).__name__} the graph calls whole, whose "
                             "code may read it when it runs; a captured graph cannot replay that write")
        if (id(module), name) in replaying:  # written again: each served call writes back the last value
            if not (replayed and replayed(module, name, value)):
                raise ScalarStateWrite(f"the forward changes its attribute {name!r} to {value!r}, after a number, "
                                       "flag or string each call writes back; a captured graph cannot replay that")
            return
        carried = scalars.carried(module, name, value, caller)
        if carried and replayed and replayed(module, name, value):
            replaying.add((id(module), name))
        elif carried:
            now = "a size of its inputs" if isinstance(value, TRACE_VALUES) else repr(value)
            raise ScalarStateWrite(f"the forward changes its attribute {name!r} ({current_value(module, name)!r} -> "
                                   f"{now}), which its next call reads; a captured graph cannot replay that write")
        if computed(module, name, value) and not _unread_scratch(module, name, read) \
                and not _constructing(module, caller):
            raise StateWrite(f"the forward stores a value it computed in its {kind_of(module, name)} {name!r}, "
                             "which a later call may read; a captured graph cannot replay that write")

    def refused_unwritten(module: nn.Module, name: str, value: Any, caller: types.FrameType) -> None:
        """``refuse_state``; a write it refuses is not one the trace made: a read of that attribute by code
        traced on (``if self.counter.calls <= 2`` after the counter, kept whole, counts) is checked."""
        try:
            refuse_state(module, name, value, caller)
        except StateWrite:
            scalars.written.discard((id(module), name))
            raise

    def guarded_setattr(module: nn.Module, name: str, value: Any) -> None:
        refused_unwritten(module, name, value, sys._getframe(1))
        setattr_(module, name, value)

    def guarded_register(module: nn.Module, name: str, tensor: Any, persistent: bool = True) -> None:
        refused_unwritten(module, name, tensor, sys._getframe(1))  # a cache kept as a buffer (ALiBi bias)
        register_buffer(module, name, tensor, persistent)

    entering = register_module_forward_pre_hook(scalars.enter) if follow_modules else None
    try:
        with swapped_attribute(nn.Module, "__setattr__", guarded_setattr), \
                swapped_attribute(nn.Module, "register_buffer", guarded_register), read:
            yield scalars
    finally:
        if entering is not None:
            entering.remove()
