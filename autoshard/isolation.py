"""Running the user's model, or a graph of it, for real without leaving a trace on it.

Capture runs the model on the example to learn shapes, verify runs it to compare, and the cost
passes run the traced graph to measure it; all must leave the model as it was. ``isolated``
replays randomness from one seed, restores every buffer (BatchNorm statistics) afterwards, and
takes off the modules whatever a trace left on them: a forward that stores a value on itself
(Swin's window size) would keep a Proxy, and fail the model's next call. What the model's hooks
keep (a list collecting features) is set back too: the user's hook sees the user's calls only.
``run_seeded`` runs a call so, ``PlainInterpreter`` runs a graph as its generated code would, and
``grad_mode_unchecked`` marks autoshard's own runs of a graph. Kept with the shared helpers at the
bottom of the layers so that the cost modules, below capture, run graphs as capture and verify do.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types
from collections import OrderedDict, abc, deque
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules import module as module_globals
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.hooks import RemovableHandle


@contextlib.contextmanager
def values_restored(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """On exit, each of ``tensors`` holds the values, and the version counter, it held on entry.

    Autograd refuses to back-propagate through a graph that saved a tensor whose counter moved
    since: a backward pending on the model from before sharding saw these values, so it must
    still run once they are back (a buffer the forward updates with ``mul_``). Kernels that
    update statistics in place (BatchNorm on the CPU) leave the counter where it was, so the
    values are compared as well. One the runs wrote a value requiring grad into (``self.buf.copy_(h)``)
    holds that run's autograd graph, and requires grad, from then on: it is detached again."""
    saved = [(t, _version(t), t.detach().clone()) for t in tensors]
    plain = [t.grad_fn is None and not t.requires_grad for t, _, _ in saved]
    try:
        yield
    finally:
        # Through .data, which has a counter of its own, so the write itself moves nothing.
        # Inference mode: an inference tensor (weights made under it) can be written only there.
        with torch.inference_mode():
            for tensor, version, value in saved:
                if _version(tensor) != version or not _same_values(tensor, value):
                    tensor.data.copy_(value)
        for (tensor, _, _), was_plain in zip(saved, plain):
            if was_plain and tensor.grad_fn is not None and tensor._base is None:  # (no view detaches in place)
                tensor.detach_()
        # The counters the runs' own writes moved go back too, as torch's
        # `_unsafe_preserve_version_counter` does for a tensor refilled before autograd reads it:
        # the values under them are the saved ones again.
        moved = [(tensor, version) for tensor, version, _ in saved if _version(tensor) != version]
        if moved:
            tensors_moved, versions = zip(*moved)
            torch._C._autograd._unsafe_set_version_counter(tensors_moved, versions)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (None for an inference tensor, which has none)."""
    return None if tensor.is_inference() else tensor._version


def _same_values(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    """Equal elementwise, NaN at the same places counting as equal (meta tensors hold no values)."""
    if tensor.is_meta or torch.equal(tensor, value):
        return True
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    return torch.equal(tensor.isnan(), value.isnan()) and torch.equal(tensor.nan_to_num(0.0), value.nan_to_num(0.0))


def rewritten_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights a forward rewrites in place: an embedding with ``max_norm`` renormalises the
    rows it looks up on every call."""
    return [m.weight for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]


_REGISTRIES = ("_parameters", "_buffers", "_modules")


#: Values that hold nothing ``contents`` walks into, told apart before the slower checks (a model's
#: attributes are mostly these, and ``isolated`` reads every one of them on each of its runs).
_ATOMS = (bool, int, float, str, type(None), torch.Tensor, nn.Module, torch.dtype, torch.device)


def contents(value: Any) -> Iterable[Any]:
    """What a container, a mapping, a dataclass or a slice holds; nothing for anything else."""
    if isinstance(value, (tuple, list, set, frozenset, deque)):
        return value
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, _ATOMS):
        return ()
    if isinstance(value, abc.Mapping):  # a UserDict such as Hugging Face's BatchEncoding
        return value.values()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    if isinstance(value, slice):
        return value.start, value.stop, value.step
    return ()


