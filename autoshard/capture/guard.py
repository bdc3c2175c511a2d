"""The check at the start of a captured graph: are these inputs ones the plan was built for?

A capture bakes in the example's constant arguments and, where the front end specialised, some of
its shapes. Running the plan on other values would be silently wrong, so the graph's first node
checks every call and raises ``InputMismatchError`` naming what the plan accepts.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from autoshard.capture.guard_code import CHANNELS_LAST, CONDITION_NAMES, accepting
from autoshard.capture.structure import ArgumentStructure, Flattened, same_constant
from autoshard.errors import InputMismatchError, InvalidArgumentError, SpecializationMismatch, brief
from autoshard.isolation import HeldModule, grad_mode_checked


@dataclass(frozen=True)
class DimSpec:
    """One dimension of an input: a fixed size, or a named size (shared by the dims that must
    agree) within ``[low, high]``; ``high`` None is unbounded. Neither (``DimSpec()``): any size,
    where only the input's number of dimensions is fixed."""

    size: int | None = None
    symbol: str = ""
    low: int = 0
    high: int | None = None

    def describe(self) -> str:
        if self.size is not None:
            return str(self.size)
        if not self.symbol:
            return "any"
        bounds = [f">={self.low}"] if self.low > 0 else []
        bounds += [f"<={self.high}"] if self.high is not None else []
        return self.symbol + (" " + ",".join(bounds) if bounds else "")


