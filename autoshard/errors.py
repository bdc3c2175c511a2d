"""Typed errors. Every error autoshard raises on purpose derives from ``AutoshardError``.

Each message says what was wrong and what to do about it; the classes also derive from the
matching builtin (``ValueError``, ``TypeError``) so callers that catch those keep working.
``suggest`` and ``plural`` are the wording the messages share: every closed set of names
(passes, options, strategies, cost models, schedules, examples) answers a typo the same way.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import reprlib
import sys
from typing import Any, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the first frame outside autoshard and torch (``nn.Module``'s
    call, ``torch.compiler.disable``'s wrapper): the user's call, however deep in autoshard (a pass, a
    runtime) the warning is raised. (torch is looked up, not imported: ``autoshard.graph`` imports none.)"""
    torch = sys.modules.get("torch")
    inside = (_PACKAGE, os.path.dirname(torch.__file__)) if torch is not None and torch.__file__ else (_PACKAGE,)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest matches of ``name``, or ``""`` when none is close.

    Only the best match and those nearly as good are offered, so ``stage`` suggests ``stages``
    without also suggesting ``tag``.
    """
    scored = []
    for c in sorted(set(candidates)):
        matcher = difflib.SequenceMatcher(None, name, c)
        if matcher.real_quick_ratio() >= 0.6 and matcher.quick_ratio() >= 0.6 and matcher.ratio() >= 0.6:
            scored.append((matcher.ratio(), c))
    if not scored:
        return ""
    best = max(score for score, _ in scored)
    close = [c for score, c in sorted(scored, key=lambda sc: (-sc[0], sc[1])) if score >= best - 0.1][:3]
    return " (did you mean " + " or ".join(f"'{c}'" for c in close) + "?)"


def keywords_named(function: Callable[..., T]) -> Callable[..., T]:
    """``function`` (or a class, its ``__init__``) refusing a keyword it does not take with the closest
    it does: Python's own TypeError names no alternative (``max_memroy=``, ``MemoryModel(micro_batches=4)``)."""
    if isinstance(function, type):
        function.__init__ = keywords_named(function.__init__)  # type: ignore[misc]
        return function
    parameters = [name for name in inspect.signature(function).parameters if name != "self"]
    called, taken = function.__qualname__.removesuffix(".__init__"), frozenset(parameters)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> T:
        for name in kwargs:
            if name not in taken:
                raise InvalidArgumentTypeError(
                    f"{called}() got an unexpected keyword argument {name!r}{suggest(name, parameters)}; "
                    f"it takes {', '.join(parameters)}")
        return function(*args, **kwargs)
    return checked


def amount(value: float) -> str:
    """``11,328``; a fraction of one as it is (``0.001``), which ``,.0f`` shows as 0 (a budget of 1e-3 bytes
    read "max_memory[0] is 0")."""
    return f"{value:.3g}" if 0 < abs(value) < 1 else f"{value:,.0f}"


def plural(count: float, noun: str) -> str:
    """``1 stage``, ``2 stages``: a count with its noun, so no message reads ``at most 1 stages``."""
    shown = f"{count:,.0f}"  # the noun agrees with the number as written: 1.2 bytes reads "1 byte"
    return f"{shown} {noun}{'' if shown == '1' else 's'}"


def first_few(names: Sequence[str], most: int = 5) -> str:
    """``a, b, c and 4 more``: the first ``most`` names and a count of the rest, so that a message
    about many nodes stays one line."""
    rest = len(names) - most
    return ", ".join(names[:most]) + (f" and {rest} more" if rest > 0 else "")


class _Short(reprlib.Repr):
    """``repr`` cut to a line: a tensor or an array by its shape (its numbers would fill the
    screen), long containers and strings elided. Told by type name, so this module needs no torch."""

    def __init__(self) -> None:
        super().__init__()  # (keyword settings arrived in Python 3.12)
        self.maxlevel, self.maxtuple, self.maxlist, self.maxdict = 3, 4, 4, 4
        self.maxstring = self.maxother = 60

    def repr_Tensor(self, x, level: int) -> str:  # noqa: N802 - reprlib dispatches on the type's name
        return f"Tensor{list(x.shape)}"

    def repr_ndarray(self, x, level: int) -> str:
        return f"array{list(x.shape)} of {x.dtype}"

    repr_Parameter = repr_Tensor


#: ``repr`` cut to a line, for a value in a message: ``brief(x)``.
brief = _Short().repr


def shown(value: object) -> str:
    """``tuple (Tensor[8, 16], 2)``: a wrong value's type and a short repr of it, for messages."""
    return f"{type(value).__name__} {brief(value)}"


class AutoshardError(Exception):
    """Base class of every error autoshard raises deliberately."""


class InvalidArgumentError(AutoshardError, ValueError):
    """An argument has the right type but an unusable value."""


class InvalidArgumentTypeError(AutoshardError, TypeError):
    """An argument has the wrong type."""


class TooManyStagesError(InvalidArgumentError):
    """More stages were asked for than the graph has splittable nodes."""

    def __init__(self, requested: int, maximum: int, detail: str = "") -> None:
        self.requested = requested
        self.maximum = maximum
        advice = (f"ask for at most {plural(maximum, 'stage')}" if maximum else
                  "there is no computation to split (a model that returns its inputs needs no stages)")
        msg = (
            f"cannot split into {requested} non-empty stages: the maximum is {maximum}"
            f"{' (' + detail + ')' if detail else ''}; {advice}"
        )
        super().__init__(msg)


class InfeasibleSplitError(InvalidArgumentError):
    """Constraints (budgets, pins) leave no valid split."""


class PinConflictError(InfeasibleSplitError):
    """Two pins hold one node (``node``) in two stages (``stages``): one module inside the other, or a shared
    weight; where a sharded model captures again for other inputs, the new capture runs as one piece what
    the plan split (a module whose code it could not trace with them)."""

    def __init__(self, message: str, node: str, stages: tuple[int, int]) -> None:
        super().__init__(message)
        self.node, self.stages = node, stages


class EmptyStageError(InfeasibleSplitError):
    """Pins (``stage_ranges``) leave no node that may sit in ``stage`` of ``num_stages``, or (``last``
    past ``stage``) only ``nodes`` for the stages ``stage..last``, fewer than there are of them: where a
    sharded model captures again for other inputs, they run too little of what those stages hold."""

    def __init__(self, message: str, stage: int, num_stages: int, last: int | None = None, nodes: int = 0) -> None:
        super().__init__(message)
        self.stage, self.num_stages = stage, num_stages
        self.last, self.nodes = stage if last is None else last, nodes

    def stages(self) -> str:
        """The stage or stages left short, in words: ``stage 2`` or ``stages 1..2``."""
        return f"stage {self.stage}" if self.last == self.stage else f"stages {self.stage}..{self.last}"

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.stage, self.num_stages, self.last, self.nodes)


class InvalidGraphError(InvalidArgumentError):
    """A graph handed to the splitter breaks its contract (cycle, missing or negative weight)."""


class SpecError(AutoshardError, ValueError):
    """A pipeline text spec cannot be parsed or names something unknown."""


class PipelineValidationError(AutoshardError, ValueError):
    """A pipeline cannot run: a pass needs an artifact no earlier pass provides."""


class PassFailed(AutoshardError):
    """A pass raised; the message names the pass, its position and a reproducing spec, with
    ``given``: what else the run planned with (its memory model), which the spec does not say."""

    def __init__(self, pass_name: str, index: int, spec: str, cause: BaseException, given: str = "") -> None:
        self.pass_name = pass_name
        self.index = index
        self.spec = spec
        super().__init__(
            f"pass '{pass_name}' (position {index} in the pipeline) failed: "
            f"{type(cause).__name__}: {cause}\n  reproduce with pipeline: {spec}{given}"
        )


class TraceError(AutoshardError):
    """The model could not be captured as a graph, even with leaf wrapping."""


class VerificationError(AutoshardError):
    """The sharded model's values differ from the original model's."""

    def __init__(self, message: str, stage: int | None = None) -> None:
        self.stage = stage
        super().__init__(message)


class PassContractError(AutoshardError):
    """A pass broke its contract: it left a declared artifact unset, changed an artifact it does
    not declare, returned something other than a ``ShardProgram``, or modified the user's model."""

    def __init__(self, message: str, pass_name: str | None = None, index: int | None = None) -> None:
        self.pass_name = pass_name
        self.index = index
        super().__init__(message)


class PlanError(InvalidArgumentError):
    """A saved plan cannot be read, contradicts itself, breaks an invariant, or does not fit the model."""


class ShapePropagationError(AutoshardError):
    """Running the traced graph on the example inputs (real or fake tensors) failed at a node."""