def holds(value: Any, kinds: type | tuple[type, ...]) -> bool:
    """Whether an instance of ``kinds`` hides anywhere in ``value`` (containers, dataclass fields, slices)."""
    return isinstance(value, kinds) or any(holds(v, kinds) for v in contents(value))


#: Exact types no trace value, module or settings object hides in (told apart by one set lookup).
_SCALAR_TYPES = frozenset({bool, int, float, str, type(None)})
#: Those and the plain containers (not settings objects: no ``__dict__``, or a mapping).
_PLAIN_TYPES = _SCALAR_TYPES | {dict, list, set, tuple, OrderedDict}

_ABSENT = object()

#: Values only a trace makes; left on a module, they break its next real call.
TRACE_VALUES = (fx.Proxy, torch.SymInt, torch.SymFloat, torch.SymBool, FakeTensor)


def trace_value_slots(value: Any, depth: int = 6) -> Iterator[tuple[Any, Any]]:
    """``(holder, key)`` of every trace value kept in ``value``'s lists, dicts and object attributes (not
    inside tensors, modules' registries or tuples), ``holder`` being the list or dict (an object's
    ``vars``) that holds it."""
    seen: set[int] = set()
    pending = [(value, 0)]
    while pending:
        holder, level = pending.pop()
        if level > depth or id(holder) in seen or isinstance(holder, (torch.Tensor, type)):
            continue
        seen.add(id(holder))
        if isinstance(holder, list):
            items: Iterable[tuple[Any, Any]] = list(enumerate(holder))
        elif isinstance(holder, dict):
            items = list(holder.items())
        elif hasattr(holder, "__dict__") and not isinstance(holder, types.ModuleType):
            holder, items = vars(holder), list(vars(holder).items())
        else:
            continue
        for key, item in items:
            if isinstance(item, TRACE_VALUES):
                yield holder, key
            else:
                pending.append((item, level + 1))


def clear_trace_values(value: Any) -> None:
    """Set to None every trace value kept in ``value`` (``trace_value_slots``). A graph keeps an object
    its traced forward made as a constant (Hugging Face's empty key/value cache), and the trace fills it
    with Proxies; a Proxy there breaks a deep copy of the stage: its ``__deepcopy__`` fails part way and
    leaves the memo holding the ids of freed objects, which later objects then reuse (a T5 stage's copy
    once rebuilt an ``inspect.Parameter`` from an fx node's state)."""
    for holder, key in list(trace_value_slots(value)):
        if not isinstance(holder, (fx.immutable_collections.immutable_list, fx.immutable_collections.immutable_dict)):
            holder[key] = None


#: Where a trace can leave a value besides plain attributes: ``self.count += 1`` on a buffer
#: sets the buffer to the Proxy of the addition.
_TENSOR_REGISTRIES = ("_parameters", "_buffers")
#: What ``nn.Module`` keeps on every module (its registries and hook dicts): a forward that installs
#: hooks on its first call (Hugging Face's output recorders, marked installed by a flag) keeps them.
_MODULE_MACHINERY = frozenset(vars(nn.Module()))


def _attribute_dicts(module: nn.Module) -> list[dict[str, Any]]:
    """Where ``module`` keeps its state: its plain attributes, then its parameters and buffers."""
    return [vars(module)] + [getattr(module, r) for r in _TENSOR_REGISTRIES]


def trace_values_on(module: nn.Module) -> list[str]:
    """The attributes of ``module`` (plain ones, parameters and buffers; not its children) holding
    a trace value."""
    return [key for entries in _attribute_dicts(module) for key, value in entries.items()
            if key not in _REGISTRIES and holds(value, TRACE_VALUES)]


#: Plain values a forward may keep on ``self`` from one call to the next.
SCALARS = (bool, int, float, str)
#: Those and None: what an attribute set once (``self.mode = None`` until the first call) holds.
PLAIN_VALUES = (*SCALARS, type(None))


