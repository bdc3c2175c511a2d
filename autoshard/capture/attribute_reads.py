"""The plain attributes a trace read: settings the captured graph fixed, checked on every call.

Traced code that reads a flag, number or string from a module or its config
(``if self.config.output_hidden_states``, ``x * self.scale``, ``ATTENTION[self.config._attn_implementation]``)
leaves only the path that value chose in the graph. Set anew after sharding, the stages would go on
computing with the old one, silently. So, as Dynamo guards the attributes its bytecode reads, the
trace records which ones its code read (a ``__getattribute__`` on ``nn.Module`` and on the classes of
the objects modules keep settings in, installed for the trace only) and the sharded model compares
them on every call (``sharded.StateAtCapture``): a change captures the model again. A read is of
the holder's own attribute, of its class's (``scale = 2.0`` in the class body: set on the instance
later, it takes over), or of none (``getattr(self, "extra", 1.0)``: set later, it is read).

A plain value the traced code writes on a settings object after reading it there (a Hugging Face
model's ``config.problem_type``, set on its first call with labels) is noted on the read
(``AttributeRead.written``): the graph holds no attribute writes, so each call the capture serves
writes it back (``sharded.StateAtCapture.write_back``), as a call of the model does.

Recorded are the reads by the model's traced code only: not those of code run for real or on
examples (a module or function kept whole reads its attributes on every call of its stage), not
attributes of PyTorch's own bookkeeping, and not attributes the trace wrote before reading them
(Funnel's ``self.pooling_mult = 1``: what the call itself sets fixes nothing). Only plain values
are checked (numbers, flags, strings, bytes, None, enums, ranges, slices, classes, dtypes, devices,
numpy scalars and arrays, functions, bound methods, partials, and tuples, lists, sets, deques and
mappings of them), and by identity tensors kept as plain attributes (set anew, the graph would
compute with the old one) and the model's settings objects (replaced, the reads of the old one's
attributes would watch the wrong object): modules and parameters rebound are seen by
``capture.rebinding``. A method of the model's code read from its module (``self._attn(...)``) is
checked as the function its class holds, and that the module holds none of its own by that name: one
patched, on the class or the module, captures again. A container is kept as it was read
(``AttributeRead.contents``: a deep copy of its containers), and a call compares it with the one
held now (``content_reads``: one ``==``), so one changed in place captures again too; one the
capture's own runs changed (a cache the forward fills) is watched by identity only. Not seen: the
keys of a plain dict reordered, its items the same (``==`` ignores their order), an object with
``__slots__``, one kept in a list, and methods of PyTorch's own classes. A settings object of a built-in class
(``types.SimpleNamespace``) takes no ``__getattribute__`` of ours: where the traced code reads one,
all its plain attributes are checked.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import types
from collections import abc
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from autoshard.capture.eager import swapped_attribute
from autoshard.capture.held_state import EQUALS, NO_KEY, Read
from autoshard.capture.structure import SEQUENCES, copied, same_constant
from autoshard.isolation import PLAIN_VALUES, settings_objects

#: What ``nn.Module`` and its ``__init__`` set on every module: PyTorch's bookkeeping
#: (``_compiled_call_impl``), not the model's settings (``training`` has its own check).
_BOOKKEEPING = frozenset(vars(nn.Module())) | frozenset(vars(nn.Module))
_CHECKED = (*PLAIN_VALUES, bytes, complex, range, slice, type, enum.Enum, types.FunctionType,
            types.BuiltinFunctionType, types.MethodType, functools.partial, torch.dtype, torch.device, np.generic,
            np.ndarray, torch.Tensor)


class _Absent:
    def __repr__(self) -> str:
        return "unset"


#: What a read found where the holder had no such attribute (``getattr(self, "extra", 1.0)``).
ABSENT: Any = _Absent()


@dataclass(frozen=True)
class AttributeRead:
    """``holder.name`` read by traced code, and the ``value`` it read (the graph took its path;
    ``ABSENT``: it had none). ``by_identity``: the value is one of the model's settings objects, whose
    own attributes the graph read: another object there, even an equal one, is not the one watched.
    ``contents``: the value as it was read, the lists, dicts and sets in it copied (``copied``), so
    that one changed in place since differs; the value itself where nothing in it is copied, or where
    the capture's own runs changed it (a cache the forward fills: only another object there counts)."""

    holder: Any
    name: str
    value: Any
    by_identity: bool = False
    contents: Any = None
    #: a plain value the traced code then wrote there, on a settings object (``if config.problem_type is
    #: None: config.problem_type = ...``), which each call the plan serves writes too; ``ABSENT``: none
    written: Any = ABSENT
    #: the value code run whole (a module kept whole, counting or filling in a setting) left there in the call
    #: before the traced code read it, where another than the call started from: the next call starts from
    #: it, and needs another capture; ``ABSENT``: none
    left: Any = ABSENT

    def content_reads(self, now: Any) -> tuple[list[Read], list[Any]]:
        """The read that tells whether ``now``, the container held where the value was read (a check in
        full found it equal to ``contents``), is changed in place later: ``now == contents`` (one C-level
        comparison, item by item), with what it finds now; none where the contents are the value itself."""
        if self.contents is self.value:
            return [], []
        return [(now, NO_KEY, EQUALS)], [_Items(self.contents) if isinstance(now, np.ndarray) else self.contents]


