"""torch.fx capture with leaf detection by trial tracing, at the least granular level.

fx cannot trace through Python control flow that reads tensor values. Rather than give up,
we trace, and when tracing fails we find the *innermost* thing that failed and keep only that
opaque, then trace again:

* a free function called from a forward (``F._canonical_mask``, a mask builder, a length check)
  becomes one ``call_function`` node, so the module around it stays splittable;
* otherwise the innermost module whose own forward failed becomes a leaf (``call_module``).

A module is therefore wrapped only if the model cannot be traced through it once its own
untraceable descendants are leaves. Primitive ``torch.nn`` modules (no children: Linear, Conv,
norms, activations, Embedding, Dropout) are always leaves; composite ``torch.nn`` modules
(Sequential, TransformerEncoder, ...) are traced through whenever they trace.
"""

from __future__ import annotations

import functools
import os
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.fx as fx
from torch import nn

from autoshard.errors import TraceError

_TORCH_INTERNAL_DIRS = tuple(
    os.path.join(os.path.dirname(torch.__file__), sub) for sub in ("fx", os.path.join("nn", "modules", "module.py"))
)


@dataclass(frozen=True)
class WrappedLeaf:
    """Something kept opaque in the graph, and the error that forced it."""

    kind: Literal["module", "function"]
    name: str
    reason: str


@dataclass(frozen=True)
class TraceResult:
    """The captured graph plus the record of every wrapped module or function."""

    graph_module: fx.GraphModule
    wrapped: tuple[WrappedLeaf, ...]
    front_end: str = "fx"

    def describe(self) -> str:
        lines = [f"front end: {self.front_end}; {len(self.graph_module.graph.nodes)} nodes"]
        lines += [f"wrapped {w.kind} {w.name}: {w.reason}" for w in self.wrapped]
        return "\n".join(lines)


def is_primitive(module: nn.Module) -> bool:
    """A ``torch.nn`` module with no children: there is nothing inside worth splitting."""
    defined_in_torch = type(module).__module__.startswith(("torch.nn", "torch.ao.nn"))
    return defined_in_torch and next(module.children(), None) is None


def has_call_hooks(module: nn.Module) -> bool:
    """Tracing through a module skips its hooks, so a module with hooks must stay a leaf."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


@dataclass
class _PatchedFunction:
    namespace: dict[str, Any]
    attr: str
    original: Callable[..., Any]


class _LeafTracer(fx.Tracer):
    """An fx tracer with an explicit leaf set that remembers which module a failure came from."""

    def __init__(self, leaves: dict[int, str]) -> None:
        super().__init__()
        # Buffers as graph values, so shape-dependent slicing (``self.pe[: x.size(0)]``) traces.
        self.proxy_buffer_attributes = True
        self.leaves = leaves
        self._module_stack: list[nn.Module] = []
        self.failures: list[tuple[BaseException, nn.Module]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves or is_primitive(m) or has_call_hooks(m)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._module_stack.append(m)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not any(exc is seen for seen, _ in self.failures):
                self.failures.append((exc, m))
            raise
        finally:
            self._module_stack.pop()

    def failed_module(self, exc: BaseException) -> nn.Module | None:
        """The innermost traced-through module the escaping exception came from (None: the root)."""
        return next((m for seen, m in self.failures if seen is exc), None)


def _contains_proxy(args: tuple, kwargs: dict) -> bool:
    found = False

    def visit(value: Any) -> Any:
        nonlocal found
        found = found or isinstance(value, fx.Proxy)
        return value

    fx.node.map_aggregate((args, kwargs), visit)
    return found


def _opaque(fn: Callable[..., Any], tracer_ref: list[fx.Tracer]) -> Callable[..., Any]:
    """A stand-in that records ``fn`` as one call_function node whenever it sees a Proxy."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _contains_proxy(args, kwargs):
            return tracer_ref[0].create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _forward_frame(tb: types.TracebackType | None, module: nn.Module) -> list[types.FrameType]:
    """Frames of the traceback from the failing module's last frame inward."""
    frames: list[types.FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    owner = max((i for i, f in enumerate(frames) if f.f_locals.get("self") is module), default=None)
    return [] if owner is None else frames[owner:]


def _find_callable(frame: types.FrameType, code: types.CodeType) -> tuple[dict[str, Any], str] | None:
    """Where ``frame``'s code reaches the function running ``code``: its globals or a module in them."""
    namespaces = [frame.f_globals] + [v.__dict__ for v in frame.f_globals.values() if isinstance(v, types.ModuleType)]
    for namespace in namespaces:
        for attr, value in list(namespace.items()):
            if isinstance(value, types.FunctionType) and value.__code__ is code:
                return namespace, attr
    return None


def _failing_function(exc: BaseException, module: nn.Module) -> tuple[dict[str, Any], str] | None:
    """The free function called from ``module``'s code in which tracing failed, if any."""
    frames = _forward_frame(exc.__traceback__, module)
    if len(frames) < 2:
        return None
    caller, callee = frames[0], frames[1]
    if callee.f_code.co_filename.startswith(_TORCH_INTERNAL_DIRS):
        return None
    return _find_callable(caller, callee.f_code)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}


def trace_with_leaves(model: nn.Module, concrete_args: dict[str, Any] | None = None) -> TraceResult:
    """Trace ``model`` with fx, wrapping the fewest, innermost modules or functions needed."""
    paths = _module_paths(model)
    leaves: dict[int, str] = {}
    patched: list[_PatchedFunction] = []
    wrapped: list[WrappedLeaf] = []
    tracer_ref: list[fx.Tracer] = []
    for _ in range(len(paths) + 64):
        tracer = _LeafTracer(leaves)
        tracer_ref[:] = [tracer]
        for p in patched:
            p.namespace[p.attr] = _opaque(p.original, tracer_ref)
        try:
            graph = tracer.trace(model, concrete_args=concrete_args)
        except Exception as exc:  # noqa: BLE001 - any failure is a reason to wrap something
            failed = tracer.failed_module(exc) or model
            target = _failing_function(exc, failed)
            if target is not None and not any(p.namespace is target[0] and p.attr == target[1] for p in patched):
                namespace, attr = target
                original = namespace[attr]
                patched.append(_PatchedFunction(namespace, attr, original))
                wrapped.append(WrappedLeaf("function", f"{original.__module__}.{original.__qualname__}", _reason(exc)))
                continue
            if failed is model:
                raise TraceError(
                    f"cannot trace the top-level forward of {type(model).__name__}: {_reason(exc)}. "
                    "Control flow in the top-level forward that depends on tensor values cannot be "
                    "split; move it into a submodule or pass non-tensor arguments as constants."
                ) from exc
            leaves[id(failed)] = paths.get(id(failed), type(failed).__name__)
            wrapped.append(WrappedLeaf("module", leaves[id(failed)], _reason(exc)))
            continue
        finally:
            for p in patched:
                p.namespace[p.attr] = p.original
        gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
        return TraceResult(gm, tuple(wrapped))
    raise TraceError(f"gave up tracing {type(model).__name__} after wrapping {len(wrapped)} modules and functions")