def scalar_changed(old: Any, new: Any) -> bool:
    """Whether a number, flag, string or None was replaced by a different one (a step counter
    moved, a mode left None)."""
    return (isinstance(old, PLAIN_VALUES) and isinstance(new, PLAIN_VALUES)
            and (type(old) is not type(new) or old != new))


@contextlib.contextmanager
def module_state_restored(model: nn.Module, changed: list[tuple[nn.Module, str]] | None = None) -> Iterator[None]:
    """On exit, set back (or remove, if the run added it) every attribute, parameter or buffer of
    a module that holds a trace value, and every attribute or buffer the run bound to another tensor
    (``self.previous = y``, kept for the next call; a cache registered as a buffer), changed from
    one number, flag, string or None to another (a step counter), added as one (``self._warned = True``,
    unless the run registered hooks, which such a flag may mark) or deleted, and every dict, list or set attribute
    the run changed (a log it appends to; a cache keyed by a traced size) back to its contents: each run starts
    from the state the model was given in, and none leaves a trace on it. Other values a forward
    stores are its own business, as on any call, and so are the hooks it installs on modules
    (``_MODULE_MACHINERY``). What objects modules keep settings in hold (a Hugging Face config's
    ``problem_type``, a list set on one) is set back as well, and what the run added to them removed
    (``settings_objects``). ``changed``: where given, the plain values the run changed (a number, a
    flag, a string; the items of a dict, list or set) are added to it, as ``(module, name)``."""
    modules = list(model.modules())
    registered = hooks_registered(model)
    saved = [(module, [dict(c) for c in _attribute_dicts(module)]) for module in modules]
    settings = [(holder, dict(vars(holder))) for holder in settings_objects(model)]
    # each one's items (none to copy for an empty one; ``copy.copy`` of an OrderedDict, by
    # reduction, took a third of the time a 300-module model's run was isolated)
    collections = [(found, () if not found else dict(found) if isinstance(found, dict) else list(found), module, key)
                   for module in modules for key, value in vars(module).items()
                   if key not in _MODULE_MACHINERY and isinstance(value, _COLLECTIONS)
                   for found in _collections_in(value)]
    try:
        yield
    finally:
        clean: set[int] = set()  # collections found free of trace values and left as they are: not walked twice
        noted = changed if changed is not None else []  # (a list no one reads, where none is given)
        # a log appended to, a cache the trace filled (keyed by a Proxy)
        for collection, before, module, name in collections:
            if not collection and not before:
                clean.add(id(collection))
                continue
            keys = list(collection.keys()) if isinstance(collection, dict) else []
            same = _same_items(collection, before)
            if (same and not (holds(keys, TRACE_VALUES) or holds(collection, TRACE_VALUES))) \
                    or _installs(collection, before):
                clean.add(id(collection))
                continue
            if not same:
                noted.append((module, name))
            _refill(collection, before)

        def traced(value: Any, kept: bool) -> bool:
            """``holds(value, TRACE_VALUES)``, walked once per object the model kept (a config many modules hold)."""
            if id(value) in clean:
                return False
            found = holds(value, TRACE_VALUES)
            if kept and not found:  # (kept alive by ``saved``: its id stays its own)
                clean.add(id(value))
            return found

        # (a flag marking hooks the run installed stays with them: Hugging Face's output recorders')
        installed = hooks_registered(model) != registered
        for module, befores in saved:
            for current, before in zip(_attribute_dicts(module), befores):
                stale = [key for key, value in current.items() if key not in _REGISTRIES and not (
                    type(value) in _PLAIN_TYPES and (type(value) in _SCALAR_TYPES or not value)
                    and value is before.get(key, _ABSENT)) and (  # (unchanged: a number, or an empty hook dict)
                    traced(value, value is before.get(key))
                    or (value is not before.get(key) and holds(value, torch.Tensor))
                    or (key in before and scalar_changed(before[key], value))
                    or (key not in before and type(value) in _SCALAR_TYPES and not installed)
                    or _rebound(key, value, before))]
                noted.extend((module, key) for key in stale if key in before and (
                    scalar_changed(before[key], current[key])
                    or (_rebound(key, current[key], before) and not (
                        type(current[key]) is type(before[key]) and _same_items(current[key], before[key])))))
                _set_back(current, before, stale)
        for holder, before in settings:
            current = vars(holder)
            # (one the run added shadows the class's value: ``scale = None`` in the class body)
            _set_back(current, before, [k for k, v in current.items() if k not in before or before[k] is not v
                                        or holds(v, TRACE_VALUES)])


