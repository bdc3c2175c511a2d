"""Finding what to keep opaque after a failed capture, from the traceback alone.

Both front ends run the model's Python code and fail somewhere inside it. The innermost module of
the model whose forward is on the failing stack is where the failure is; if the failing frame
below that forward belongs to a free function the forward called (a mask builder, an input
check), that function is the smaller thing to keep opaque, and it is found in the forward's
globals (or a module in them) so it can be swapped for an opaque stand-in while capturing.
"""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
from torch import nn

from autoshard import progress
from autoshard.capture.host_random import watching_host_random
from autoshard.capture.result import WrappedLeaf
from autoshard.errors import TraceError

T = TypeVar("T")

TORCH_DIR = os.path.dirname(torch.__file__)
#: Frames here are the capture machinery, never a function of the model's to wrap.
MACHINERY_DIRS = tuple(os.path.join(TORCH_DIR, sub) for sub in (
    "fx", "_dynamo", "_export", "export", "_subclasses", "_ops.py", "_library", "_higher_order_ops",
    "utils", "_prims_common", "_refs", "_decomp", "_meta_registrations.py", "_tensor.py",
    "overrides.py", "__init__.py", os.path.join("nn", "modules", "module.py"),
)) + (os.path.dirname(os.path.abspath(__file__)),)


@dataclass(frozen=True)
class FunctionSite:
    """Where a forward finds a free function: ``namespace[attr]``."""

    namespace: dict[str, Any]
    attr: str

    @property
    def function(self) -> Callable[..., Any]:
        return self.namespace[self.attr]

    def same(self, other: "FunctionSite") -> bool:
        return self.namespace is other.namespace and self.attr == other.attr


def reason(exc: BaseException) -> str:
    """The error's first line and the model's line of code that raised it."""
    text = str(exc).strip().splitlines()
    where = [f for link in _chain(exc) for f in _frames(link.__traceback__)
             if not f.f_code.co_filename.startswith(MACHINERY_DIRS)]
    at = f" (at {os.path.basename(where[-1].f_code.co_filename)}:{where[-1].f_lineno})" if where else ""
    return f"{type(exc).__name__}: {text[0] if text else ''}{at}"


#: Why code in the model's own forward is not kept whole, as the leaves of its children are.
TOP_LEVEL_NOT_WRAPPED = ("Code in the top-level forward that cannot be captured is not wrapped (the whole model "
                         "would be one leaf)")


class TopLevelCodeError(TraceError):
    """Code in the model's own forward that a front end cannot capture; ``cause`` says what and where."""

    def __init__(self, verb: str, model_name: str, cause: str) -> None:
        self.cause = cause
        super().__init__(f"cannot {verb} the top-level forward of {model_name}: {cause}. "
                         f"{TOP_LEVEL_NOT_WRAPPED}; try the other "
                         "front end, or move that code into a submodule")


class ReturnedObjectError(TraceError):
    """The model returns an object holding values its forward computed that no front end rebuilds on
    each call (torch.export refuses such outputs, and stages cannot pass them on)."""