@dataclass(frozen=True)
class InputGuard:
    """The inputs a captured graph accepts: its argument names, the constants it baked in, the
    layout of each container argument, the dtype of each tensor input (the capture answered dtype
    questions from the example), and the shapes it was specialised to (inputs without an entry
    accept any shape). A tensor inside a container is named by its path: ``d['x']``, ``xs[0]``."""

    names: tuple[str, ...]
    returns: tuple[str, ...]
    constants: Mapping[str, Any] = field(default_factory=dict)
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    shapes: Mapping[str, tuple[DimSpec, ...]] = field(default_factory=dict)
    structures: Mapping[str, ArgumentStructure] = field(default_factory=dict)
    #: Copies of the constants taken at capture, for those with an ``==``: the same object, changed
    #: in place since (``cfg.scale = 3.0``), is refused, as the plan computes with the old value.
    snapshots: Mapping[str, Any] = field(default_factory=dict)
    #: For a parameter the example left out whose default is a mutable object with an ``==`` (a list
    #: of flags): the default itself and a copy taken at capture. The plan computes with the copy's
    #: value, so a default changed in place since is refused (the check costs nothing without one).
    default_snapshots: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    #: Said after a size refused for being other than the fixed one: who fixed it, what to do.
    fixed_size_advice: str = ""
    #: Conditions on the sizes the capture relied on beyond their ranges (``x.shape[0] % 2 == 0``,
    #: where the code branched on it), as Python over ``L[name]``: torch.export's guards.
    conditions: tuple[str, ...] = ()
    #: Per tensor input, the facts torch.export answers from the example without a guard of its own
    #: (``if x.is_contiguous():``, ``if x.requires_grad:``): ``layout_of``. (Its class, whether it is a leaf
    #: and which inputs are one tensor, every capture answers so: the binder checks them, ``ExampleTensors``.)
    layouts: Mapping[str, TensorLayout] = field(default_factory=dict)
    #: The strides of each input, not contiguous, whose strides the model's code asked (``x.stride(-1)``),
    #: and the storage offset of each whose offset it asked (a copy's: 0), which torch.export answered from
    #: the example too (``capture.layout_reads``).
    strides: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    offsets: Mapping[str, int] = field(default_factory=dict)
    #: Conditions the traced code relied on later in the forward, on sizes it computed (a branch on a batch
    #: norm's output width), written over the inputs' sizes (``size_conditions``), each with what its check
    #: says when it fails: checked here, before anything computes, and by the check where it is.
    early: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        parts = []
        for name in self.names:
            if name in self.constants:
                parts.append(f"{name}={brief(self.snapshots.get(name, self.constants[name]))}")
            elif name in self.structures:
                structure = self.structures[name]
                parts += [self._tensor(name + path, leaf) if isinstance(leaf, torch.dtype)
                          else f"{name}{path}={brief(leaf)}" for path, leaf in zip(structure.paths, structure.leaves)]
            else:
                parts.append(self._tensor(name))
        conditions = [_shown(c) for c in (*self.conditions, *self.checked_early)]
        return ", ".join(parts) + (f"; where {' and '.join(conditions)}" if conditions else "")

    @property
    def checked_early(self) -> tuple[str, ...]:
        """The ``early`` conditions alone."""
        return tuple(condition for condition, _ in self.early)

    @functools.cached_property
    def accept(self) -> Callable[..., tuple[Any, ...] | None] | None:
        """The checks a passing call makes, written as code once (``guard_code.accepting``): the
        graph's inputs, or None where this walk must decide and name the problem."""
        return accepting(self, holds)

    def returned(self, named: Mapping[str, Any]) -> tuple[Any, ...]:
        """The graph's inputs among the call's arguments ``named`` by name."""
        return tuple(named[name] for name in self.returns)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and copied without ``accept``, which is code: written again where it is called."""
        return {name: value for name, value in self.__dict__.items() if name != "accept"}

    def _tensor(self, name: str, dtype: torch.dtype | None = None) -> str:
        """``name: float32 of shape (any, 8)``: a tensor argument (or a container's, whose dtype its layout
        holds and checks) as the guard checks it."""
        dtype = self.dtypes.get(name, dtype)
        text = f"{name}: {str(dtype).removeprefix('torch.')}" if dtype is not None else name
        if name in self.shapes:
            text += f" of shape ({', '.join(d.describe() for d in self.shapes[name])})"
        if self.layouts.get(name, _PLAIN_LAYOUT) != _PLAIN_LAYOUT:  # (said where it is not the usual one)
            text += f", {_layout(self.layouts[name])}"
        if name in self.strides:
            text += f", strides {self.strides[name]}"
        if name in self.offsets:
            text += f", at offset {self.offsets[name]} in its storage"
        return text

    def flattened(self, values: Mapping[str, Any]) -> dict[str, Flattened]:
        """The container arguments among ``values``, each flattened once for all of a call's checks."""
        return {name: structure.flattened(name, values[name]) for name, structure in self.structures.items()}

    def capture_problem(self, values: Mapping[str, Any], flat: Mapping[str, Flattened]) -> str | None:
        """What a capture made with these inputs would serve: a constant of another value than the
        example's, a container of another layout or holding other values than tensors (``flat``:
        the containers as ``flattened`` read them)."""
        for name, expected in self.constants.items():
            if values[name] is not expected:  # another object: to the value the plan computes with, that one's
                expected = self.snapshots.get(name, expected)  # at capture (the object may have changed since)
            if not same_constant(values[name], expected):
                array = (" with other values (an array is a constant to a capture, which computes with its values: "
                         "pass torch.from_numpy(array) for an input it serves)") * isinstance(expected, np.ndarray)
                return f"{name}={brief(values[name])}, but the plan was captured with {name}={brief(expected)}{array}"
        for name, structure in self.structures.items():
            problem = structure.layout_problem(name, flat[name])
            if problem:
                return problem
        return None

    def fixed_problem(self, values: Mapping[str, Any],
                      flat: Mapping[str, Flattened]) -> tuple[str | None, dict[str, Any]]:
        """What no capture for these inputs would change (a constant changed in place since, a
        tensor's storage offset), and the values with each container's tensors under their own names,
        for ``dtype_problem`` and ``size_problem``. Checked after ``capture_problem``: the containers
        have their layout."""
        for name in self.constants:
            if name in self.snapshots and not same_constant(values[name], self.snapshots[name]):
                return (f"{name} was changed in place since the plan was captured (now {brief(values[name])}, "
                        f"then {brief(self.snapshots[name])}), and the plan computes with the old value; pass a copy "
                        "of it, another object, which the sharded model captures again"), {}
        for name, (default, then) in self.default_snapshots.items():
            if not same_constant(default, then):
                return (f"the default of {name} was changed in place since the plan was captured "
                        f"(now {brief(default)}, then {brief(then)}), and the plan computes with the old value"), {}
        leaves = dict(values)
        for name, structure in self.structures.items():
            leaves.update(structure.leaf_values(name, flat[name].leaves))
        for name, offset in self.offsets.items():
            if isinstance(leaves[name], torch.Tensor) and leaves[name].storage_offset() != offset:
                return (f"{name} starts {leaves[name].storage_offset()} items into its storage, but the model's code "
                        f"asks where ({name}.storage_offset()), which the capture answered from a copy of the example "
                        f"starting at {offset}; pass {name}.clone()"), {}
        return None, leaves

    def dtype_problem(self, flat: Mapping[str, Flattened], leaves: Mapping[str, Any]) -> str | None:
        """A tensor of another dtype than the example's where the capture relied on it (int32 token ids,
        a bool mask): a capture made with these inputs serves them, as torch.compile compiles again."""
        for name, structure in self.structures.items():
            problem = structure.dtype_problem(name, flat[name].leaves)
            if problem:
                return problem
        for name, dtype in self.dtypes.items():
            value = leaves[name]
            if not isinstance(value, torch.Tensor) or value.dtype != dtype:
                got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                return f"{name} is {got}, but the plan was captured with {dtype}"
        return None

    def size_problem(self, values: Mapping[str, Any], leaves: Mapping[str, Any]) -> str | None:
        """A size, or a condition on sizes, the capture fixed that these inputs break (``values`` by
        argument, ``leaves`` with containers' tensors by path): another capture could serve them."""
        sizes: dict[str, int] = {}
        for name, dims in self.shapes.items():
            value = leaves[name]
            if not isinstance(value, torch.Tensor) or value.dim() != len(dims):
                return f"{name} is not a {len(dims)}-dimensional tensor"
            for axis, (size, dim) in enumerate(zip(value.shape, dims)):
                if dim.size is not None and size != dim.size:
                    return (f"{name}.shape[{axis}] is {size}, but the plan only serves "
                            f"{dim.size}{self.fixed_size_advice}")
                if dim.size is None and dim.symbol and sizes.setdefault(dim.symbol, size) != size:
                    seen = sizes[dim.symbol]
                    return f"{name}.shape[{axis}] is {size}, but {dim.symbol} is {seen} elsewhere"
                if dim.size is None and not (dim.low <= size and (dim.high is None or size <= dim.high)):
                    return f"{name}.shape[{axis}] is {size}, outside what the plan serves ({dim.describe()})"
        for name, layout in self.layouts.items():
            value = leaves[name]
            now = layout_of(value) if isinstance(value, torch.Tensor) else None
            if now != layout:
                return (f"{name} is {_layout(now) if now else 'no tensor'}, but the plan was captured with it "
                        f"{_layout(layout)} (torch.export answers the code's questions about that from the example)")
        for name, strides in self.strides.items():
            if tuple(leaves[name].stride()) != strides:
                return (f"{name} has strides {tuple(leaves[name].stride())}, but the plan was captured with strides "
                        f"{strides}, which the model's code asked ({name}.stride())")
        for condition in self.conditions:
            if not holds(condition, values):
                return (f"the plan was captured where {_shown(condition)}, which these inputs break: the model's "
                        "code branched on it or computed a count from it (torch.export kept that condition; the fx "
                        "front end may keep such code whole and serve both sides: shard with "
                        f"pipeline='{FREE_SIZES_PIPELINE}')")
        for condition, refusal in self.early:
            if not holds(condition, values):
                return f"{refusal} (checked before any stage computes, as {_shown(condition)})"
        return None