#: The containers a module keeps state in that a run's changes to are set back.
_COLLECTIONS = (dict, list, set, deque)


def _set_back(current: dict[str, Any], before: dict[str, Any], keys: Iterable[str]) -> None:
    """``current``'s ``keys`` set back to what ``before`` held (removed where it held none), and
    what the run deleted put back."""
    for key in list(keys):
        if key in before:
            current[key] = before[key]
        else:
            del current[key]
    for key, value in before.items():  # (item by item: a ScriptModule's registries are mappings without ``update``)
        if key not in current:
            current[key] = value


def _collections_in(value: Any, depth: int = 0) -> Iterator[Any]:
    """``value`` and the dicts, lists, sets and deques inside it, two levels down (``self.stats =
    {"seen": []}``, appended to)."""
    yield value
    if depth < 2 and value:
        for item in contents(value):
            if isinstance(item, _COLLECTIONS):
                yield from _collections_in(item, depth + 1)


def _same_items(collection: Any, before: Any) -> bool:
    """Whether ``collection`` holds the items ``before`` (a copy of its items, or another collection)
    holds: nothing appended, removed or replaced (a number, a string or a size replaced by an equal
    one is the same)."""
    if len(collection) != len(before) or isinstance(collection, dict) != isinstance(before, dict):
        return False
    if isinstance(collection, dict):
        return all(_same(collection.get(key, _ABSENT), then) for key, then in before.items())
    if isinstance(collection, set):
        return all(item in collection for item in before)
    return all(_same(now, then) for now, then in zip(collection, before))


def _same(now: Any, then: Any) -> bool:
    return now is then or (type(now) is type(then) and type(now) in (*_SCALAR_TYPES, torch.Size) and now == then)


def _installs(collection: Any, before: Any) -> bool:
    """Whether the run kept handles of hooks it installed in ``collection`` (``self.handles.append(
    self.a.register_forward_hook(...))`` on its first call): the hooks stay, as nn.Module keeps them, so
    the handles that remove them stay too (set back, the next run installed the hook again)."""
    old = {id(item) for item in contents(before)}
    return holds([item for item in contents(collection) if id(item) not in old], RemovableHandle)


def _rebound(key: str, value: Any, before: dict[str, Any]) -> bool:
    """Whether the run bound attribute ``key`` to another dict, list or set, or to one where it had none
    (``self.log = self.log + [n]``; ``if not hasattr(self, "log"): self.log = []``): not one holding hook
    handles it installed, nor modules (built on the first call: the stages hold those)."""
    return key not in _MODULE_MACHINERY and isinstance(value, _COLLECTIONS) and value is not before.get(key) \
        and not _installs(value, before.get(key, ())) and not holds(value, nn.Module)


def _refill(collection: Any, before: Any) -> None:
    """Put ``before``'s items back into ``collection``, in place."""
    if isinstance(collection, list):
        collection[:] = before
        return
    collection.clear()
    if isinstance(collection, deque):
        collection.extend(before)
    else:
        collection.update(before)


