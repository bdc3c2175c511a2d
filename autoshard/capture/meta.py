"""An fx tracer that runs the example alongside, so shape and dtype code traces (its proxies,
which answer from the example: ``meta_proxy``).

Plain fx fails on code every real model has: ``(*x.shape[:-1], -1, d)`` (a Proxy cannot be
iterated), ``if mask.dtype == torch.bool`` (a Proxy cannot be a condition), a config passed to a
helper (fx rebuilds dataclasses from their fields and loses private settings). With the example
value of every node at hand, the tracer answers what does not change between calls and keeps the
rest symbolic:

* ``dtype``, ``device``, ``ndim``, ``dim()``, ``torch.is_tensor`` and ``callable`` come from the example;
  ``x.shape`` iterates as one symbolic size per dimension, so sizes stay symbolic and the graph
  serves other shapes (``torch.tensor(size)`` becomes a node);
* a condition computed from sizes alone (``if seq_len > 1``) takes its example value, and a guard
  node in the graph refuses later inputs that would flip it (``InputMismatchError``);
* conditions on tensor *values* still fail, which is what makes a module or function a leaf;
* objects without proxies inside (configs) are kept as constants, never rebuilt; a dataclass
  with proxies inside (a ``ModelOutput``) is rebuilt as its own type, and so is an ``OrderedDict``;
* an example tensor that reaches the code without its proxy (a leaf's forward hook saw the real
  output) stands for the node that computed it, never for a constant holding the example's data,
  and so do the torch operations the code runs on it (they are traced on that node's proxy);
* code that enters or leaves a ``torch.autocast`` region, or rebinds a parameter or buffer to a
  computed value (``self.steps += 1``), is untraceable (fx would drop the region or the write), so
  it is kept whole.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import functools
import os
import sys
import traceback
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.fx as fx
import torch.fx._symbolic_trace as fx_trace
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from autoshard.capture.attribute_reads import AttributeReads
from autoshard.capture.grad_mode import GradModeReader
from autoshard.capture.guard import (autocast_state, check_condition, check_grad_mode, check_inference_mode,
                                     check_pinned_size)
from autoshard.capture.leaves import MACHINERY_DIRS, TORCH_DIR
from autoshard.capture.meta_proxy import (
    DATA_FREE, EXAMPLE, MISSING, MetaProxy, SizePinningProxy, example_of, is_size)
from autoshard.capture.signature import MODEL_ATTR
from autoshard.capture.state import is_real_run, kind_of, refusing_state_writes
from autoshard.errors import TraceError
from autoshard.fx_helpers import resolve
from autoshard.generators import generator_states
from autoshard.isolation import clear_trace_values, holds


#: Reading these yields sizes, not tensor values.
_SIZE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension"})
#: autoshard's own code: the tracer reading the example values it keeps is not the model's code.
_AUTOSHARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: torch's dispatch and tracing code, between a caller and the torch function it calls (not torch's
#: modules and functionals, which a trace goes through as the model's code).
_TORCH_MACHINERY = tuple(path for path in MACHINERY_DIRS if path.startswith(TORCH_DIR + os.sep))
_SIZE_ATTRS = frozenset({"shape", "ndim", "dtype", "device"})
#: Opaque results used as their example value (an int may be a size, so it stays symbolic).
_GUARDED_RESULTS = (bool, str, type(None))


@contextlib.contextmanager
def _untraced(swaps: list["Swap"], modules: bool = True) -> Iterator[None]:
    """Lift fx's patches on ``nn.Module`` (``modules``) and the tracer's ``swaps`` while running an
    example: the run adds no nodes, and code it reaches sees the real functions (torch.compile's
    tracer, run by a ``torch.cond`` inside a leaf, builds its tables of builtins once and for all).
    Setting an attribute of ``nn.Module`` costs about a millisecond (the interpreter forgets what it
    knew of every subclass's attributes): a leaf that calls no module (``_calls_no_module``) runs
    with them in place, its weights read through the tracer's ``getattr``, which an example run
    passes through."""
    patched = (nn.Module.__call__, nn.Module.__getattr__, fx_trace._is_fx_tracing_flag)
    if modules:
        nn.Module.__call__, nn.Module.__getattr__ = fx_trace._orig_module_call, fx_trace._orig_module_getattr
    fx_trace._is_fx_tracing_flag = False
    try:
        with _swapped(swaps, back=True):
            yield
    finally:
        if modules:
            nn.Module.__call__, nn.Module.__getattr__ = patched[:2]
        fx_trace._is_fx_tracing_flag = patched[2]


def _calls_no_module(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` calls a ``torch.nn`` module without submodules or hooks (a ``LayerNorm``, a
    ``Dropout``), whose example run calls no other module."""
    if node.op != "call_module":
        return False
    module = root.get_submodule(str(node.target))
    hooks = module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    return type(module).__module__.startswith("torch.nn.") and not module._modules and not hooks


def _runs_model_code(node: fx.Node) -> bool:
    """Whether running the node may reach into modules (a leaf, an attribute, a wrapped function)."""
    if node.op in ("call_module", "get_attr"):
        return True
    target = node.target
    return node.op == "call_function" and isinstance(target, types.FunctionType) and \
        not target.__module__.startswith("torch")


def _user_site(machinery: tuple[str, ...] = MACHINERY_DIRS) -> str | None:
    """``file:line (`source`)`` of the innermost frame of the model's code (outside ``machinery``)."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(machinery):
            source = (frame.line or "").strip().split("  # ")[0]
            return f"{os.path.basename(frame.filename)}:{frame.lineno} (`{source}`)"
    return None


def _user_condition() -> str:
    site = _user_site()
    return f"the condition at {site}" if site else "a condition in the model's code"


class ModeRegion(RuntimeError):
    """Model code entered or left a ``torch.autocast`` region or a grad-mode block (``no_grad``,
    ``enable_grad``, ``inference_mode``) while fx traced it. Not a ``TraceError``: the code is kept
    whole (run as it is) like any other untraceable code."""


def _mode_state() -> tuple[Any, ...]:
    """The modes fx does not record: autocast (on, and in which dtype, per device type), grad
    mode and inference mode."""
    return autocast_state(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _mode_change(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """What model code changed between two ``_mode_state``s, in words."""
    if before[0] != after[0]:
        return "an autocast region (torch.autocast) starts or ends here"
    return "a grad-mode block (torch.no_grad, enable_grad, set_grad_enabled, inference_mode) starts or ends here"


class RandomDraw(RuntimeError):
    """Model code drew random numbers for real while fx traced it (no proxy among the arguments:
    ``torch.rand(()) < p`` choosing layers to drop). The graph would keep the draw as a constant,
    the same on every call, so the code is kept whole. Not a ``TraceError``."""


class _RealCalls(TorchFunctionMode):
    """Watches the torch functions run for real during the trace (no proxy in their arguments;
    the tracer's runs of its examples are exempt):

    * one the model's code calls on an example value that stands for a node (a leaf's output a
      forward hook saw) runs on that node's proxy instead: what torch computes from it (SegFormer's
      decode head flattens and transposes the hidden states Transformers recorded) is a node too,
      never a constant holding the example's data, as the value itself is (``create_arg``);
    * what one computes from a tensor made inside a leaf's example run (no node stands for it) is
      noted as made there too, so ``create_arg`` refuses it as it refuses that tensor;
    * one that moves a random generator raises ``RandomDraw``."""

    def __init__(self, tracer: "MetaTracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.running_examples or has_proxy((args, kwargs)):
            return func(*args, **kwargs)
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(tracer.stands_for(t) is not None for t in tensors) and _called_by_model_code():
            args, kwargs = tree_map(tracer.standing_proxy, (args, kwargs))
            return _traced_call(func, args, kwargs)
        before = generator_states()
        result = func(*args, **kwargs)
        if before != generator_states():
            raise RandomDraw(f"{getattr(func, '__name__', func)} draws random numbers outside the graph: the "
                             "graph would keep them as a constant, the same on every call")
        inside = next((where for where in map(tracer.made_inside, tensors) if where is not None), None)
        if inside is not None:
            tracer.note_made_inside(result, inside)
        return result


#: torch's functions that seed or set the default random generators.
_SEEDING = ("manual_seed", "seed", "set_rng_state")


def _seeding_kept_whole(function: Callable[..., Any], tracer: "MetaTracer") -> Callable[..., Any]:
    """``function`` (``_SEEDING``) that, called by the model's traced code, raises ``RandomDraw``: the graph
    would not seed the generators, so its later draws would differ from the model's (the code is kept
    whole, and seeds as it runs)."""
    @functools.wraps(function)
    def seeding(*args: Any, **kwargs: Any) -> Any:
        if not (tracer.running_examples or is_real_run()) and _called_by_model_code():
            raise RandomDraw(f"torch.{function.__name__} sets the random generators outside the graph: the graph "
                             "would not, and its later draws would differ from the model's")
        return function(*args, **kwargs)
    return seeding


def _called_by_model_code() -> bool:
    """Whether the code that called a torch function (past torch's dispatch) is the model's, not the
    tracer's own (which reads the examples it keeps: their sizes, their truth)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_MACHINERY):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(_AUTOSHARD_DIR)


def _traced_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` called with proxies among its arguments, as the code would have called it: a tensor
    property or method read off the proxy (which answers sizes and static facts from its example)."""
    if isinstance(getattr(func, "__self__", None), types.GetSetDescriptorType):  # a property: x.shape
        return getattr(args[0], func.__self__.__name__)
    if torch.overrides.is_tensor_method_or_property(func) and args and isinstance(args[0], fx.Proxy):
        return getattr(args[0], func.__name__)(*args[1:], **kwargs)
    return func(*args, **kwargs)


def _computed_in_trace(module: nn.Module, name: str, value: Any) -> bool:
    """Whether an fx trace assigns a value it computed: any proxy bound to a parameter or buffer,
    or one that depends on tensor data bound to a plain attribute. Sizes stored on self (Swin's
    window size) are recomputed by the graph on every call, so they pass (and capture takes them
    off again)."""
    if kind_of(module, name) != "attribute":
        return holds(value, fx.Proxy)
    return _holds_data(value)


def _holds_data(value: Any) -> bool:
    """Whether ``value`` holds a proxy whose value depends on tensor data, not only on sizes."""
    return any(isinstance(leaf, fx.Proxy) and not leaf.node.meta.get(DATA_FREE, False)
               for leaf in tree_leaves(value))


def _is_tensor(obj: Any) -> bool:
    """``torch.is_tensor`` that answers for a proxy from its example: model code that turns a
    non-tensor argument into one (``if not torch.is_tensor(t): t = torch.tensor([t])``, as
    diffusers' UNets do) would otherwise take that branch with a tensor proxy and fail."""
    if isinstance(obj, fx.Proxy):
        return isinstance(example_of(obj), torch.Tensor)
    return isinstance(obj, torch.Tensor)


def _callable(obj: Any, _builtin: Callable[[Any], bool] = callable) -> bool:
    """``callable`` that answers for a proxy from its example: a proxy is always callable (fx
    records the call), so ``d() if callable(d) else d`` (x-transformers' ``default``) would call
    a tensor."""
    if isinstance(obj, fx.Proxy):
        example = example_of(obj)
        return _builtin(obj) if example is MISSING else _builtin(example)
    return _builtin(obj)


#: Tensor constructors whose data argument may hold a size: ``torch.tensor(x.shape[-1])``; and those taking
#: sizes as separate arguments, which torch's argument parser refuses as proxies before fx sees the call:
#: ``torch.ones(batch_size, seq_length)`` (Switch Transformers' and T5-style decoders' default mask) kept
#: the whole decoder one leaf.
_CONSTRUCTORS = ("tensor", "as_tensor", "scalar_tensor", "ones", "zeros", "empty", "rand", "randn")


def _recording_constructor(constructor: Callable[..., Any]) -> Callable[..., Any]:
    """``constructor`` that, given a proxy (a size), records a node instead of failing: torch
    would try to read the proxy as an array. ``x / torch.sqrt(torch.tensor(d))`` is everywhere."""
    @functools.wraps(constructor)
    def record(*args: Any, **kwargs: Any) -> Any:
        proxies = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, fx.Proxy)]
        if not proxies:
            return constructor(*args, **kwargs)
        return proxies[0].tracer.create_proxy("call_function", constructor, args, kwargs)
    return record


class FunctionApply:
    """The node target that calls a custom ``torch.autograd.Function``: tracing into its
    ``forward`` would record the forward's operations and lose its ``backward`` (a gradient
    reversal, a straight-through estimator), so the call is one node."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        self.function = function
        self.__name__ = f"{function.__name__}_apply"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"


def _recording_apply(original: classmethod) -> classmethod:
    """``torch.autograd.Function.apply`` that records one ``FunctionApply`` node when given a proxy.
    torch's own functions (the reentrant checkpoint, which takes a function argument) are traced
    through as before: their backward recomputes what the forward computed."""

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        proxies = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, fx.Proxy)]
        if not proxies:
            return original.__func__(cls, *args, **kwargs)
        tracer = proxies[0].tracer
        if not cls.__module__.startswith("torch."):
            return tracer.create_proxy("call_function", FunctionApply(cls), args, kwargs)
        if cls is torch.utils.checkpoint.CheckpointFunction:
            tracer.note_checkpoint()
        tracer.inside_torch_functions += 1  # its own no_grad (the checkpoint's) is not the model's
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            tracer.inside_torch_functions -= 1

    return classmethod(apply)


class CheckpointTracedWarning(UserWarning):
    """The model's own activation checkpoints (``torch.utils.checkpoint``) were traced through."""


def warn_checkpoints_traced(model_name: str, sites: list[str]) -> None:
    """Say that the stages keep what the model's checkpoints recompute, and what to do instead."""
    if sites:
        warnings.warn(
            f"{model_name} calls torch.utils.checkpoint ({', '.join(sites)}): the capture traces through it, so "
            "the stages run that code plainly and keep the activations the checkpoint would recompute "
            "(plan_report and max_memory count them). To recompute them in a pipeline, train through "
            "autoshard.runtime.parallelize(..., activation_checkpointing=True) and plan with "
            "MemoryModel(activation_checkpointing=True)", CheckpointTracedWarning, stacklevel=4)


def _noting_checkpoint(generator: Callable[..., Any], tracer: "MetaTracer") -> Callable[..., Any]:
    """The non-reentrant checkpoint's generator, noting a checkpoint traced through (one given proxies)."""

    @functools.wraps(generator)
    def noting(*args: Any, **kwargs: Any) -> Any:
        if has_proxy((args, kwargs)):
            tracer.note_checkpoint()
        return generator(*args, **kwargs)

    return noting


#: ``(owner, name, original, stand-in)``: an attribute the tracer replaces while it traces.
Swap = tuple[Any, str, Any, Any]


@contextlib.contextmanager
def _swapped(swaps: list[Swap], back: bool = False) -> Iterator[None]:
    """Each stand-in in place until exit (with ``back``, each original: lifted for a real run)."""
    for owner, name, original, stand_in in swaps:
        setattr(owner, name, original if back else stand_in)
    try:
        yield
    finally:
        for owner, name, original, stand_in in swaps:
            setattr(owner, name, stand_in if back else original)


def rebuildable_base(value: Any) -> type | None:
    """The base of a subclass of tuple, list or dict made with its base's constructor (``class
    Outputs(tuple): pass``), which ``rebuilt_container`` makes again; None for anything else (a
    NamedTuple, fx's own containers, a ``defaultdict``, a class with a constructor of its own)."""
    cls = type(value)
    if cls in (tuple, list, dict) or hasattr(value, "_fields") or cls.__module__.startswith(("torch.", "collections")):
        return None
    base = next((b for b in (tuple, list, dict) if isinstance(value, b)), None)
    if base is None or cls.__new__ is not base.__new__ or cls.__init__ is not base.__init__:
        return None
    return base


def rebuilt_container(cls: type, items: Any, attributes: dict[str, Any]) -> Any:
    """An instance of ``cls`` (``rebuildable_base``) holding ``items``, with ``attributes`` as its own."""
    made = cls(items)
    if attributes:
        vars(made).update(attributes)
    return made


def has_proxy(value: Any) -> bool:
    """Whether a Proxy hides anywhere in ``value`` (containers, dataclass fields, slices)."""
    return holds(value, fx.Proxy)


class _Weights:
    """A root's parameters and buffers: ``id -> first qualified name``, and ``name -> tensor``."""

    def __init__(self, parameters: list[tuple[str, torch.Tensor]],
                 buffers: list[tuple[str, torch.Tensor]]) -> None:
        self.parameter_names = {id(t): n for n, t in reversed(parameters)}
        self.buffer_names = {id(t): n for n, t in reversed(buffers)}
        self.by_name = dict(parameters + buffers)


class MetaTracer(fx.Tracer):
    """An fx tracer that records every node's example value while tracing (see the module doc).

    ``examples`` maps placeholder names to their example values; None traces without examples,
    exactly like plain fx apart from keeping constants as constants. ``read_static_facts`` says
    whether the trace answered a dtype (or other static) question from the examples, which makes
    the graph valid only for inputs of the example's dtypes.
    """

    def __init__(self, examples: Mapping[str, Any] | None, pin_sizes: bool = False) -> None:
        super().__init__()
        self.examples = examples
        self.pin_sizes = pin_sizes
        self.constants: dict[str, Any] = {}
        self.specialized: list[str] = []
        self.checkpoints: list[str] = []  # where the model's own activation checkpoints were traced through
        self.read_static_facts = False
        #: the placeholders whose ``grad_fn`` or ``is_leaf`` the code asked (``TraceResult.leafness_asked``)
        self.leafness_asked: set[str] = set()
        self._weights: _Weights | None = None
        self._computed: dict[int, fx.Node] = {}  # id of an example tensor -> the latest node that made it
        self._inside: dict[int, tuple[weakref.ref, str]] = {}  # tensors made inside model code's example runs
        self._modes = _mode_state()
        self.inside_torch_functions = 0  # depth of torch's own autograd.Functions being traced through
        self.swaps: list[Swap] = []
        self.running_examples = 0  # depth of runs of example values, which may draw as they like
        self.grad_mode = True  # the grad mode the trace was asked for in
        self.attribute_reads = AttributeReads(nn.Module(), bool, set(), set())  # the plain attributes its code read

    # -- example values -----------------------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return SizePinningProxy(node, self) if self.pin_sizes else MetaProxy(node, self)

    def create_node(self, kind: str, target: Any, args: tuple, kwargs: dict, name: str | None = None,
                    type_expr: Any | None = None) -> fx.Node:
        modes = _mode_state()
        if modes != self._modes and not self.inside_torch_functions:
            raise ModeRegion(f"{_mode_change(self._modes, modes)}: fx records operations without it, so the graph "
                             "would compute in other dtypes or keep other gradients than the model")
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise TraceError(f"torch.{target.__name__} takes its branches or body as functions, which fx cannot "
                             "record (torch.export can)")
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[DATA_FREE] = self._data_free(node)
        if self.examples is not None and kind != "output":
            try:
                where = str(node.target).removeprefix(f"{MODEL_ATTR}.")  # the path in the user's model
                inside = _Recording(self._inside, where) if _runs_model_code(node) and not self._named(node) else None
                # the example run first: ``no_grad`` sets the grad mode through a torch function, which
                # ``_RealCalls`` would otherwise check for random draws twice per node
                lifted = _untraced(self.swaps, modules=not _calls_no_module(node, self.root)) if inside else None
                with self._running_example(), lifted or contextlib.nullcontext(), \
                        inside or contextlib.nullcontext(), torch.no_grad():
                    node.meta[EXAMPLE] = self._run(node)
            except Exception:  # noqa: BLE001 - no example: the node behaves as in plain fx
                pass
            if isinstance(node.meta.get(EXAMPLE), torch.Tensor):
                self._computed[id(node.meta[EXAMPLE])] = node
        return node

    def stands_for(self, tensor: torch.Tensor) -> fx.Node | None:
        """The node (not a weight's or constant's) whose example value ``tensor`` is, if any."""
        node = self._computed.get(id(tensor))
        if node is None or node.op == "get_attr" or node.meta.get(EXAMPLE) is not tensor:
            return None
        return node

    def standing_proxy(self, value: Any) -> Any:
        """``value``, or the proxy of the node it is the example value of (``stands_for``)."""
        node = self.stands_for(value) if isinstance(value, torch.Tensor) else None
        return value if node is None else self.proxy(node)

    def note_made_inside(self, value: Any, where: str) -> None:
        """Note the tensors of ``value`` as made inside model code's example run at ``where``."""
        _note_made(self._inside, value, where)

    def made_inside(self, tensor: torch.Tensor) -> str | None:
        """Where a tensor made inside model code's example runs (no node's value) was made."""
        made = self._inside.get(id(tensor))
        return made[1] if made is not None and made[0]() is tensor else None

    def _named(self, node: fx.Node) -> bool:
        """Whether ``node`` reads a constant or weight by name: its example runs no model code, so it
        needs no ``_untraced`` (which costs about a millisecond: it sets attributes of ``nn.Module``,
        and the interpreter forgets what it knew of every subclass's attributes)."""
        return node.op == "get_attr" and (str(node.target) in self.constants
                                          or str(node.target) in self.weights().by_name)

    def _guard_grad_mode(self, site: str) -> None:
        """Model code asked for the grad mode here: the graph refuses calls in the other mode."""
        self.create_proxy("call_function", check_grad_mode, (self.grad_mode, site), {})

    def _guard_inference_mode(self, site: str) -> None:
        """Model code asked whether inference mode is on here: the graph refuses calls in the other mode."""
        self.create_proxy("call_function", check_inference_mode, (torch.is_inference_mode_enabled(), site), {})

    @contextlib.contextmanager
    def _running_example(self) -> Iterator[None]:
        self.running_examples += 1
        try:
            yield
        finally:
            self.running_examples -= 1

    def _run(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self.examples[str(node.target)]
        if node.op == "get_attr":
            target = str(node.target)
            if target in self.constants:
                return self.constants[target]
            tensor = self.weights().by_name.get(target)
            return tensor if tensor is not None else resolve(self.root, target)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta[EXAMPLE])
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return fx_trace._orig_module_call(self.root.get_submodule(str(node.target)), *args, **kwargs)

    @staticmethod
    def _data_free(node: fx.Node) -> bool:
        """Whether the node's value depends on sizes and constants only, never on tensor values."""
        if node.op in ("placeholder", "get_attr", "call_module"):
            return False
        if node.op == "call_method" and node.target in _SIZE_METHODS:
            return True
        if node.op == "call_function" and node.target is getattr and node.args[1] in _SIZE_ATTRS:
            return True
        return all(n.meta.get(DATA_FREE, False) for n in node.all_input_nodes)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        """fx's rule (parameters, and buffers when proxied, become ``get_attr``) with the name
        looked up in a table built once, where fx scans every parameter on every access. An example
        run reads the value itself."""
        if not isinstance(attr_val, torch.Tensor) or self.running_examples:
            return attr_val
        weights = self.weights()
        if isinstance(attr_val, nn.Parameter):
            name = weights.parameter_names.get(id(attr_val))
        else:
            name = weights.buffer_names.get(id(attr_val)) if self.proxy_buffer_attributes else None
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def weights(self) -> "_Weights":
        """The root's parameters and buffers by name and by object, listed once per trace."""
        if self._weights is None:
            with _untraced(self.swaps):
                self._weights = _Weights(list(self.root.named_parameters()), list(self.root.named_buffers()))
        return self._weights

    def forget_examples(self, graph: fx.Graph) -> None:
        """Drop the example values so the graph does not keep the example's activations alive, and the
        trace values the graph's constants keep (``clear_trace_values``)."""
        for constant in self.constants.values():
            clear_trace_values(constant)
        self._computed.clear()
        self._inside.clear()
        for node in graph.nodes:
            node.meta.pop(EXAMPLE, None)
            node.meta.pop(DATA_FREE, None)

    # -- where plain fx gives up ----------------------------------------------------------------------
    def trace(self, root: nn.Module | Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with contextlib.ExitStack() as patches:
            # Traced with grad enabled, so a ``no_grad`` block in the model changes the mode and is seen
            # (and kept whole) even when the capture itself was called under ``no_grad``; code that
            # asks for the grad mode is told the caller's (``_grad_mode_reader``).
            self.grad_mode = caller_grad = torch.is_grad_enabled()
            patches.enter_context(torch.enable_grad())
            self._modes = _mode_state()
            top_level = (root, getattr(root, MODEL_ATTR, root))  # (the model, under the wrapper of its call)
            writes = patches.enter_context(refusing_state_writes(
                _computed_in_trace, follow_modules=True, kept_whole=lambda module: module is not root and not (
                    self.running_examples or is_real_run()) and self.is_leaf_module(module, ""),
                replayed=lambda module, name, value: module in top_level and self.attribute_reads.write_back(
                    module, name, value)))
            self.swaps = [(torch, name, vars(torch)[name], _recording_constructor(vars(torch)[name]))
                          for name in _CONSTRUCTORS]
            apply = vars(torch.autograd.Function)["apply"]
            self.swaps.append((torch.autograd.Function, "apply", apply, _recording_apply(apply)))
            reader = GradModeReader(caller_grad, self._guard_grad_mode, lambda: bool(self.running_examples))
            self.swaps.append((torch, "is_grad_enabled", torch.is_grad_enabled, reader))
            inference = GradModeReader(torch.is_inference_mode_enabled(), self._guard_inference_mode,
                                       lambda: bool(self.running_examples), real=torch.is_inference_mode_enabled)
            self.swaps.append((torch, "is_inference_mode_enabled", torch.is_inference_mode_enabled, inference))
            self.swaps += [(module, name, vars(module)[name], _seeding_kept_whole(vars(module)[name], self))
                           for module in (torch, torch.random) for name in _SEEDING]
            generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator  # use_reentrant=False
            self.swaps.append((torch.utils.checkpoint, generator.__name__, generator,
                               _noting_checkpoint(generator, self)))
            if self.examples is not None:
                self.swaps += [(torch, "is_tensor", torch.is_tensor, _is_tensor),
                               (builtins, "callable", builtins.callable, _callable)]
            patches.enter_context(_swapped(self.swaps))
            patches.enter_context(_RealCalls(self))
            self.attribute_reads = AttributeReads(root, lambda: bool(self.running_examples) or is_real_run(),
                                                  writes.written, writes.set_by_runs)
            patches.enter_context(self.attribute_reads.recording())
            return super().trace(root, concrete_args)

    def iter(self, obj: fx.Proxy) -> Any:
        example = example_of(obj)
        if isinstance(example, torch.Size):
            return iter([obj[i] for i in range(len(example))])
        if isinstance(example, torch.Tensor) and example.dim() > 0:  # over its first size, as len() is
            return iter([obj[i] for i in range(len(obj))])
        return super().iter(obj)

    def to_bool(self, obj: fx.Proxy) -> bool:
        example = example_of(obj)
        if example is MISSING or not obj.node.meta.get(DATA_FREE, False):
            return super().to_bool(obj)
        value = bool(example)
        condition = _user_condition()
        self.create_proxy("call_function", check_condition, (obj, value, condition), {})
        self.note(f"{condition} is {value}")
        return value

    def pinned(self, proxy: fx.Proxy) -> int:
        """The example's value of a size the code turns into a Python number, guarded."""
        if not is_size(proxy):
            raise TypeError(f"'{type(proxy).__name__}' object cannot be interpreted as an integer "
                            "(a value computed from tensor data, not a size)")
        example = example_of(proxy)
        site = _user_site() or "an unknown place"
        scopes = [path for path, _ in self.module_stack.values()]
        top_level = not scopes or scopes[-1] in ("", MODEL_ATTR)  # the model's own forward (or its call)
        self.create_proxy("call_function", check_pinned_size, (proxy, example, site, top_level), {})
        self.note(f"the size the code at {site} turns into a number is {example}")
        return example

    def note_checkpoint(self) -> None:
        """Record that the model's ``torch.utils.checkpoint`` here is traced through: the graph runs
        the function it wraps plainly, so its stages keep what the checkpoint would recompute."""
        site = _user_site((TORCH_DIR, *MACHINERY_DIRS)) or "the model's code"  # the call, not torch's inside it
        if site not in self.checkpoints:
            self.checkpoints.append(site)

    def note(self, specialization: str) -> None:
        """Record something the trace fixed to the example's value (guarded in the graph)."""
        if specialization not in self.specialized:
            self.specialized.append(specialization)

    # -- arguments that are not graph values ------------------------------------------------------
    def create_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):  # the common case, first
            return a.node
        if isinstance(a, torch.Tensor) and id(a) in self._computed:
            # An example value that reached the code by another way than its proxy (a forward hook
            # of a leaf saw the real output: Transformers records hidden states so) is that node's
            # value, not a constant that would serve the example's data to every later call.
            return self._computed[id(a)]
        inside = self.made_inside(a) if isinstance(a, torch.Tensor) else None
        if inside is not None:
            raise TraceError(
                f"a tensor computed from the example inside {inside} reached the graph by "
                "another way than its outputs (a forward hook of a module kept whole, such as the ones "
                "Transformers records attentions with?); as a constant it would serve the example's "
                "values to every later call")
        if isinstance(a, nn.Module):
            try:
                return self.create_node("get_attr", self.path_of_module(a), (), {})
            except NameError:
                return self._constant(a)
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            if not has_proxy(a):
                return self._constant(a)
            fields = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", type(a), (), fields)
        # fx would rebuild it as a plain dict (torchvision's segmentation output)
        if type(a) is collections.OrderedDict:
            return self.create_node("call_function", collections.OrderedDict, (self.create_arg(list(a.items())),), {})
        if isinstance(a, np.generic):  # fx takes np.float64 as the float it subclasses, then writes its repr
            return self._constant(a)   # (``np.float64(2.0)``) into code without ``np``: a NameError on the call
        base = rebuildable_base(a)
        if base is not None:  # fx would rebuild it as its base, dropping its class and attributes
            made = (self._constant(type(a)), self.create_arg(base(a)), self.create_arg(getattr(a, "__dict__", {})))
            return self.create_node("call_function", rebuilt_container, made, {})
        try:
            return super().create_arg(a)
        except NotImplementedError:
            if has_proxy(a):
                raise
            return self._constant(a)

    def _constant(self, value: Any) -> fx.Node:
        for name, known in self.constants.items():
            if known is value:
                return self.create_node("get_attr", name, (), {})
        name = f"_autoshard_constant_{len(self.constants)}"
        self.constants[name] = value
        return self.create_node("get_attr", name, (), {})


class _Recording(TorchDispatchMode):
    """Notes every tensor the operations inside it make, weakly, with where they were made."""

    def __init__(self, made: dict[int, tuple[weakref.ref, str]], where: str) -> None:
        super().__init__()
        self.made, self.where = made, where

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        _note_made(self.made, out, self.where)
        return out


def _note_made(made: dict[int, tuple[weakref.ref, str]], value: Any, where: str) -> None:
    """Note each tensor of ``value``, weakly, as made at ``where``."""
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            made[id(leaf)] = (weakref.ref(leaf), where)


def guard_value(tracer: MetaTracer, proxy: fx.Proxy, what: str) -> Any:
    """An opaque call's non-tensor example result, guarded; otherwise the proxy itself."""
    example = example_of(proxy)
    if example is MISSING or not isinstance(example, _GUARDED_RESULTS):
        return proxy
    condition = f"`{what} == {example!r}`"
    same = tracer.create_proxy("call_function", _equals, (proxy, example), {})
    tracer.create_proxy("call_function", check_condition, (same, True, condition), {})
    tracer.note(f"{what} returned {example!r}")
    return example


def _equals(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected
