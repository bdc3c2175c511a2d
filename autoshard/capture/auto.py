"""Choosing a front end: try fx and ``torch.export``, keep the capture with fewer opaque leaves.

Neither front end covers real models alone: fx fails where a forward's own code is untraceable
and export fails on control flow that reads tensor values, each wrapping leaves where it fails.
``capture(front_end="auto")`` keeps the capture that wraps fewer modules, preferring fx on a tie
(it is several times faster and keeps module calls whole). Where fx kept code whole because it
turns a size into a Python number, fx is tried again with that size pinned to the example's
(guarded), as export would pin it, before export is tried. Wrapped free functions do not count:
they cost a split nothing. So when fx wraps no module, export cannot win and is not tried, unless
fx's graph computes something else than the model on the example (fx answers
``isinstance(x, torch.Tensor)`` with False for a traced value, where export's fake tensors say
True): a capture that differs is kept only when every one does, for ``verify`` to explain. When
every front end fails, the model is run on the example as it is: if it fails there too, its own
error is what the user needs to see.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

from torch import nn

from autoshard.capture.eager import check_model_runs
from autoshard.capture.leaves import TOP_LEVEL_NOT_WRAPPED, ReturnedObjectError, TopLevelCodeError
from autoshard.capture.meta_proxy import SizeToNumber
from autoshard.capture.result import TraceResult
from autoshard.capture.state import ScalarStateWrite, StateWrite
from autoshard.errors import InvalidArgumentError, TraceError

FRONT_ENDS: tuple[str, ...] = ("auto", "fx", "export")
_CAPTURES = {"fx": "autoshard.capture.fx:trace_with_leaves",
             "export": "autoshard.capture.export:export_with_leaves"}


def _front_end(name: str) -> Callable[..., TraceResult]:
    """The capture function of a front end, imported on first use (export's import is slow)."""
    module, function = _CAPTURES[name].split(":")
    return getattr(importlib.import_module(module), function)


#: What ``auto`` tries, in order of preference: (label, front end, its options). fx with sizes
#: pinned runs only where plain fx kept code whole (or failed) because it turned a size into a
#: number; it pins what export would pin, in a fraction of export's time.
_CANDIDATES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("fx", "fx", {}), ("fx with sizes pinned", "fx", {"pin_sizes": True}), ("export", "export", {}))


def _converted_a_size(result: TraceResult | TraceError) -> bool:
    failures = [str(result)] if isinstance(result, TraceError) else [w.reason for w in result.wrapped]
    return any(SizeToNumber.__name__ in failure for failure in failures)


def _summary(name: str, result: TraceResult | TraceError) -> str:
    if isinstance(result, TraceError):
        return f"{name}: failed ({result})"
    modules = len(result.wrapped_modules)
    return f"{name}: wrapped modules {modules}, functions {len(result.wrapped) - modules}"


def capture(
    model: nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    front_end: str = "auto",
    fused_paths: bool = True,
    trace_hooks: bool = False,
) -> TraceResult:
    """Capture ``model`` with the front end asked for; ``auto`` keeps the one with fewer leaves.
    ``fused_paths``: keep modules with a fused inference path whole in eval mode (``fast_paths``).
    ``trace_hooks``: fx traces through modules with forward hooks (``fx.kept_whole_for_hooks``);
    torch.export always does, running them once while it traces."""
    if front_end not in FRONT_ENDS:
        raise InvalidArgumentError(f"unknown front end {front_end!r}; choose one of {', '.join(FRONT_ENDS)}")
    hooks = {"fx": {"trace_hooks": trace_hooks}, "export": {}}
    if front_end != "auto":
        return _front_end(front_end)(model, example_args, example_kwargs, fused_paths=fused_paths, **hooks[front_end])
    has_examples = bool(example_args or example_kwargs)
    tried: dict[str, TraceResult | TraceError] = {}
    checked: dict[str, str | None] = {}

    def differs(name: str) -> str | None:
        """How the capture ``name`` differs from the model on the example, checked once."""
        if has_examples and name not in checked:
            checked[name] = _difference(model, tried[name], example_args, example_kwargs or {})
        return checked.get(name)

    for name, front, options in _CANDIDATES if has_examples else _CANDIDATES[:1]:
        if options and not _converted_a_size(tried["fx"]):
            continue
        try:
            tried[name] = _front_end(front)(model, example_args, example_kwargs, fused_paths=fused_paths,
                                            **options, **hooks[front])
        except ReturnedObjectError:
            raise  # (torch.export returns no such object either)
        except TraceError as exc:
            tried[name] = exc
        if isinstance(tried[name], TraceResult) and not tried[name].wrapped_modules and not differs(name):
            break
    captured = [name for name, r in tried.items() if isinstance(r, TraceResult)]
    _refuse_frozen_top_level_state(tried)
    if not captured:
        considered = tuple(_summary(name, r) for name, r in tried.items())
        if has_examples:
            _refuse_returned_objects(model, check_model_runs(model, example_args, example_kwargs or {}), considered)
        if len(tried) > 1 and all(isinstance(r, TopLevelCodeError) for r in tried.values()):
            raise TraceError(  # each front end's own advice is to try the other: the way out is one
                f"no front end could capture {type(model).__name__}: "
                + "; ".join(f"{name}: {r.cause}" for name, r in tried.items())
                + f". {TOP_LEVEL_NOT_WRAPPED}: move that code into a "
                "submodule, which is then kept whole")
        hint = "" if has_examples else "; pass example inputs so the 'export' front end can be tried too"
        raise TraceError(f"no front end could capture {type(model).__name__}: {'; '.join(considered)}{hint}")
    best = _best({name: tried[name] for name in captured}, differs)
    considered = tuple(_summary(name, r) + (f", differs from the model ({checked[name]})" if checked.get(name) else "")
                       for name, r in tried.items())
    return dataclasses.replace(tried[best], considered=considered, difference=checked.get(best))


def _refuse_returned_objects(model: nn.Module, output: Any, considered: tuple[str, ...]) -> None:
    """Raise the way out when the model returns objects holding tensors (a generation cache, as
    Hugging Face models do unless called with ``use_cache=False``): torch.export cannot return
    them, and no stage pipeline could pass them on, so that is what the user needs to change first."""
    from autoshard.verify import objects_holding_tensors  # verify imports the capture package

    returned = objects_holding_tensors(output)
    if returned:
        raise TraceError(
            f"no front end could capture {type(model).__name__}, which returns objects that hold tensors "
            f"({'; '.join(returned)}): torch.export cannot return them, and stages cannot pass them on (pipeline "
            "runtimes send tensors); if one is a generation cache (past_key_values), call the model with "
            f"use_cache=False, else make it return tensors only. Front ends: {'; '.join(considered)}")


def _refuse_frozen_top_level_state(tried: Mapping[str, TraceResult | TraceError]) -> None:
    """Raise the failure of a front end that saw the top-level forward change a number or flag it
    reads on its next call, if another captured it: that capture froze it (the top level cannot be
    kept whole)."""
    stateful = [r for r in tried.values() if isinstance(r, TraceError) and f"{ScalarStateWrite.__name__}:" in str(r)]
    if stateful and any(isinstance(r, TraceResult) for r in tried.values()):
        raise stateful[0]


def _best(captured: Mapping[str, TraceResult], differs: Callable[[str], str | None]) -> str:
    """The capture with the fewest leaves (fx first on a tie) among those that keep whole every
    module any of them found writing state for its next call and compute what the model does on
    the example and on other values of its shapes (``capture_difference``); failing that, the
    fewest leaves (verify then names the difference)."""
    by_leaves = sorted(captured, key=lambda name: len(captured[name].wrapped_modules))  # stable
    stateful = _kept_for_state(list(captured.values()))
    fitting = [name for name in by_leaves if _keeps_whole(captured[name], stateful)] or by_leaves
    if len(fitting) == 1:  # nothing to choose: verification compares it
        return fitting[0]
    return next((name for name in fitting if not differs(name)), fitting[0])


def _kept_for_state(results: list[TraceResult]) -> set[str]:
    """Modules a capture kept whole because they write state for their next call: a front end that
    traced into one froze that state (fx follows reads by modules that already ran; export cannot)."""
    kinds = (StateWrite.__name__, ScalarStateWrite.__name__)
    return {w.name for r in results for w in r.wrapped_modules if w.reason.startswith(kinds)}


def _keeps_whole(result: TraceResult, modules: set[str]) -> bool:
    """Whether ``result`` runs each of ``modules`` whole: wrapped, or inside a wrapped module."""
    wrapped = [w.name for w in result.wrapped_modules]
    return all(any(m == w or m.startswith(w + ".") for w in wrapped) for m in modules)


def _difference(model: nn.Module, result: TraceResult, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    from autoshard.verify import capture_difference  # verify imports the capture package

    try:
        return capture_difference(model, result.graph_module, args, dict(kwargs))
    except Exception as exc:  # the graph fails on its own example: it differs  # noqa: BLE001
        return f"running it failed: {type(exc).__name__}: {exc}"