def settings_objects(model: nn.Module) -> list[Any]:
    """The plain objects modules keep settings in (a Hugging Face config, and the objects such a one
    holds: a multimodal config's ``text_config``): a forward that fills one in
    (``self.config.problem_type = "regression"`` when it was None) changes the model as surely as
    a flag on ``self``, so its numbers, flags and strings are set back too. Not modules, tensors,
    containers, functions, classes or PyTorch's own callables (operators): only objects with attributes of
    their own (a helper object the forward calls, a ``torch.distributions`` prior, too)."""
    found: dict[int, Any] = {}
    holders: list[dict[str, Any]] = [vars(module) for module in model.modules()]
    for _ in range(_SETTINGS_DEPTH):
        inside = []
        for attributes in holders:
            for key, value in attributes.items():
                if type(value) in _PLAIN_TYPES or key in _REGISTRIES or id(value) in found \
                        or not hasattr(value, "__dict__") or (callable(value) and _torch_object(value)) \
                        or isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType, abc.Mapping,
                                              *_FUNCTIONS)):
                    continue
                found[id(value)] = value
                inside.append(vars(value))
        holders = inside
    return list(found.values())


def _torch_object(value: Any) -> bool:
    """Whether ``value`` is an object of one of PyTorch's classes (an operator, ``torch.ops.aten.relu.default``)."""
    return type(value).__module__.startswith("torch")


#: Callables that are no settings objects (their ``__dict__`` holds no settings).
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


#: Where a module keeps the hooks registered on it, and where ``nn.Module.__call__`` finds those
#: registered for all modules (in ``torch.nn.modules.module``), in the order it runs them.
MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in MODULE_HOOK_DICTS)


def _hook_dicts(model: nn.Module) -> Iterator[dict[int, Any]]:
    """The hook dicts of ``model``'s modules, then the global ones."""
    for module in model.modules():
        yield from (vars(module)[name] for name in MODULE_HOOK_DICTS)
    yield from (vars(module_globals)[name] for name in GLOBAL_HOOK_DICTS)


def _hook_state(model: nn.Module) -> tuple[list[types.CellType], list[Any], list[tuple[dict[str, Any], str]],
                                           list[Any]]:
    """The closure cells, the objects, the globals and the containers the hooks on ``model``'s modules
    (and the global module hooks) keep their state in: a hook collecting features appends to a list
    in its closure, on the object whose method it is, in its script's globals (a number, flag,
    string or container its code names) or bound by ``functools.partial``. Not PyTorch's own hooks."""
    hooks = [hook for hooks_of in _hook_dicts(model) for hook in hooks_of.values()]
    cells: dict[int, types.CellType] = {}
    owners: dict[int, Any] = {}
    names: dict[tuple[int, str], tuple[dict[str, Any], str]] = {}
    walked: set[int] = set()
    containers: list[Any] = []  # those a ``functools.partial`` binds
    while hooks:
        hook = hooks.pop()
        if id(hook) in walked:  # (a recursive helper's closure holds the helper itself)
            continue
        walked.add(id(hook))
        if isinstance(hook, functools.partial):
            hooks += [hook.func, *hook.args, *hook.keywords.values()]
            containers += [value for value in (*hook.args, *hook.keywords.values()) if isinstance(value, _COLLECTIONS)]
            continue
        if (getattr(hook, "__module__", None) or type(hook).__module__ or "").startswith("torch."):
            continue  # PyTorch's own (FSDP's state initialised on the first forward, a profiler's): theirs to keep
        owner = getattr(hook, "__self__", None) if isinstance(hook, types.MethodType) else hook
        if isinstance(hook, types.FunctionType):
            names.update(((id(hook.__globals__), name), (hook.__globals__, name)) for name in hook.__code__.co_names
                         if name in hook.__globals__ and (type(hook.__globals__[name]) in _SCALAR_TYPES
                                                          or isinstance(hook.__globals__[name], _COLLECTIONS)))
        for cell in getattr(hook, "__closure__", None) or ():
            cells[id(cell)] = cell
            if not isinstance(getattr(cell, "cell_contents", None), _ATOMS):
                hooks.append(cell.cell_contents)  # an object the closure holds (a recorder)
        if owner is not None and not isinstance(owner, (nn.Module, type, types.ModuleType, types.FunctionType)) \
                and hasattr(owner, "__dict__") and id(owner) not in owners:
            owners[id(owner)] = owner
    return list(cells.values()), list(owners.values()), list(names.values()), containers