class TensorLayout(NamedTuple):
    """What torch.export answers about a tensor input from the example besides its dtype and shape: whether
    it requires grad, is contiguous, and is channels-last contiguous (4-D or 5-D)."""

    requires_grad: bool
    contiguous: bool
    channels_last: bool


#: An input's usual layout: not requiring grad, contiguous.
_PLAIN_LAYOUT = TensorLayout(False, True, False)


def layout_of(t: torch.Tensor) -> TensorLayout:
    channels_last = CHANNELS_LAST.get(t.dim())
    last = channels_last is not None and t.is_contiguous(memory_format=channels_last)
    return TensorLayout(t.requires_grad, t.is_contiguous(), last)


def tensor_class(t: torch.Tensor) -> type:
    """``t``'s class, which the model's code may ask (``isinstance(x, nn.Parameter)``, a subclass of its own);
    torch's own tracing tensors (fake, functional) stand for a plain tensor."""
    kind = type(t)
    return torch.Tensor if kind.__module__.startswith("torch._") else kind


def one_tensor_groups(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], ...]:
    """The names of ``tensors`` grouped by the tensor object they name, in order: ``(("x", "y"), ("z",))``
    where ``x`` and ``y`` are one tensor."""
    groups: dict[int, list[str]] = {}
    for name, value in tensors.items():
        groups.setdefault(id(value), []).append(name)
    return tuple(map(tuple, groups.values()))