class ExampleInputsError(InvalidArgumentError):
    """The model itself raises on the example inputs it was given, so nothing can be captured."""


class InputMismatchError(InvalidArgumentError):
    """Inputs a sharded model cannot serve: a constant argument with another value, or a shape
    outside what the capture was built for. The message names what the plan accepts."""


class CallRefusedError(InputMismatchError, TypeError):
    """A call the model's forward itself refuses (an argument missing, unknown, or one too many): a
    ``TypeError``, as the model's own call raises, so ``except TypeError`` catches it alike."""


#: The end of a ``SpecializationMismatch``'s message.
OTHER_CAPTURE = ("; or, where the model was sharded with respecialize=True (the default), call the sharded model, "
                 "which captures the model again for them, or run the stages of sharded.specialize(*inputs).stages")


#: Which stages capture nothing again, said alike wherever that is why a call or a build is refused.
NO_SPECIALISATIONS = ("these stages make no specialisations (a copy of them: copy.deepcopy, a pickle, "
                      "materialize_stage; or made with respecialize=False)")

#: The end of a ``SpecializationMismatch``'s message from stages that capture nothing again.
NO_CAPTURE_HERE = (f"; {NO_SPECIALISATIONS}: on the sharded model shard_model returned "
                   "(respecialize=True, the default), call specialize(*inputs) before copying it and run the stages "
                   "of the plan it returns, or call that sharded model itself")


class SpecializationMismatch(InputMismatchError):
    """Inputs another capture of the model could serve: a size or a branch the capture fixed to
    its example's. A sharded model re-specialises on it (``shard_model(respecialize=True)``).
    ``before_compute`` says the stages had computed nothing yet when it was raised. The message ends
    with what serves the inputs without sharding again (``OTHER_CAPTURE``): a user running the
    stages in turn, as the README does, meets it, as a sharded model re-specialises before its
    caller sees one; ``other_capture=False`` leaves that out where it is what failed. ``refusal``
    is the message without it. ``stage``: the stage module that raised it, where the runner says
    (those after it did not run); ``site``: where the model's code relied on what the check that
    raised it checks, which names the check in its stage's graph (nodes after it did not run)."""

    stage: Any = None

    def __init__(self, refusal: str, before_compute: bool = False, other_capture: bool = True,
                 site: str | None = None) -> None:
        super().__init__(refusal + (OTHER_CAPTURE if other_capture else ""))
        self.refusal = refusal
        self.before_compute = before_compute
        self.site = site

    def __reduce__(self) -> tuple:  # (pickled by its message alone, it would add the advice twice)
        return type(self), (self.refusal, self.before_compute, str(self) != self.refusal, self.site)

    def where_nothing_captures(self) -> SpecializationMismatch:
        """This refusal as stages without a specializer raise it (a copy, ``respecialize=False``): its
        advice to call the sharded model or ``sharded.specialize`` would fail on them (a copy's own raise
        ``PlanError``), so it names the sharded model they were made from instead (``NO_CAPTURE_HERE``)."""
        if str(self) == self.refusal:  # the refusal says what serves it already
            return self
        again = type(self)(self.refusal + NO_CAPTURE_HERE, self.before_compute, other_capture=False, site=self.site)
        again.stage = self.stage
        return again


class PipelineSetupError(InvalidArgumentError):
    """A stage or schedule cannot run as configured. Raised on every rank alike, before any
    process sends or waits, so a bad launch fails fast instead of hanging."""


class WorldSizeError(PipelineSetupError):
    """The number of processes does not fit the number of stages under the chosen schedule."""


class BoundaryValueError(PipelineSetupError):
    """A value crossing a stage boundary is not a tensor; distributed pipelining sends tensors only."""


class DeviceUnavailableError(PipelineSetupError):
    """A stage was placed on a device this machine does not have."""


class ModuleSplitError(InvalidArgumentError):
    """A stage boundary falls inside a module's forward, so no ``{module: device}`` map can express
    the plan; ``modules`` lists them."""

    def __init__(self, message: str, modules: tuple[str, ...]) -> None:
        self.modules = modules
        super().__init__(message)


class CheckpointMismatchError(InvalidArgumentError):
    """A checkpoint lacks a tensor a stage needs, or holds it with another shape or dtype."""


class LaunchError(AutoshardError):
    """Local worker processes failed: one raised, died, or they missed the deadline."""


class MissingDependencyError(AutoshardError, ImportError):
    """An optional dependency a feature needs is not installed; the message says what to install."""