def hooks_registered(model: nn.Module) -> frozenset[int]:
    """The handle ids (unique across all hook dicts) of the hooks on ``model``'s modules and of the
    global module hooks: a module the run built without hooks changes nothing here."""
    return frozenset(key for hooks_of in _hook_dicts(model) for key in hooks_of)


@contextlib.contextmanager
def hook_state_restored(model: nn.Module) -> Iterator[None]:
    """On exit, the state of the hooks registered on ``model``'s modules (and globally) set back: what
    their closures hold (a counter rebound, a list appended to), and the attributes and the lists,
    dicts and sets of the objects whose methods they are. A capture runs the model and its graph
    many times (on the example, on fake tensors, to verify), and a hook collecting features would
    otherwise keep every one of those runs' outputs, fake tensors among them. Not after a run that
    registered or removed a hook (a pre-hook installing its post-hook once, flagged in its closure;
    a hook removing itself): what the hooks keep goes with what they registered."""
    registered = hooks_registered(model)
    cells, owners, names, containers = _hook_state(model)
    cell_contents = [(cell, getattr(cell, "cell_contents", _ABSENT)) for cell in cells]
    bound = [(namespace, name, namespace[name]) for namespace, name in names]
    attributes = [(owner, dict(vars(owner))) for owner in owners]
    held = [*(contents for _, contents in cell_contents), *(v for _, saved in attributes for v in saved.values()),
            *(value for _, _, value in bound), *containers]
    collections = [(found, dict(found) if isinstance(found, dict) else list(found))
                   for value in held if isinstance(value, _COLLECTIONS) for found in _collections_in(value)]
    try:
        yield
    finally:
        if hooks_registered(model) == registered:
            for collection, before in collections:
                if not _same_items(collection, before):
                    _refill(collection, before)
            for cell, contents_before in cell_contents:
                if contents_before is not _ABSENT and getattr(cell, "cell_contents", _ABSENT) is not contents_before:
                    cell.cell_contents = contents_before
            for owner, before in attributes:
                current = vars(owner)
                _set_back(current, before, [k for k, v in current.items() if before.get(k, _ABSENT) is not v])
            for namespace, name, value in bound:
                namespace[name] = value


#: How deep settings objects are looked for inside each other (``config.text_config.vision_config``).
_SETTINGS_DEPTH = 3


#: The random generators passed in the arguments of the call being planned (``model(x, generator=g)``),
#: which ``generators_restored`` sets back as it does a module's own (``arguments_drawn_from``).
_ARGUMENT_GENERATORS: contextvars.ContextVar[tuple[torch.Generator, ...]] = contextvars.ContextVar(
    "autoshard_argument_generators", default=())


@contextlib.contextmanager
def arguments_drawn_from(*arguments: Any) -> Iterator[None]:
    """Within, every run of the model or its graphs sets back the generators found in ``arguments``: the
    plan holds the call's generator and draws from it, as the model does, and planning draws nothing
    from it (each run drew further along it, so the graph and the model drew different numbers)."""
    found = tuple(leaf for leaf in tree_flatten(arguments)[0] if isinstance(leaf, torch.Generator))
    token = _ARGUMENT_GENERATORS.set(found)
    try:
        yield
    finally:
        _ARGUMENT_GENERATORS.reset(token)


@contextlib.contextmanager
def generators_restored(model: nn.Module) -> Iterator[None]:
    """On exit, each random generator a module keeps (``self.g = torch.Generator()``), or the call being
    planned was given (``arguments_drawn_from``), back at the state it had: every run draws the same
    numbers, and capture leaves the model's draws alone."""
    saved = [(g, g.get_state()) for m in model.modules() for g in vars(m).values()
             if type(g) not in _PLAIN_TYPES and isinstance(g, torch.Generator)]  # (a metaclass's isinstance is slow)
    saved += [(g, g.get_state()) for g in _ARGUMENT_GENERATORS.get()]
    try:
        yield
    finally:
        for generator, state in saved:
            generator.set_state(state)