class _Items:
    """An array's items as read, for ``array == _Items(copy)`` to tell in one comparison whether they are the
    same (``same_constant``): numpy's ``==`` compares item by item, and defers to this one's
    (``__array_ufunc__ = None``)."""

    __array_ufunc__ = None
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, items: np.ndarray) -> None:
        self.items = items

    def __eq__(self, other: object) -> bool:
        return same_constant(other, self.items)


def looked_up(holder: Any, name: str) -> tuple[Mapping[str, Any] | None, Any]:
    """Where ``holder.name`` is held, and its value: the holder's own ``__dict__``, else that of the
    first class holding it (a class attribute, ``scale = 2.0`` in the class body), else ``(None,
    ABSENT)``."""
    own = vars(holder)
    if name in own:
        return own, own[name]
    for cls in type(holder).__mro__:
        held = vars(cls)
        if name in held:
            return held, held[name]
    return None, ABSENT


def checked_value(value: Any) -> bool:
    """Whether a value read is one a check compares: plain (``_CHECKED``), or a tuple, list, set or dict
    (of any class of theirs) of such; a tensor kept as a plain attribute (``self.offset = torch.zeros(8)``),
    also inside a container, is compared by identity (the graph holds the one it read; changed in
    place, the graph sees it)."""
    if isinstance(value, _CHECKED):
        return True
    if isinstance(value, SEQUENCES):
        return all(map(checked_value, value))
    return isinstance(value, abc.Mapping) and checked_value(tuple(value)) and checked_value(tuple(value.values()))


def _absent(holder: Any, name: str) -> bool:
    """Whether ``holder`` has no attribute ``name`` once ``__getattribute__`` failed: no ``__getattr__``
    finds one (a module's finds its submodules, parameters and buffers; other classes' may compute)."""
    fallback = getattr(type(holder), "__getattr__", None)
    if fallback is None:
        return True
    return isinstance(holder, nn.Module) and fallback is nn.Module.__getattr__ and not any(
        name in vars(holder).get(registry, ()) for registry in ("_parameters", "_buffers", "_modules"))


def _own_method(holder: Any, value: Any, held: Any) -> bool:
    """Whether ``value``, read as an attribute of ``holder`` held as ``held``, is a method of its class bound to it,
    of code not PyTorch's own (``nn.Conv2d._conv_forward``: patching torch is not watched, and every conv would
    add its reads to each call)."""
    return type(value) is types.MethodType and value.__self__ is holder and value.__func__ is held \
        and not getattr(held, "__module__", "torch.").startswith("torch.")