def _layout(layout: TensorLayout) -> str:
    laid = ("contiguous" if layout.contiguous else "channels-last" if layout.channels_last
            else "neither contiguous nor channels-last")
    return f"{'requiring grad' if layout.requires_grad else 'not requiring grad'}, {laid}"


#: What an evaluated condition may use: ``CONDITION_NAMES``, no builtins.
_CONDITION_NAMES = {"__builtins__": {}, **CONDITION_NAMES}


def holds(condition: str, values: Mapping[str, Any]) -> bool:
    """Whether ``condition`` (Python over sizes, ``L['x'].size()[0] % 2 == 0``) is true of ``values``, the
    arguments by name; one that cannot be evaluated (a division by a size that is zero here) does not hold."""
    try:
        return bool(eval(_compiled(condition), _CONDITION_NAMES, {"L": values}))  # noqa: S307 - torch's own guard text
    except Exception:  # noqa: BLE001
        return False


def _compiled(condition: str) -> CodeType:
    """``condition`` compiled, once: ``eval`` of the text compiled it again on every call, for every
    condition (97.8k instructions a call for ``L['x'].size()[0] % 2 == 0``, 5.0k compiled once). Kept in a
    dict, not an ``lru_cache``, which torch.compile warns of when it traces a refused call (the conditions
    are the plans' guard texts, a handful each)."""
    code = _COMPILED.get(condition)
    if code is None:
        code = _COMPILED[condition] = compile(condition, "<string>", "eval")
    return code


_COMPILED: dict[str, CodeType] = {}


def _shown(condition: str) -> str:
    """``L['x'].size()[0] % 2 == 0`` as ``x.shape[0] % 2 == 0``, and sympy's ``(-4) + x.shape[3]`` as
    ``x.shape[3] - 4`` where no operator binding tighter than ``+`` is on either side."""
    text = re.sub(r"L\['([^']+)'\]", r"\1", condition).replace(".size()[", ".shape[")
    return _NEGATIVE_FIRST.sub(r"\1\3 - \2", text)


#: ``(-4) + x.shape[3]`` after the start, a parenthesis, an addition, a comparison, ``and`` or ``or``,
#: and before no ``*``, ``/``, ``%`` or ``@``.
_NEGATIVE_FIRST = re.compile(r"(^|\(|[+<>=!]=? |and |or )\(-(\d+)\) \+ ([\w.]+(?:\['[^']*'\])*\.shape\[\d+\])"
                             r"(?!\s*[*/%@])")