def _tensor_attributes(model: nn.Module) -> list[torch.Tensor]:
    """Tensors modules keep as plain attributes (not parameters or buffers), which a forward may
    update in place (``self.t += 1``)."""
    return [value for module in model.modules() for key, value in vars(module).items()
            if key not in _REGISTRIES and isinstance(value, torch.Tensor) and not isinstance(value, TRACE_VALUES)]


class HeldModule:
    """A module a graph node reads at run time without holding it as a submodule, so its weights
    stay in the stages that hold them: one the graph traced through outside the model's tree (kept
    in a list or a global, or built in the forward: ``CrossEntropyLoss()``), whose mode the plan
    watches (``capture.guard.check_detached_mode``: the model's ``eval()`` / ``train()`` never reach
    it), or one whose forward hooks run after its traced body (``capture.guard.run_forward_hooks``).
    Copies of the plan hold the same module. ``runs_hooks``: the node runs the module's hooks, so a
    run of the graph sets back what they write on it (``detached_modules``); a watched module is only
    read (one built in the forward holds what the trace gave it: fake tensors)."""

    def __init__(self, module: torch.nn.Module, runs_hooks: bool = False) -> None:
        self.module = module
        self.runs_hooks = runs_hooks

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldModule:
        return self


def detached_modules(model: nn.Module) -> list[nn.Module]:
    """Modules the model keeps outside its module tree, in a plain list, tuple or dict attribute of
    one of its modules (``self.extra = [nn.BatchNorm1d(4)]``), or whose hooks a graph runs
    (``HeldModule``): its forward runs them, so a run of it updates their buffers and state too,
    though ``model.buffers()`` does not list them."""
    tree = {id(m) for m in model.modules()}
    found: dict[int, nn.Module] = {}
    walked: dict[int, tuple[int, Any]] = {}  # id -> the least depth it was walked from, and the object (kept alive)

    def walk(value: Any, depth: int) -> None:
        if type(value) in _SCALAR_TYPES:
            return
        if isinstance(value, HeldModule) and value.runs_hooks:
            value = value.module
        if isinstance(value, nn.Module):
            if id(value) not in tree:
                found.setdefault(id(value), value)
        elif depth < 4:
            if walked.get(id(value), (depth + 1,))[0] <= depth:  # walked as deep already (a config many modules hold)
                return
            walked[id(value)] = (depth, value)
            for item in contents(value):
                walk(item, depth + 1)

    for module in model.modules():
        for key, value in vars(module).items():
            if key not in _REGISTRIES and not (type(value) in _PLAIN_TYPES and not value):  # (empty hook dicts)
                walk(value, 0)
    return list(found.values())


@contextlib.contextmanager
def isolated(model: nn.Module, seed: int | None = 0) -> Iterator[None]:
    """Randomness seeded with ``seed`` (None: drawn on from where it is, then set back), and on
    exit the generators, buffer values, rewritten weights and module state of the model, and of the
    modules it keeps outside its tree (``detached_modules``), restored."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for owner in (model, *detached_modules(model)):
            stack.enter_context(generators_restored(owner))
            stack.enter_context(values_restored([*owner.buffers(), *rewritten_weights(owner),
                                                 *_tensor_attributes(owner)]))
            stack.enter_context(module_state_restored(owner))
            stack.enter_context(hook_state_restored(owner))
        if seed is not None:
            torch.manual_seed(seed)
        yield


def cloned(value: Any) -> Any:
    """A copy of every tensor in ``value``, in its strides, so running a capture never writes to the user's inputs:
    one tensor passed twice, one copy passed twice; one that requires grad still does, in any grad mode, a leaf
    as a leaf and another as another (a capture may have answered the model's ``y is x``, ``x.requires_grad``
    or ``x.grad_fn is None`` from it), and none joins the autograd graph of the one it copies."""
    return each_tensor_once(_clone, value)


def called_on_copies(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on copies of the tensors in them (``cloned``, over both at once: one tensor passed
    positionally and by keyword stays one)."""
    copied_args, copied_kwargs = cloned((tuple(args), dict(kwargs)))
    return fn(*copied_args, **copied_kwargs)