def module_paths(model: nn.Module) -> dict[int, str]:
    """``id(module) -> qualified name`` (the first name of a module reachable under several)."""
    return {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    frames: list[types.FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (a front end may re-raise its own error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _receiver(frame: types.FrameType) -> Any:
    """The object whose method ``frame`` runs, whatever its first parameter is called (``self``,
    or ``s``); None in a free function, even one that takes a module first."""
    code = frame.f_code
    if not code.co_argcount:
        return None
    first = frame.f_locals.get(code.co_varnames[0])
    if code.co_varnames[0] == "self":
        return first
    methods = (vars(kind).get(code.co_name) for kind in type(first).__mro__)
    return first if any(getattr(m, "__code__", None) is code for m in methods) else None


def _module_behind(obj: Any) -> Any:
    """The module itself for export's stand-in of it: non-strict export reaches the modules of a
    ``ModuleList`` through proxy objects that share the module's ``__dict__`` but not its identity."""
    base = getattr(obj, "get_base", None)
    return base() if isinstance(obj, nn.Module) and callable(base) and vars(obj) is vars(base()) else obj


def modules_on_stack(exc: BaseException, modules: dict[int, str]) -> list[nn.Module]:
    """The modules among ``modules`` whose code is on the failing stack, innermost first."""
    for link in _chain(exc):
        owners = [_module_behind(_receiver(f)) for f in _frames(link.__traceback__)]
        found = [m for m in owners if isinstance(m, nn.Module) and id(m) in modules]
        if found:
            return list(dict.fromkeys(reversed(found)))
    return []


def _find_callable(frame: types.FrameType, code: types.CodeType) -> FunctionSite | None:
    modules = [v for v in list(frame.f_globals.values()) if isinstance(v, types.ModuleType)]
    namespaces = [frame.f_globals] + [m.__dict__ for m in modules]
    for namespace in namespaces:
        for attr, value in list(namespace.items()):
            if isinstance(value, types.FunctionType) and value.__code__ is code:
                return FunctionSite(namespace, attr)
    return None


def failing_function(exc: BaseException, module: nn.Module) -> FunctionSite | None:
    """The free function called from ``module``'s forward in which the capture failed, if any."""
    for link in _chain(exc):
        frames = _frames(link.__traceback__)
        owner = max((i for i, f in enumerate(frames) if _module_behind(_receiver(f)) is module), default=None)
        if owner is None:
            continue
        if owner + 1 >= len(frames) or frames[owner + 1].f_code.co_filename.startswith(MACHINERY_DIRS):
            return None
        return _find_callable(frames[owner], frames[owner + 1].f_code)
    return None


def function_name(function: Callable[..., Any]) -> str:
    return f"{function.__module__}.{function.__qualname__}"


@contextlib.contextmanager
def swapped(sites: Iterable[tuple[FunctionSite, Callable[..., Any]]]) -> Iterator[None]:
    """Put each stand-in at its site for the duration, restoring the originals afterwards."""
    sites = list(sites)
    saved = [(site, site.function) for site, _ in sites]
    try:
        for site, stand_in in sites:
            site.namespace[site.attr] = stand_in
        yield
    finally:
        for site, original in saved:
            site.namespace[site.attr] = original


@dataclass
class Leaves:
    """What a trial capture keeps opaque so far: modules (by id) and function sites."""

    model: nn.Module
    paths: dict[int, str] = field(init=False)
    modules: dict[int, nn.Module] = field(default_factory=dict)
    functions: list[FunctionSite] = field(default_factory=list)
    wrapped: list[WrappedLeaf] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.paths = module_paths(self.model)

    def wrap(self, exc: BaseException, verb: str) -> None:
        """Keep opaque the smallest thing ``exc`` came from; raise TraceError if that is the model."""
        # Innermost first, past those already kept whole: the failing code may be a method of a
        # child that its parent's forward calls directly, which keeping the child whole cannot reach.
        failed = next((m for m in modules_on_stack(exc, self.paths) if id(m) not in self.modules), self.model)
        site = failing_function(exc, failed)
        if site is not None and not any(site.same(f) for f in self.functions):
            self.functions.append(site)
            self.wrapped.append(WrappedLeaf("function", function_name(site.function), reason(exc)))
            return
        if failed is self.model:
            raise TopLevelCodeError(verb, type(self.model).__name__, reason(exc)) from exc
        self.modules[id(failed)] = failed
        self.wrapped.append(WrappedLeaf("module", self.paths[id(failed)], reason(exc)))


def capture_with_leaves(model: nn.Module, attempt: Callable[[Leaves], T], verb: str) -> tuple[T, Leaves]:
    """Run ``attempt`` until it succeeds, keeping one more thing opaque after each failure."""
    leaves = Leaves(model)
    with watching_host_random(type(model).__name__), \
            progress.task(f"{verb}: keeping untraceable code whole") as advance:
        for _ in range(len(leaves.paths) + 64):
            try:
                return attempt(leaves), leaves
            except TraceError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is a reason to wrap something
                leaves.wrap(exc, verb)
                advance.describe(f"{verb}: retry {len(leaves.wrapped)}, kept whole {leaves.wrapped[-1].name}")
    raise TraceError(f"gave up: could not {verb} {type(model).__name__} after wrapping {len(leaves.wrapped)} "
                     "modules and functions")