def usable_conditions(conditions: Sequence[str], values: Mapping[str, Any]) -> tuple[str, ...]:
    """The conditions worth checking on every call: those true of the example (``values``), less
    the ones that only say a size is not 0 or 1 (``!= 1``, ``>= 2``), which torch.export assumes
    of every size it keeps generic (the plan serves those sizes, as the ranges do), and the ones
    that fix a size (``== 4``), which the shapes check already."""
    trivial = (ASSUMED_OF_EVERY_SIZE, _FIXES_A_SIZE)
    return tuple(c for c in conditions if not any(t.fullmatch(c.strip()) for t in trivial) and holds(c, values))


#: A condition torch's ``ShapeEnv`` assumes of every size it keeps symbolic: that it is not 0 or 1.
ASSUMED_OF_EVERY_SIZE = re.compile(r".*(!= [01]|>= [12])")
#: A condition fixing a size (``L['x'].size()[0] == 4``).
_FIXES_A_SIZE = re.compile(r"L\['[^']+'\]\.size\(\)\[\d+\] == \d+")


#: ``InputGuard.flattened`` of a call without container arguments (read, never written).
_NO_CONTAINERS: Mapping[str, Flattened] = {}


def check_inputs(guard: InputGuard, *values: Any) -> tuple[Any, ...]:
    """Raise ``InputMismatchError`` unless the plan serves ``values``; return the graph inputs.
    A call the guard's written checks pass (``InputGuard.accept``) is served by them."""
    accept = guard.accept
    passed = None if accept is None else accept(*values)
    return walked_inputs(guard, *values) if passed is None else passed


def walked_inputs(guard: InputGuard, *values: Any) -> tuple[Any, ...]:
    """``check_inputs`` by a walk over the guard's fields, which names what a refused call breaks."""
    named = dict(zip(guard.names, values))
    flat = guard.flattened(named) if guard.structures else _NO_CONTAINERS  # most calls pass tensors only
    problem = guard.capture_problem(named, flat)
    if problem is None:
        problem, leaves = guard.fixed_problem(named, flat)
        if problem:
            raise InputMismatchError(
                f"these inputs do not fit the sharded plan: {problem}. The plan serves {guard.describe()}; "
                "shard the model again with an example like these inputs")
        problem = guard.dtype_problem(flat, leaves) or guard.size_problem(named, leaves)
    if problem:
        raise SpecializationMismatch(
            f"these inputs do not fit the sharded plan: {problem}. The plan serves {guard.describe()}; "
            "shard the model again with an example like these inputs", before_compute=True)
    return guard.returned(named)


def check_condition(actual: Any, expected: bool, condition: str) -> None:
    """A condition the capture fixed to its example value: refuse inputs that flip it. Asked as a branch,
    not compared with ``expected``: under torch.compile with a dynamic size ``actual`` is a symbolic
    bool, on which a branch makes a guard and ``!=`` failed in sympy (``BooleanAtom not allowed``)."""
    if (not actual) if expected else actual:
        raise SpecializationMismatch(
            f"{condition} is {not expected} for these inputs, but was {expected} when the sharded plan "
            "was captured; shard the model again with an example input like these", site=condition)


#: The pipeline whose fx capture keeps code that needs a size's value whole, and the size free.
FREE_SIZES_PIPELINE = "trace,shape-prop,build-dag,linearize,split,emit,verify"


def check_asserted(condition: Any, message: str) -> None:
    """``torch.ops.aten._assert_scalar`` as a capture's graph calls it: a condition the model's code
    asserted of its inputs (``torch._check``, a count from their values that torch.export kept as a
    check). A call that breaks it is one another capture may serve, or one the model itself refuses:
    a ``SpecializationMismatch``, on which a sharded model captures again (and a capture the model
    refuses raises the model's own error), where torch raised a RuntimeError from inside a stage. A
    symbolic condition (a fake or meta run) goes to torch's op, which records it."""
    if isinstance(condition, torch.SymBool):
        torch.ops.aten._assert_scalar.default(condition, message)
    elif not condition:
        asserted = message.removeprefix("Runtime assertion failed for expression ")
        raise SpecializationMismatch(
            f"these inputs break a condition the model's code asserted of the example's (torch.export kept the "
            f"check: {asserted}); the model may refuse them too; shard the model again with an example like these",
            site=message)


