"""The one check a stage makes of the modules it holds, cheap enough to run on every microbatch.

A stage's graph fixed what its modules' code read from ``self.training`` and from their weights'
dtypes, so every call checks that the stage and the modules it calls are in the modes they were
captured in and that no weight was converted (``check_mode``, ``check_weight_dtypes`` say what is
wrong). Walking the module tree by path for that (``getattr(self.blocks, "0").ln_1.training``)
cost more than small layers compute. As torch.compile's guards do, the walk is done once and its
result kept as a flat list of reads: the modules with their captured modes, the registries
holding the parameters whose dtypes count, and every step of the paths to them (the container's
``_modules`` dict, the name, the module found there). A call first checks that each step still
leads where it did, by identity: a submodule replaced in any way (``setattr``,
``_modules[name] = ...`` as quantization's convert does) makes it walk again.
Parameters are read from their registries on every call, so a conversion is seen whether it
swaps a parameter's data or registers a new one; none is kept (a runtime may swap in device
copies for one call, ``functional_call``, which must not outlive it). Everything a call reads is
compared with what the last passing call read, by identity, in code written for the stage's reads
(``kept_check``: one chain of ``is`` tests, no tuple built, no call per read, as Dynamo's guard code
did before its C++ guard tree); only a difference runs the refusing checks.

The check returns the modules it has just checked, by path, and the stage's code calls those
(``HeldModulesCodeGen``): fx's code would find each one again through ``nn.Module.__getattr__``
(an attribute miss and a Python call per step of its path), which cost more than the check. Where
``nn.Module.__call__`` would only call a module's ``forward`` (no hooks, not compiled), it returns
that ``forward`` instead (``cheapest_calls``), and checks, as cheaply, that it still would.

A call torch.compile traces runs another check (``HeldState.traced_check``): Dynamo turns what the
traced code reads into guards, and an object reached two ways (two closure variables, or one and the
module tree) into a guard it evaluates in Python on every call; so the traced check reaches each
module from the stage by its path and compares flags and dtypes with constants, and reads the hook
dicts it watches rather than the hook counter (whose value Dynamo would guard: a new graph for each
hook registered anywhere).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_state
from torch.utils.hooks import RemovableHandle

from autoshard.capture.guard import _converts, check_mode, check_weight_dtypes
from autoshard.capture.structure import same_constant
from autoshard.errors import InputMismatchError
from autoshard.isolation import GLOBAL_HOOK_DICTS, MODULE_HOOK_DICTS

_training = operator.attrgetter("training")
_dtype = operator.attrgetter("dtype")

#: A read's ``key`` when it reads no item: ``(owner, NO_KEY, attribute)`` reads ``owner.attribute``.
NO_KEY = object()
#: ``kept_check``'s ``flag_seen`` when the check compares no flag.
NO_FLAG = object()
#: The attributes a read may name (the generated code spells them out).
_ATTRIBUTES = ("", "training", "dtype", "forward", "__class__", "__call__", "_call_impl")
#: A read's ``attribute`` that asks whether ``key`` is in ``owner`` (``key in owner.__dict__``).
HOLDS = "in"
#: A read's ``attribute`` that compares ``owner[key]`` with the value its one-item list ``expected``
#: holds, which the check's owner moves on without writing the check anew (a counter).
KEPT = "kept"
#: Reads of a hook dict ``owner[key]`` (``StayAsCaptured``), not in ``kept_check``'s code: that it is empty
#: or absent, and that it holds the hooks expected (``_hooks``).
EMPTY, HOOKS = "empty", "hooks"
#: A read's ``attribute`` that compares ``owner`` with the value expected by equality (``==``), not identity.
EQUALS = "=="
#: A read's ``attribute`` that compares ``len(owner)`` with the number expected: with a read of each of the
#: names a dict held (an item, or ``HOLDS``), what an ``EQUALS`` of its keys with them says, at a third of
#: the cost (a frozenset compared with a dict's keys hashes every name; ``len`` is one call).
LENGTH = "len"
#: A read's ``attribute`` that reads ``getattr(owner, key)``: a class's attribute, read through the class,
#: not its ``__dict__``, whose mapping proxy ``torch.compile`` refuses to read once a traced call filled a
#: cache (a graph break that makes it run each stage alone).
ATTRIBUTE = "getattr"

#: A module's hook dicts, as a hook registered on it is named.
HOOK_DICTS = dict(zip(MODULE_HOOK_DICTS, ("forward pre-hook", "forward hook", "backward pre-hook", "backward hook")))
#: The global hook dicts a stage refuses to run under (``refuse_global_backward_hooks``).
GLOBAL_BACKWARD_HOOK_DICTS = GLOBAL_HOOK_DICTS[2:]


Read = tuple[Any, Any, str]
"""``(owner, key, attribute)``: ``owner[key].attribute``, without the item when ``key`` is
``NO_KEY`` and without the attribute when it is empty; ``key in owner`` when it is ``HOLDS``;
``getattr(owner, key)`` when it is ``ATTRIBUTE``, and given with its list when it is ``KEPT`` (``read`` does
not take those); ``owner``, compared by equality, when it is ``EQUALS``; ``len(owner)``, compared by equality,
when it is ``LENGTH`` (in ``kept_check``'s code only)."""


def read(owner: Any, key: Any, attribute: str) -> Any:
    """What ``kept_check``'s code reads for ``(owner, key, attribute)`` (KeyError, AttributeError: gone)."""
    if attribute == HOLDS:
        return key in owner
    if attribute == ATTRIBUTE:
        return getattr(owner, key)
    value = owner if key is NO_KEY else owner[key]
    return getattr(value, attribute) if attribute else value


def kept_check(reads: Sequence[Read], expected: Sequence[Any], passed: Any, full: Callable[[Any], Any],
               flag_seen: Any = NO_FLAG, traced: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
    """``check(flag)``: ``passed`` when ``flag is flag_seen`` (unless ``NO_FLAG``) and each read is
    ``expected`` by identity, else (a difference, an item or attribute gone) ``full(flag)``; where
    given, ``traced(flag)`` instead while torch.compile traces the call (``HeldState.traced_check``).

    Written as code for these reads: one chain of ``is`` tests over closure variables, so a call
    that passes builds nothing and calls nothing; the code is compiled once per shape of the reads
    (which of them take an item, which attribute) and given the objects and values each time.
    Past ``_PART`` reads the chain is cut into parts checked in turn (compiling code over many
    closure variables takes time that grows with their square)."""
    if len(reads) > _PART:
        parts = [kept_check(reads[i:i + _PART], expected[i:i + _PART], True, _fails)
                 for i in range(0, len(reads), _PART)]

        def check(flag: Any) -> Any:
            if traced is not None and torch.compiler.is_dynamo_compiling():
                return traced(flag)
            if flag_seen is not NO_FLAG and flag is not flag_seen:
                return full(flag)
            for part in parts:  # (a loop: ``all()`` over a generator cost 0.1 us a part)
                if not part(flag):
                    return full(flag)
            return passed
        return check
    reads = [_from_own_dict(*each) for each in reads]
    shape = (flag_seen is not NO_FLAG, traced is not None,
             *((key is not NO_KEY, attribute) for _, key, attribute in reads))
    make = _MAKERS.get(shape)
    if make is None:
        make = _MAKERS[shape] = _maker(shape)
    values = [value for (owner, key, _), seen in zip(reads, expected) for value in (owner, key, seen)]
    return make(passed, full, flag_seen, traced, values)


#: How many reads one piece of ``kept_check``'s code compares.
_PART = 64


def _from_own_dict(owner: Any, key: Any, attribute: str) -> Read:
    """A module's ``training`` read as the item of its ``__dict__`` that the attribute finds (``nn.Module``
    keeps its flag there): a module's class defines ``__getattr__``, which makes every attribute lookup on
    it take Python's slow path, half again the cost of a dict's item. Any other read as it is."""
    if attribute != "training" or key is not NO_KEY:
        return owner, key, attribute
    own = getattr(owner, "__dict__", None)
    declared = getattr(type(owner), "training", None)  # (a class's descriptor answers the attribute before the dict)
    if type(own) is not dict or "training" not in own or hasattr(type(declared), "__set__"):
        return owner, key, attribute
    return own, "training", ""


Grouped = tuple[tuple[Any, tuple[tuple[Any, str, Any], ...]], ...]
"""``(owner, ((key, attribute, expected), ...))``: reads (not ``KEPT``) with what each is to find, each owner once."""


def grouped(reads: Sequence[Read], expected: Sequence[Any]) -> Grouped:
    """``reads`` and what each is to find, grouped by owner: how ``passes`` takes them, in a call torch.compile
    traces, which guards an object reached two ways (two items of a list) in Python."""
    groups: dict[int, tuple[Any, list[tuple[Any, str, Any]]]] = {}
    for (owner, key, attribute), seen in zip(reads, expected):
        groups.setdefault(id(owner), (owner, []))[1].append((key, attribute, seen))
    return tuple((owner, tuple(each)) for owner, each in groups.values())


def passes(groups: Grouped) -> bool:
    """Whether each read finds what it is to find (``finds``) (``HeldState.traced_check``)."""
    return all(finds(owner, key, attribute, seen) for owner, each in groups for key, attribute, seen in each)


def finds(owner: Any, key: Any, attribute: str, seen: Any) -> bool:
    """Whether the read ``(owner, key, attribute)`` (not ``KEPT``) finds ``seen``, compared as ``kept_check``'s
    code compares; ``EMPTY``: ``owner[key]`` empty or absent, ``HOOKS``: holding the hooks ``seen``."""
    if attribute == HOLDS:
        return (key in owner) is seen
    if attribute == EQUALS:
        return owner == seen
    if attribute == EMPTY:  # (by ``len``: Dynamo guards no dict's truth)
        held = owner.get(key)
        return held is None or len(held) == 0
    if attribute == HOOKS:
        return same_constant(_hooks(owner, key), seen)
    return read(owner, key, attribute) is seen


def _fails(flag: Any) -> bool:
    return False


def _then(check: Callable[[Any], Any], after: Callable[[], None]) -> Callable[[Any], Any]:
    """``check``, then ``after()`` once it passed."""
    def checked(flag: Any) -> Any:
        passed = check(flag)
        after()
        return passed
    return checked


def _maker(shape: tuple[Any, ...]) -> Callable[..., Callable[[Any], Any]]:
    flagged, traced, *terms = shape
    tests = ["flag is flag_seen"] if flagged else []
    for index, (keyed, attribute) in enumerate(terms):
        if attribute == HOLDS:
            tests.append(f"(k{index} in o{index}) is e{index}")
            continue
        if attribute == KEPT:
            tests.append(f"getattr(o{index}, k{index}) is e{index}[0]")
            continue
        if attribute == EQUALS:
            tests.append(f"o{index} == e{index}")
            continue
        if attribute == LENGTH:
            tests.append(f"len(o{index}) == e{index}")
            continue
        if attribute == ATTRIBUTE:
            tests.append(f"getattr(o{index}, k{index}) is e{index}")
            continue
        if attribute == "__class__" and not keyed:  # (one call of ``type``, not an attribute lookup)
            tests.append(f"type(o{index}) is e{index}")
            continue
        assert attribute in _ATTRIBUTES, attribute  # spelled out in the code: only names of ours
        tests.append(f"o{index}{f'[k{index}]' if keyed else ''}{f'.{attribute}' if attribute else ''} is e{index}")
    unpacked = f"    {''.join(f'o{i}, k{i}, e{i}, ' for i in range(len(terms)))}= values\n" if terms else ""
    source = ("def make(passed, full, flag_seen, traced, values):\n" + unpacked
              + "    def check(flag):\n"
              + ("        if compiling():\n            return traced(flag)\n" if traced else "")
              + "        try:\n"
              + f"            if {' and '.join(tests) or 'True'}:\n"
              + "                return passed\n"
              + "        except Exception:\n"  # KeyError, AttributeError: gone; from ==, anything: checked in full
              + "            pass\n"
              + "        return full(flag)\n"
              + "    return check\n")
    namespace: dict[str, Any] = {"compiling": torch.compiler.is_dynamo_compiling}
    exec(compile(source, f"<autoshard kept check {len(terms)}>", "exec"), namespace)  # noqa: S102 - our own text
    return namespace["make"]


#: ``kept_check``'s compiled code by shape of the reads.
_MAKERS: dict[tuple[Any, ...], Callable[..., Callable[[Any], Any]]] = {}


def refuse_global_backward_hooks() -> None:
    """Refuse a call while a global module backward hook is registered: it would run on the stages,
    which are not the model's modules, and not on the modules the capture traced through (a hook
    doubling gradients gave 4x the model's input gradient). Every stage checks it, in every runtime."""
    if any(getattr(module_state, name) for name in GLOBAL_BACKWARD_HOOK_DICTS):  # (Dynamo traces getattr)
        raise InputMismatchError(
            "a global module backward hook is registered (register_module_full_backward_hook or _pre_hook): "
            "it would run on the stages, which are not the model's modules, and miss the modules the capture "
            "traced through, so the gradients it sees or changes would differ from the model's; remove it "
            "while calling the sharded model, or register the hook on the model's modules")


class StayAsCaptured:
    """Hook dicts that are to stay as they were at capture, watched cheaply. Every hook registration, a
    module's, a tensor's or a global one, takes a new id from ``RemovableHandle.next_id``, so a passing
    check compares that one counter by identity (``counter_read``) and each dict that held hooks with a
    copy (a removal takes no id), and only a moved counter makes it look at the dicts
    (``after_difference``; then it keeps the new counter and checks its other reads again).
    ``entries``: ``(what, namespace, name)``, ``namespace[name]`` to stay empty where it is empty now;
    with ``keep_held``, one that holds hooks now is to run just those (hooks a capture traced into its
    graph: ``_hooks``), else it is not watched. ``changed`` names the first that differs, by ``(what, name)``."""

    def __init__(self, entries: Iterable[tuple[Any, Mapping[str, Any], str]], keep_held: bool = False) -> None:
        entries = tuple(entries)
        self.entries = tuple((what, namespace, name) for what, namespace, name in entries if not namespace.get(name))
        self.held = tuple((what, namespace, name, _hooks(namespace, name))
                          for what, namespace, name in entries if keep_held and namespace.get(name))
        self._seen = [RemovableHandle.next_id]  # the counter as the last passing check saw it

    def changed(self) -> tuple[Any, str] | None:
        for what, namespace, name in self.entries:
            if namespace.get(name):
                return what, name
        for what, namespace, name, hooks in self.held:
            if not same_constant(_hooks(namespace, name), hooks):
                return what, name
        return None

    def dict_reads(self) -> tuple[list[Read], list[Any]]:
        """The dicts watched, as reads (``EMPTY``, ``HOOKS``), and what each is to find: what a call torch.compile
        traces compares, in place of the counter (``HeldState.traced_check``)."""
        reads: list[Read] = [(namespace, name, EMPTY) for _, namespace, name in self.entries]
        reads += [(namespace, name, HOOKS) for _, namespace, name, _ in self.held]
        return reads, [None] * len(self.entries) + [hooks for *_, hooks in self.held]

    def counter_read(self) -> tuple[list[Read], list[Any]]:
        """The reads a passing check makes, where dicts are to stay as they are: the counter, compared with
        the value the check keeps (``KEPT``), which ``after_difference`` moves on, and each dict that held
        hooks, and a copy of it as it is now (``EQUALS``)."""
        if not self.entries and not self.held:
            return [], []
        self._seen[0] = RemovableHandle.next_id
        reads: list[Read] = [(RemovableHandle, "next_id", KEPT)]
        seen: list[Any] = [self._seen]
        for _, namespace, name, _ in self.held:
            now = namespace[name]
            reads += [(namespace, name, ""), (now, NO_KEY, EQUALS)]
            seen += [now, now.copy()]
        return reads, seen

    def after_difference(self, full: Callable[[Any], Any], again: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """What a check that read the counter runs on a difference: where the counter moved (a hook was
        registered somewhere) and no dict changed, it keeps the counter as it is now and runs
        ``again`` (the check, its other reads compared anew); else ``full``. So a model or runtime
        registering hooks on every call (FSDP, full backward hooks) costs a look at the dicts, not
        the full check."""
        if not self.entries and not self.held:
            return full

        def after(flag: Any) -> Any:
            if RemovableHandle.next_id is not self._seen[0] and self.changed() is None:
                self._seen[0] = RemovableHandle.next_id
                return again(flag)
            return full(flag)
        return after


def _hooks_held(namespace: Mapping[str, Any], names: Sequence[str], expected: Sequence[Any]) -> bool:
    """Whether the hook dicts ``namespace[name]`` hold the hooks ``expected`` (``_hooks``), as a call
    torch.compile traces asks it (``finds``: by ``len`` where they held none)."""
    return all(finds(namespace, name, HOOKS if hooks else EMPTY, hooks) for name, hooks in zip(names, expected))


def _hooks(namespace: Mapping[str, Any], name: str) -> tuple[tuple[Any, bool, bool], ...]:
    """What the hook dict ``namespace[name]`` runs: each hook, in order, with whether it takes keyword
    arguments and is always called (flags a module keeps by the hook's id, ``_forward_hooks_with_kwargs``):
    the same hook registered again (a new id) runs the same."""
    flags = [namespace.get(f"{name}{kind}") or {} for kind in ("_with_kwargs", "_always_called")]
    return tuple((hook, *(key in flag for flag in flags)) for key, hook in (namespace.get(name) or {}).items())


#: What ``nn.Module.__call__`` runs, as torch defines it (a profiler or fx's tracer may patch it).
_MODULE_CALL = (nn.Module.__call__, nn.Module._call_impl)


def code_reads(modules: Iterable[nn.Module], own_names: tuple[str, ...] = ("forward",),
               classes: set[type] | None = None) -> tuple[list[Read], list[Any]]:
    """What stays as it is while each of ``modules`` runs the code it ran at capture, and what it is now:
    what the module holds of its own in ``own_names``' places (a ``forward`` patched on it), its class
    (swapped) and that class's ``forward`` (patched; each class once, ``classes`` those already read)."""
    reads: list[Read] = []
    seen: list[Any] = []
    classes = set() if classes is None else classes
    for module in modules:
        own, cls = vars(module), type(module)
        for name in own_names:
            reads.append((own, name, "") if name in own else (own, name, HOLDS))
            seen.append(own[name] if name in own else False)
        reads.append((module, NO_KEY, "__class__"))
        seen.append(cls)
        # (TorchScript's class ``forward`` cannot be read through the class: each module holds its own)
        if cls not in classes and hasattr(cls, "forward"):
            classes.add(cls)
            reads.append((cls, NO_KEY, "forward"))
            seen.append(cls.forward)
    return reads, seen


def cheapest_calls(modules: Mapping[str, nn.Module]) -> tuple[dict[str, Any], list[Read], list[Any], StayAsCaptured]:
    """What a stage's code calls for each of ``modules`` (by path, in the order the stage calls them):
    the module's ``forward``, where ``nn.Module.__call__`` would call just that (``_call_impl``'s fast
    path: no hook on it or global, not compiled, ``__call__`` neither patched nor overridden), else
    the module. Two Python frames fewer a module: on a small layer they cost as much as its kernel
    (an 8-layer MLP called 1.2x the model's time). Only until code that may register a hook runs in
    the stage (a hook, a module not torch's own): from there on each module is called whole, so a hook
    registered meanwhile runs. Also the reads that must stay as they are for a forward to stand for
    the call (the module's class and that class's ``forward``, what the module holds of its own in
    their place, ``nn.Module``'s call) and the hook dicts that must stay empty."""
    calls: dict[str, Any] = {}
    reads: list[Read] = [(nn.Module, NO_KEY, "__call__"), (nn.Module, NO_KEY, "_call_impl")]
    seen: list[Any] = list(_MODULE_CALL)
    classes: set[type] = set()
    plain: list[nn.Module] = []
    user_code = (nn.Module.__call__, nn.Module._call_impl) != _MODULE_CALL \
        or any(vars(module_state)[name] for name in GLOBAL_HOOK_DICTS)
    for path, module in modules.items():
        own, cls = vars(module), type(module)
        if user_code or cls.__call__ is not nn.Module.__call__ or cls._call_impl is not nn.Module._call_impl \
                or own.get("_compiled_call_impl", cls._compiled_call_impl) is not None \
                or "_call_impl" in own or any(own.get(name) for name in HOOK_DICTS):
            calls[path] = module
            user_code = True
            continue
        user_code = not cls.__module__.startswith("torch.")
        calls[path] = module.forward
        plain.append(module)
        code = code_reads([module], ("forward", "_compiled_call_impl", "_call_impl"), classes)  # (``module.compile()``)
        reads += code[0]
        seen += code[1]
    watched = GLOBAL_HOOK_DICTS if plain else GLOBAL_BACKWARD_HOOK_DICTS  # those refused, always
    entries = [*((module, vars(module), name) for module in plain for name in HOOK_DICTS),
               *((None, vars(module_state), name) for name in watched)]
    return calls, reads, seen, StayAsCaptured(entries)


class HeldState:
    """What a stage checks of itself on every call: its own mode and its modules' (``leaves``,
    paths of the modules its graph calls), and the dtypes of the parameters it reads directly
    (``weights``, paths) or inside those modules (each module's first convertible parameter, its
    own or its children's: a conversion converts them all, and reading one per module keeps the
    check short).

    ``check(training)`` is the check the stage's code calls: code that compares what the last
    passing call read (``kept_check``), and runs ``check_in_full`` on a difference."""

    def __init__(self, owner: nn.Module, leaves: tuple[str, ...], weights: tuple[str, ...]) -> None:
        self.owner = owner
        self.leaves = leaves
        self.weight_paths = weights
        self.captured_training = owner.training
        self.rebound = ""
        #: the first stage also checks what the code of the whole plan read from the model
        #: (``sharded.StateAtCapture``: ``reads_now()``, ``after_difference()``, ``check_in_full(training)``,
        #: ``writes`` and ``write_back()``, which a passing check runs),
        #: so running the stages in turn checks it too, before any computes; None in the other stages
        self.model_state: Any = None
        #: ``(registry, name, owner, tensor)`` per parameter and buffer its code reads, in the model's registries
        #: (``hold_model_tensor``), the tensor as sharded
        self.model_tensors: list[tuple[dict[str, Any], str, nn.Module, Any]] = []
        self._walk()
        self.modes = list(map(_training, self.modules))
        self.dtypes = frozenset(map(_dtype, self.weights()))
        self._remember(self.captured_training)

    def _walk(self) -> None:
        """Find the modules and parameters by path again, as the graph's code does, and list what a
        call reads: whether each step of the kept paths still leads to the module it led to (by
        identity), the modules' flags and the kept parameters' dtypes."""
        # each path walked once through the ``_modules`` dicts, prefixes shared (``get_submodule`` goes
        # through ``nn.Module.__getattr__`` twice a step, for every path: 165 us on a tiny GPT-2's stage)
        at: dict[str, nn.Module] = {"": self.owner}
        steps: dict[tuple[int, str], Read] = {}

        def module_at(path: str) -> nn.Module:
            if path not in at:
                parent, _, name = path.rpartition(".")
                holder = module_at(parent)
                registry = holder._modules
                if not isinstance(registry.get(name), nn.Module):
                    raise AttributeError(f"{holder._get_name()} has no submodule `{name}`")
                steps.setdefault((id(registry), name), (registry, name, ""))
                at[path] = registry[name]
            return at[path]

        self.modules = tuple(map(module_at, self.leaves))
        self.by_path = dict(zip(self.leaves, self.modules))
        inside = ((leaf, _first_parameter(module)) for leaf, module in zip(self.leaves, self.modules))
        found = [*self.weight_paths, *(f"{leaf}.{path}" for leaf, path in inside if path is not None)]
        owners = [module_at(p.rpartition(".")[0]) for p in found]
        self.registries = tuple(module._parameters for module in owners)
        self.names = tuple(p.rpartition(".")[2] for p in found)
        self.dtype_paths = tuple(found)
        self.reads: list[Read] = [*steps.values(), *((module, NO_KEY, "training") for module in self.modules),
                                  *((registry, name, "dtype") for registry, name in zip(self.registries, self.names)),
                                  *((registry, name, "") for registry, name, _, _ in self.model_tensors)]

    def traced_check(self, training: bool) -> dict[str, Any]:
        """``check`` while torch.compile traces a call. Dynamo guards what a traced call reads, each object by
        the way it first reached it, and turns an identity test of objects reached two ways into a guard it
        evaluates in Python: ``kept_check``'s code, an object a closure variable and identity tests, made
        529 of them on a tiny BERT's stages (70 us a call). Here each module is reached from the stage by its
        path, its flag and its weights' dtypes compared with constants, and returned whole. Its hooks, the
        global ones, its class and its class's ``forward`` are compared with those of the last call checked
        in full (``traced_calls``), as Dynamo, which traces its call, guards none of them (it skips the hook
        dicts' guards, ``skip_nnmodule_hook_guards``, and a dict's truth makes none: ``len`` here)."""
        if self.rebound or training is not self.captured_training:
            return self.check_in_full(training)
        refuse_global_backward_hooks()
        found: dict[str, Any] = {}
        if not _hooks_held(vars(module_state), GLOBAL_HOOK_DICTS, self.traced_calls[0]):
            return self.check_in_full(training)
        try:
            for path, mode, (kind, own_forward, hooks) in zip(self.leaves, self.modes, self.traced_calls[1]):
                found[path] = module = _module_at(self.owner, path)
                held = module.__dict__
                if module.training is not mode or type(module) is not kind or ("forward" in held) is not own_forward \
                        or not _hooks_held(held, HOOK_DICTS, hooks):
                    return self.check_in_full(training)
            for kind, forward in self.traced_calls[2]:
                if id(kind.forward) != forward:
                    return self.check_in_full(training)
            for path in self.dtype_paths:
                owner, _, name = path.rpartition(".")
                weight = _module_at(self.owner, owner)._parameters.get(name)
                if weight is None or weight.dtype not in self.dtypes:
                    return self.check_in_full(training)
            for path in self.weight_paths:
                owner = path.rpartition(".")[0]
                found[registry_key(owner)] = _module_at(self.owner, owner)._parameters
        except KeyError:  # a module gone: said by the check in full
            return self.check_in_full(training)
        if self.model_state is not None and not passes(self.model_reads):
            return self.check_in_full(training)
        return found

    def weights(self) -> list[Any]:
        """The parameters whose dtypes count, as registered now."""
        return [w for w in map(dict.get, self.registries, self.names) if w is not None]

    def check_dtypes(self) -> None:
        """Raise ``InputMismatchError`` where a weight was converted to another dtype since capture."""
        check_weight_dtypes(self.dtypes, *self.weights())

    @torch.compiler.disable  # (rare, and plain Python: torch.compile's tracer failed inside it)
    def check_in_full(self, training: bool) -> dict[str, Any]:
        """What the stage calls for each module, by path (``cheapest_calls``), found again; raise
        ``InputMismatchError`` when the stage (``training``: its flag now) or one of them is in another
        mode than at capture, or a weight was converted, or refuse for good where the model rebound what
        it calls (``refuse``)."""
        if self.rebound:
            raise InputMismatchError(self.rebound)
        for registry, name, owner, tensor in self.model_tensors:
            if registry.get(name) is not tensor:
                # (named by what the owner holds now: a buffer made a parameter is not in the registry)
                raise InputMismatchError(assigned_anew(owner, name, getattr(owner, name, None)))
        refuse_global_backward_hooks()
        self._walk()
        check_mode(training, self.captured_training, tuple(map(_training, self.modules)), tuple(self.modes))
        self.check_dtypes()
        if self.model_state is not None:
            self.model_state.check_in_full(training)
        self._remember(training)
        if self.model_state is not None:
            self.model_state.write_back()
        return self.calls

    def watch_model_state(self, model_state: Any) -> None:
        """Check ``model_state`` (see ``model_state``) on every call from now on."""
        self.model_state = model_state
        self.check = self.check_in_full  # written anew on the next call
        self.holds = _fails

    def hold_model_tensor(self, registry: dict[str, Any], name: str, owner: nn.Module) -> None:
        """Refuse calls while ``registry[name]`` (``owner``'s ``_parameters`` or ``_buffers`` in the model) holds
        another tensor than it does now: the stage computes with this one (``capture.rebinding``)."""
        self.model_tensors.append((registry, name, owner, registry[name]))
        self.check = self.check_in_full  # written anew on the next call
        self.holds = _fails

    def refuse(self, reason: str) -> None:
        """Refuse every call from now on, saying ``reason``: the model rebound a module, parameter or buffer
        the stage calls or reads (``capture.rebinding``); the first one rebound is the one named."""
        self.rebound = self.rebound or reason
        self.check = self.check_in_full
        self.holds = _fails

    def _remember(self, training: bool) -> None:
        """Keep what a call that passed read, for the next call to compare with (``check``), and what
        the stage's code calls (``cheapest_calls``)."""
        self.calls, call_reads, call_seen, empty = cheapest_calls(self.by_path)
        #: what ``traced_check`` compares of the modules' calls: the global hook dicts' hooks; per module its
        #: class, whether it holds a ``forward`` of its own, and its hook dicts' hooks; per class the id of its
        #: ``forward`` (an id, which Dynamo guards in C++, not the function, reached two ways)
        self.traced_calls = (
            tuple(_hooks(vars(module_state), name) for name in GLOBAL_HOOK_DICTS),
            tuple((type(m), "forward" in vars(m), tuple(_hooks(vars(m), name) for name in HOOK_DICTS))
                  for m in self.modules),
            tuple({type(m): id(type(m).forward) for m in self.modules if hasattr(type(m), "forward")}.items()))
        # the registries of the parameters the stage's code reads itself (its get_attr nodes, as in
        # torch.export's graphs): read by name on every call, as getattr would, without a
        # ``nn.Module.__getattr__`` a step; the steps to their modules are checked by identity
        for path, registry in zip(self.weight_paths, self.registries):
            self.calls[registry_key(path.rpartition(".")[0])] = registry
        try:
            seen = [read(*each) for each in self.reads]
        except (KeyError, AttributeError):  # a parameter deleted or set to None
            self.check: Callable[[bool], dict[str, Any]] = self.check_in_full  # in full on every call
            self.holds = _fails
            return
        counter, kept = empty.counter_read()
        reads, seen = [*self.reads, *call_reads, *counter], [*seen, *call_seen, *kept]
        full = empty.after_difference(self.check_in_full, self._check_again)
        if self.model_state is not None:
            model_reads, model_seen = self.model_state.reads_now()
            reads, seen = [*reads, *model_reads], [*seen, *model_seen]
            self.model_reads = grouped(*self.model_state.reads_now(traced=True))
            full = self.model_state.after_difference(full, self._check_again)
        self.check = kept_check(reads, seen, self.calls, full, training, self.traced_check)
        if self.model_state is not None and self.model_state.writes:  # the writes a call of the model makes
            self.check = _then(self.check, self.model_state.write_back)
        #: ``holds(training)``: whether ``check`` would pass at once, asked without raising or checking in
        #: full (False on any difference, and before the first call): how a caller holding several plans
        #: picks the one to run
        self.holds: Callable[[bool], bool] = kept_check(reads, seen, True, _fails, training)

    def _check_again(self, training: bool) -> dict[str, Any]:
        return self.check(training)

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldState:
        """A copy watches the copied stage (``memo`` maps the stage to its copy), found by path; not the model's
        tensors: it computes with copies of them (the model converted or moved since does not change them)."""
        copied = HeldState.__new__(HeldState)
        copied.__setstate__({**self.__getstate__(), "owner": memo.get(id(self.owner), self.owner)})
        return copied

    def __getstate__(self) -> dict[str, Any]:
        return {"owner": self.owner, "leaves": self.leaves, "weight_paths": self.weight_paths,
                "captured_training": self.captured_training, "modes": self.modes, "dtypes": self.dtypes,
                "rebound": self.rebound, "model_state": self.model_state}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy watches no model's tensors: it holds copies of them (another process has its own model)
        self.__dict__.update({"rebound": "", "model_state": None, "model_tensors": [], **state})
        # found by path on the first call, which checks in full
        self.modules, self.registries, self.names, self.reads = (), (), (), []
        self.by_path, self.calls = {}, {}
        self.check = self.check_in_full


def assigned_anew(owner: nn.Module, name: str, value: Any) -> str:
    """The refusal of a call after ``owner.name`` was assigned ``value`` in the model after sharding."""
    return (f"the model's {type(owner).__name__}.{name} was assigned anew after sharding ({name} = "
            f"{type(value).__name__}{_CONVERTED if isinstance(value, torch.Tensor) else ''}), but the stage computes "
            "with the one it was sharded with; shard the model again after such a change (an update in place, "
            "load_state_dict(sd) or an optimizer step, is seen)")


#: How a tensor gets assigned anew without an assignment in the user's code.
_CONVERTED = "; model.to(), .half(), .float() and .cuda() put a new tensor in place of each buffer they convert"


def _module_at(root: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` from ``root`` (``""``: ``root``), through the ``_modules`` dicts."""
    for name in path.split(".") if path else ():
        root = root._modules[name]
    return root


def _first_parameter(module: nn.Module) -> str | None:
    """The path, from ``module``, of its first convertible parameter (its own, then its children's)."""
    if not isinstance(module._parameters, dict):  # a TorchScript module's: a view of its compiled module, no dict
        return None
    for name, tensor in module._parameters.items():
        if tensor is not None and _converts(tensor.dtype):
            return name
    for child_name, child in module._modules.items():
        found = None if child is None else _first_parameter(child)
        if found is not None:
            return f"{child_name}.{found}"
    return None


def checked_modules(state: HeldState, training: bool) -> dict[str, Any]:
    """The graph's call of ``state.check()``, given the stage's own flag (read as ``self.training``,
    so a copy of the stage that shares ``state`` is checked by its own flag): what the stage's code
    calls for each module, by path (the module, or its ``forward``: ``cheapest_calls``). The stage's
    generated code calls ``state.check`` itself (``HeldModulesCodeGen``); this is what the graph names."""
    return state.check(training)


def registry_key(owner: str) -> str:
    """The key under which ``HeldState.check`` returns the ``_parameters`` of the module at ``owner``."""
    return f"{owner}#parameters"