class AttributeReads:
    """The first read of each plain attribute of a module or settings object while active, unless
    ``paused()`` (code run for real or on examples)."""

    def __init__(self, model: nn.Module, paused: Callable[[], bool], written: set[tuple[int, str]],
                 set_by_runs: set[tuple[int, str]]) -> None:
        self.paused = paused
        self.written = written  # (``capture.state.TraceWrites``: filled as the trace runs)
        self.set_by_runs = set_by_runs
        self.first: dict[tuple[int, str], AttributeRead] = {}
        settings = settings_objects(model)
        self.classes = [nn.Module, *{type(s): None for s in settings}]
        #: the model's modules and settings objects, by id: not modules made on the way (a loss built
        #: in the forward, the tracer's own graph modules)
        self.holders = frozenset(map(id, [*model.modules(), *settings]))
        #: settings objects of built-in classes, which take no ``__getattribute__`` of ours, by id: where
        #: the traced code reads one, every plain attribute it holds is checked
        self.unwatched = {id(s): s for s in settings if type(s).__flags__ & _IMMUTABLE_TYPE}
        #: such objects read, by id: the object, its plain attributes at the first read, and (once the
        #: recording ends) those the traced code set, which a served call writes back
        self.read_whole: dict[int, tuple[Any, dict[str, Any], dict[str, Any]]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[AttributeReads]:
        """Record while active; at its end (before the capture puts the model back), a container the
        traced code changed since reading it (a cache the forward fills, a log it appends to) is kept
        to be watched by identity only: its contents are the call's own doing."""
        with contextlib.ExitStack() as stack:
            for cls in self.classes:
                if not cls.__flags__ & _IMMUTABLE_TYPE:
                    recorder = self._recorder(cls.__getattribute__)
                    stack.enter_context(swapped_attribute(cls, "__getattribute__", recorder))
                    if cls is not nn.Module:  # (a module's writes are ``capture.state``'s)
                        stack.enter_context(swapped_attribute(cls, "__setattr__", self._writer(cls.__setattr__)))
            yield self
        for holder, before, written in self.read_whole.values():
            written.update((name, value) for name, value in vars(holder).items() if checked_value(value)
                           and (name not in before or not same_constant(value, before[name])))
        changed = [key for key, read in self.first.items() if not same_constant(copied(read.value), read.contents)]
        for key in changed:
            self.first[key] = replace(self.first[key], contents=self.first[key].value)

    def _recorder(self, original: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
        first, paused, holders = self.first, self.paused, self.holders
        unwatched, read_whole = self.unwatched, self.read_whole

        def __getattribute__(holder: Any, name: str) -> Any:  # noqa: N807 - the slot it fills
            if name.startswith(("__", "_autoshard_")) or id(holder) not in holders or paused() or (
                    name in _BOOKKEEPING and isinstance(holder, nn.Module)):  # (a config's flag may be named `half`)
                return original(holder, name)
            try:
                value = original(holder, name)
            except AttributeError:
                if (id(holder), name) not in first and _absent(holder, name):
                    first[(id(holder), name)] = AttributeRead(holder, name, ABSENT, contents=ABSENT)
                raise
            if (id(holder), name) not in first:
                held = looked_up(holder, name)[1]
                plain = checked_value(value)
                if held is value and (plain or (id(value) in holders and not isinstance(value, nn.Module))):
                    first[(id(holder), name)] = AttributeRead(holder, name, value, not plain, copied(value))
                elif _own_method(holder, value, held):  # (its code is in the graph: patched, captured again)
                    first[(id(holder), name)] = AttributeRead(holder, name, held, contents=held)
            if id(value) in unwatched and id(value) not in read_whole:
                read_whole[id(value)] = (value, {k: copied(v) for k, v in vars(value).items() if checked_value(v)}, {})
            return value
        return __getattribute__

    def _writer(self, original: Callable[[Any, str, Any], None]) -> Callable[[Any, str, Any], None]:
        """A settings object's ``__setattr__`` that notes a plain value the traced code writes
        (``AttributeRead.written``), on the read of what the attribute held before (made now if none was)."""

        def __setattr__(holder: Any, name: str, value: Any) -> None:  # noqa: N807 - the slot it fills
            if id(holder) in self.holders and not self.paused():
                self.write_back(holder, name, value)
            original(holder, name, value)
        return __setattr__

    def write_back(self, holder: Any, name: str, value: Any) -> bool:
        """Note that the traced code writes ``value``, a plain one, as ``holder.name``, which each call the
        plan serves then writes (``AttributeRead.written``), on the read of what the attribute held
        before (made now if none was); whether it is one so noted."""
        if not checked_value(value):
            return False
        read = self.first.get((id(holder), name))
        if read is None:  # written before any read: the value it held is what the call met
            before = looked_up(holder, name)[1]
            read = AttributeRead(holder, name, before, False, copied(before))
        self.first[(id(holder), name)] = replace(read, written=value)
        return True

    def kept(self) -> tuple[AttributeRead, ...]:
        """The reads a graph fixed, once the capture has set the model back: not of attributes the
        trace wrote (``written``: ``(id(module), name)``, filled as it writes), and of values the model
        holds again (not a stand-in the capture installed for the trace, nor a value the trace set). A
        value code run for real set before the read (a counter kept whole counting, then read by the
        traced code) is what the call met from what the model held before it: that is checked."""
        whole = [AttributeRead(holder, name, looked_up(holder, name)[1] if name in before else ABSENT,
                               contents=before.get(name, ABSENT), written=written.get(name, ABSENT))
                 for holder, before, written in self.read_whole.values() for name in {**before, **written}]
        reads = [self._before_runs(read) for read in [*self.first.values(), *whole]]
        return tuple(read for read in reads
                     if ((id(read.holder), read.name) not in self.written or read.written is not ABSENT)
                     and looked_up(read.holder, read.name)[1] is read.value)

    def _before_runs(self, read: AttributeRead) -> AttributeRead:
        """``read`` of a plain value code run for real inside the trace set: made of the value the model holds
        again (what the call started from), which a call's check then compares."""
        if (id(read.holder), read.name) not in self.set_by_runs or not checked_value(read.value):
            return read
        value = looked_up(read.holder, read.name)[1]
        left = ABSENT if same_constant(value, read.value) else read.value
        return replace(read, value=value, contents=copied(value), left=left) if checked_value(value) else read


#: ``type.__flags__``' bit of a class whose attributes cannot be set (a built-in one).
_IMMUTABLE_TYPE = 1 << 8