def each_tensor_once(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with each tensor in it replaced by ``fn(tensor)``, called once a tensor: one tensor found
    twice (``model(x, x)``) gives one result, found twice."""
    made: dict[int, Any] = {}

    def once(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in made:
            made[id(leaf)] = fn(leaf)
        return made[id(leaf)]
    return tree_map(once, value)


def alike(copy: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``copy`` (detached) as ``value`` is to the model's code, which may ask (and a plan checks): a
    ``Parameter`` where it is one, requiring grad as it does, a leaf where it is one and else computed by
    autograd from a leaf of its own (``x.grad_fn is None``)."""
    if type(value) is nn.Parameter:  # (``detach`` and every op of a Parameter give a plain tensor)
        return nn.Parameter(copy, value.requires_grad)
    if not value.requires_grad:
        return copy
    return copy.requires_grad_() if value.is_leaf else copy.requires_grad_().clone()


def _clone(value: torch.Tensor) -> torch.Tensor:
    copy = value.detach().clone()
    if value.layout is torch.strided and copy.device.type != "meta" and copy.stride() != value.stride():
        copy = strided_copy(value)
    return alike(copy, value)


def strided_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (detached) in its own strides, where ``clone`` makes a slice or an expanded
    tensor contiguous: a plan torch.export made guards its inputs' layout, so a copy of a slice
    passed as the example must stay one. The part of the storage it spans is copied, gaps included."""
    values = tensor.detach()
    span = 1 + sum((size - 1) * stride for size, stride in zip(values.shape, values.stride())) if values.numel() else 0
    return values.as_strided((span,), (1,), values.storage_offset()).clone().as_strided(values.shape, values.stride())


_GRAD_MODE_CHECKED = [True]


@contextlib.contextmanager
def grad_mode_unchecked() -> Iterator[None]:
    """autoshard's own runs of a graph (shape propagation, timing) choose the grad mode for their
    measurements: ``check_grad_mode`` lets them through."""
    _GRAD_MODE_CHECKED.append(False)
    try:
        yield
    finally:
        _GRAD_MODE_CHECKED.pop()


def grad_mode_checked() -> bool:
    """Whether ``check_grad_mode`` guards check the grad mode now: not inside ``grad_mode_unchecked``."""
    return _GRAD_MODE_CHECKED[-1]


def detached_values(value: Any) -> Any:
    """``value`` with its tensors detached, so a kept result does not keep its autograd graph."""
    flat, spec = tree_flatten(value, is_leaf=lambda v: isinstance(v, torch.Size))  # unflattened, a Size is a tuple
    if not any(isinstance(v, torch.Tensor) for v in flat):
        return value
    return tree_unflatten([v.detach() if isinstance(v, torch.Tensor) else v for v in flat], spec)


def run_seeded(fn: Callable[[], Any], model: nn.Module, seed: int, grad: bool = False) -> Any:
    """``fn()`` with randomness from ``seed`` and ``model``'s buffers and state restored afterwards."""
    with isolated(model, seed), torch.set_grad_enabled(grad):
        return detached_values(fn())


def _thawed(value: Any) -> Any:
    """fx's interpreter freezes the containers in a node's arguments and in the graph's output;
    generated code builds plain ones afresh on every call (a function may fill a list it is
    given: torchvision's video Swin does), so hand over and compare those."""
    if isinstance(value, immutable_dict):
        return {key: _thawed(item) for key, item in value.items()}
    if isinstance(value, immutable_list):
        return [_thawed(item) for item in value]
    if type(value) is tuple:
        return tuple(_thawed(item) for item in value)
    return value


class PlainInterpreter(fx.Interpreter):
    """Runs each node as the graph's generated code would: on plain, fresh containers (the
    output node too, so the graph returns plain ones)."""

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return _thawed(args), _thawed(kwargs)