def check_pinned_size(size: int, expected: int, site: str, top_level: bool = False) -> None:
    """A size the code turned into a Python number, fixed to the example's: refuse others.

    ``top_level``: the code is in the model's own forward, which no front end can keep whole."""
    if size != expected:
        free = ("move that code into a submodule, which can be kept whole with the size free, and shard with "
                if top_level else "keep that code whole and the size free: shard with ")
        raise SpecializationMismatch(
            f"the code at {site} turns a size into a Python number, which fixed it to {expected} when the "
            f"sharded plan was captured, and these inputs make it {size}; shard again with an example of this "
            f"size, or, if the model serves other sizes, {free}pipeline='{FREE_SIZES_PIPELINE}'", site=site)


#: The checks a capture leaves where the model's code relied on its example's sizes or values, by the
#: position of the argument saying where (the site, which the refusal carries): ``check_order`` runs them
#: as early as what they read allows, and ``specialize.rerun_of`` walks a refusing stage up to its check.
CHECK_SITE_ARGUMENT: dict[Callable[..., None], int] = {check_condition: 2, check_asserted: 1, check_pinned_size: 2}

#: The checks the fx front end leaves on sizes (``size_conditions`` writes them over the inputs' sizes).
SIZE_CHECKS = (check_condition, check_pinned_size)


def check_site(node: torch.fx.Node) -> str | None:
    """The site of the check ``node`` calls (``CHECK_SITE_ARGUMENT``), or None where it calls none."""
    if node.op != "call_function" or node.target not in CHECK_SITE_ARGUMENT:
        return None
    return node.args[CHECK_SITE_ARGUMENT[node.target]]


def check_grad_mode(captured: bool, site: str) -> None:
    """Code that chose its path by the grad mode, called in the other mode: refuse it. A capture made
    in that mode serves it (a ``SpecializationMismatch``: a sharded model re-specialises on it)."""
    if grad_mode_checked() and torch.is_grad_enabled() != captured:
        was, now = ("enabled", "disabled") if captured else ("disabled", "enabled")
        raise SpecializationMismatch(
            f"{site} chose its path by the grad mode, which was {was} when the plan was captured and is {now} "
            f"now; call the stages with grad {was}, or shard the model again "
            f"{'under torch.no_grad()' if captured else 'with grad enabled'} to call it so")


def check_inference_mode(captured: bool, site: str) -> None:
    """Code that chose its path by whether ``torch.inference_mode`` is on, called in the other mode: refuse
    it. A capture made in that mode serves it (a ``SpecializationMismatch``: a sharded model re-specialises)."""
    if torch.is_inference_mode_enabled() != captured:
        was, now = ("on", "off") if captured else ("off", "on")
        raise SpecializationMismatch(
            f"{site} chose its path by whether torch.inference_mode is on, which was {was} when the plan was "
            f"captured and is {now} now; call the stages {'under' if captured else 'outside'} torch.inference_mode(), "
            f"or shard the model again {'outside' if captured else 'under'} it to call it so")


AUTOCAST_DEVICES = ("cpu", "cuda")
"""The device types whose ``torch.autocast`` state a capture records and a stage checks."""

AutocastState = tuple[tuple[bool, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """Whether ``torch.autocast`` is on, and in which dtype, per device type of ``AUTOCAST_DEVICES``."""
    return tuple([(_autocast_enabled(device), _autocast_dtype(device)) for device in AUTOCAST_DEVICES])


# bound once: a stage asks them on every call (under autocast: 1.1 us a stage, 1.5 us read through ``torch.``)
_any_autocast, _autocast_enabled, _autocast_dtype = (
    torch._C._is_any_autocast_enabled, torch.is_autocast_enabled, torch.get_autocast_dtype)


def autocast_now() -> AutocastState | None:
    """``autocast_state``, or None where no autocast is on (one C call, the common case)."""
    return autocast_state() if _any_autocast() else None


def _autocast_words(state: AutocastState | None) -> str:
    on = [f"torch.autocast({device!r}, dtype={dtype})"
          for device, (enabled, dtype) in zip(AUTOCAST_DEVICES, state or ()) if enabled]
    return " and ".join(on) if on else "no torch.autocast"


def check_autocast(captured: AutocastState | None) -> None:
    """A stage called under another ``torch.autocast`` state than its plan was captured in: refuse it.
    Autocast changes the dtypes the model's code computes in, and the capture answered its questions
    about them (``h.dtype``, ``x.to(input_dtype)``) once; a capture under the call's state serves it
    (a ``SpecializationMismatch``: a sharded model re-specialises on it)."""
    # off, as captured: one C call and nothing more to read
    if (_any_autocast() or captured is not None) and autocast_now() != captured:
        raise SpecializationMismatch(
            f"the plan was captured under {_autocast_words(captured)} and is called under "
            f"{_autocast_words(autocast_now())}: autocast changes the dtypes the model's code computes in, which "
            "the capture fixed; call the stages as the plan was captured, or shard the model again as it is called",
            before_compute=True)


def captured_autocast(graphs: Iterable[torch.fx.GraphModule]) -> AutocastState | None:
    """The autocast state the graphs were captured in (their ``check_autocast`` guards)."""
    return next((node.args[0] for gm in graphs for node in gm.graph.nodes
                 if node.op == "call_function" and node.target is check_autocast), None)


def chosen_grad_mode(graphs: Iterable[torch.fx.GraphModule]) -> bool | None:
    """The grad mode the graphs' code chose its path by (their ``check_grad_mode`` guards), None
    where no code asked: those serve either mode."""
    return next((node.args[0] for gm in graphs for node in gm.graph.nodes
                 if node.op == "call_function" and node.target is check_grad_mode), None)


def run_forward_hooks(held: HeldModule, args: tuple, kwargs: dict, output: Any) -> Any:
    """A traced-through module's forward hooks, in the order and with the arguments its call would
    give them (``nn.Module._call_impl``), after its body: they run on every call with the real values,
    as a kept-whole module's would, and a hook's return value replaces the output. Read at run time,
    so a hook removed since the capture no longer runs."""
    module = held.module
    for hook_id, hook in tuple(module._forward_hooks.items()):
        result = (hook(module, args, kwargs, output) if hook_id in module._forward_hooks_with_kwargs
                  else hook(module, args, output))
        if result is not None:
            output = result
    return output


def check_detached_mode(held: HeldModule, captured: bool) -> None:
    """A module outside the model's tree switched to another mode since capture: refuse the call."""
    if held.module.training != captured:
        was, now = ("train", "eval") if captured else ("eval", "train")
        raise InputMismatchError(
            f"a {type(held.module).__name__} the model keeps outside its module tree (in a list, a dict or a "
            f"global) was in {was} mode when the plan was captured and is in {now} mode now; its code (a dropout) "
            f"was fixed at capture: switch it back, or register it as a submodule (nn.ModuleList) so that the "
            "model's eval() and train() reach it, and shard again")


def check_mode(training: bool, captured: bool, modules: tuple[bool, ...] = (),
               modules_captured: tuple[bool, ...] = ()) -> None:
    """A stage called in another mode than its model was captured in: refuse it. ``modules``
    are the modes of the modules the stage calls, which ``model.eval()`` switches without it,
    and ``modules_captured`` theirs at capture (a frozen batch norm may be in eval in training):
    switched, another capture of the model serves them (``SpecializationMismatch``)."""
    if training == captured and tuple(modules) != tuple(modules_captured):
        raise SpecializationMismatch(
            "some of the modules the stage calls were switched to another mode after sharding (model.eval() or "
            f"model.train()), while the plan was captured with the model in {'train' if captured else 'eval'} "
            "mode; switch the modules back, or shard the model again in the mode to run", before_compute=True)
    if training != captured:
        was, now = ("train", "eval") if captured else ("eval", "train")
        raise InputMismatchError(
            f"the plan was captured in {was} mode and is called in {now} mode: code that reads "
            f"self.training (dropout rates, batch-norm branches) was fixed to {was} mode; shard the "
            f"model again after model.{now}(), or put the stages back in {was} mode")


def refuse_mode_switch(captured: bool, mode: bool) -> None:
    """``module.train(mode)`` on a stage or sharded model captured in the other mode: refused before
    anything switches (they hold the model's own modules, which ``nn.Module.train`` would switch,
    leaving the model half in each mode), since the plan serves only the mode it was captured in."""
    if bool(mode) != captured:
        was, now = ("train", "eval") if captured else ("eval", "train")
        raise InputMismatchError(
            f"the plan was captured in {was} mode and serves only it (code reading self.training was "
            f"fixed); shard the model again after model.{now}() for a plan in {now} mode")


def _converts(dtype: torch.dtype) -> bool:
    """Whether ``Module.to(dtype)``, ``half()`` and friends convert tensors of this dtype."""
    return dtype.is_floating_point or dtype.is_complex


def weight_dtypes(held: Sequence[torch.Tensor]) -> frozenset[torch.dtype]:
    """The dtypes among ``held`` that a conversion would convert (floating, complex). Buffers are
    not held here: a module may fill a cache of its own dtype on its first call (rotary tables in
    float32 beside bfloat16 weights)."""
    return frozenset(t.dtype for t in held if _converts(t.dtype))


def _convert_first(dtype: torch.dtype) -> str:
    """The advice for a plan asked to run in ``dtype``: convert the model, then shard it."""
    return f"convert the model first (model.to({dtype})), then shard it"


def check_weight_dtypes(captured: frozenset[torch.dtype], *held: torch.Tensor) -> None:
    """A stage whose weights were converted after sharding (``model.half()``): refuse it. The capture
    answered the code's questions about their dtype (``x.to(self.weight.dtype)``,
    ``torch.finfo(h.dtype).min``) once, so the stage would compute in the old dtype or fail. (A
    buffer a module fills or empties between calls, a cache, may come and go.)"""
    now = weight_dtypes(held)
    if not now <= captured:
        def named(dtypes: frozenset[torch.dtype]) -> str:
            return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise InputMismatchError(
            f"the stage's weights are {named(now)}, but the plan was captured with {named(captured)} weights, whose "
            "dtype the model's code may have read (x.to(self.weight.dtype)); "
            + _convert_first(min(now - captured, key=str)))


class FixedDtypes(torch.nn.Module):
    """A stage or sharded model refuses a conversion of its weights to another dtype (``half()``,
    ``to(torch.bfloat16)``) before converting anything; moves to another device go through. Its
    weights are the model's own: converting them would convert the model's parameters but not the
    buffers the stages hold apart, and the plan computes in the dtypes it was captured with."""

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        held = {t.dtype for t in (*self.parameters(), *self.buffers()) if _converts(t.dtype)}
        for dtype in held:
            converted = fn(torch.empty(0, dtype=dtype))
            if isinstance(converted, torch.Tensor) and converted.dtype != dtype:
                raise InvalidArgumentError(
                    f"a sharded plan keeps the dtypes it was captured with ({str(dtype).removeprefix('torch.')} "
                    f"here, not {str(converted.dtype).removeprefix('torch.')}): " + _convert_first(converted.dtype))
        self.__dict__.pop(PLACED_ON, None)  # a move: where the weights are is found again
        return super()._apply(fn, recurse)


#: Where a stage keeps the device of its weights once found (``autoshard.sharded.stage_device``).
PLACED_ON = "_autoshard_placed_on"
