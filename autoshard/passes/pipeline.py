"""A pipeline: an ordered list of passes, printable as and parseable from a text spec.

    Pipeline([TracePass(), SplitPass(stages=4)])
    Pipeline.parse("trace,build-dag,linearize,split{stages=4 cost=flops}")

The user's order is the order: ``validate`` checks the data dependencies (``requires`` /
``provides``) before anything runs and says what to add, but never inserts or reorders passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass, field
from typing import Iterable, Iterator, overload

from autoshard.errors import (
    AutoshardError, InvalidArgumentTypeError, PassContractError, PassFailed, SpecError,
)
from autoshard.passes.base import Pass, PassContext, ShardProgram
from autoshard.passes.instruments import Instrument, VerifyEach
from autoshard.passes.registry import PassRegistry, default_registry
from autoshard.passes.options import check_option_values
from autoshard.passes.spec import format_pass, parse_passes
from autoshard.passes.validate import INPUT_ARTIFACTS, Availability, check_instructions_read, dropped_by

__all__ = ["INPUT_ARTIFACTS", "Pipeline", "PipelineResult"]


@dataclass
class PipelineResult:
    """The final program and, per pass, ``(spec of the pass, program after it)``."""

    program: ShardProgram
    history: list[tuple[str, ShardProgram]] = field(default_factory=list)


@contextlib.contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """The objects alive before the run left out of the cycle collector's passes while it runs
    (``gc.freeze``): a full pass walked every object of the process (torch and transformers: ~500,000,
    0.3-0.4 s a pass, one or two a plan of the 12-layer GPT-2); what the run makes is collected as
    before. Left as it is where the process froze objects itself, or runs without the collector."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Pipeline:
    """An immutable sequence of passes. Equality and hashing compare the passes only.

    ``str(pipeline)`` is the canonical spec: for each pass its required options, every option not
    at its default, and, for a parsed pipeline, every option that was written explicitly; so
    ``Pipeline.parse(str(p)) == p`` always and ``str(Pipeline.parse(s)) == s`` for a canonical ``s``.
    """

    __slots__ = ("_passes", "_explicit", "_registry")

    def __init__(self, passes: Iterable[Pass] = (), *, registry: PassRegistry | None = None) -> None:
        items = tuple(passes)
        for i, p in enumerate(items):
            if isinstance(p, type) and issubclass(p, Pass):
                raise InvalidArgumentTypeError(
                    f"pipeline step {i} is the class {p.__name__}, not a pass: write {p.__name__}(...)"
                )
            if not isinstance(p, Pass):
                hint = "; to parse a text spec use Pipeline.parse(...)" if isinstance(p, str) else ""
                raise InvalidArgumentTypeError(f"pipeline step {i} is {p!r}, not a Pass instance{hint}")
            check_option_values(p)
        self._passes: tuple[Pass, ...] = items
        self._explicit: tuple[frozenset[str], ...] = (frozenset(),) * len(items)
        self._registry = registry

    @classmethod
    def parse(cls, text: str, registry: PassRegistry | None = None) -> "Pipeline":
        """Parse a text spec; names are looked up in ``registry`` (default: the default registry)."""
        parsed = parse_passes(text, registry)
        pipeline = cls([p for p, _ in parsed], registry=registry)
        pipeline._explicit = tuple(explicit for _, explicit in parsed)
        return pipeline

    @classmethod
    def _from_parts(
        cls, passes: tuple[Pass, ...], explicit: tuple[frozenset[str], ...], registry: PassRegistry | None
    ) -> "Pipeline":
        new = cls.__new__(cls)
        new._passes, new._explicit, new._registry = passes, explicit, registry
        return new

    # -- sequence conveniences ------------------------------------------------------------------
    @property
    def passes(self) -> tuple[Pass, ...]:
        return self._passes

    @property
    def registry(self) -> PassRegistry:
        return default_registry if self._registry is None else self._registry

    def __len__(self) -> int:
        return len(self._passes)

    def __iter__(self) -> Iterator[Pass]:
        return iter(self._passes)

    @overload
    def __getitem__(self, index: int) -> Pass: ...

    @overload
    def __getitem__(self, index: slice) -> "Pipeline": ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._from_parts(self._passes[index], self._explicit[index], self._registry)
        return self._passes[index]

    def __add__(self, other: "Pipeline | Pass | Iterable[Pass]") -> "Pipeline":
        if isinstance(other, Pass):
            other = Pipeline([other])
        elif not isinstance(other, Pipeline):
            try:
                other = Pipeline(other)
            except TypeError:
                return NotImplemented
        return self._from_parts(
            self._passes + other._passes, self._explicit + other._explicit,
            self._registry if self._registry is not None else other._registry,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pipeline):
            return NotImplemented
        return self._passes == other._passes

    def __hash__(self) -> int:
        return hash(self._passes)

    def sets_option(self, index: int, option: str) -> bool:
        """Whether the pass at ``index`` sets ``option``: written in the spec, or not at its default."""
        step = self._passes[index]
        default = {f.name: f.default for f in step.options()}.get(option, dataclasses.MISSING)
        return option in self._explicit[index] or getattr(step, option) != default

    def with_options(self, index: int, **changes: object) -> "Pipeline":
        """A copy whose pass at ``index`` has ``changes`` applied (and printed as written)."""
        step = self[index]
        unknown = sorted(set(changes) - {f.name for f in step.options()})
        if unknown:
            raise SpecError(f"pass '{step.name}' has no option {', '.join(map(repr, unknown))}; its options: "
                            + (", ".join(f.name for f in step.options()) or "none"))
        passes = list(self._passes)
        passes[index] = dataclasses.replace(passes[index], **changes)
        check_option_values(passes[index])
        explicit = list(self._explicit)
        explicit[index] = explicit[index] | frozenset(changes)
        return self._from_parts(tuple(passes), tuple(explicit), self._registry)

    def step_spec(self, index: int) -> str:
        """The spec of the pass at ``index``, as it appears in ``str(self)``."""
        return format_pass(self._passes[index], self._explicit[index])

    def __str__(self) -> str:
        return ",".join(self.step_spec(i) for i in range(len(self._passes)))

    def __repr__(self) -> str:
        return f"Pipeline.parse({str(self)!r})"

    # -- validation -----------------------------------------------------------------------------
    def validate(self, initial: frozenset[str] = frozenset({"model"})) -> None:
        """Check each pass's options (``Pass.check_options``) and that what it needs (``Pass.needs``)
        is provided by ``initial`` or an earlier pass (``passes.validate`` has the rules). A
        ``check_options`` that raises something other than an ``AutoshardError`` is reported as
        ``PassFailed``, naming the pass and a reproducing spec.

        Raises ``PipelineValidationError`` naming the pass, its position, the missing artifacts and
        what to do: the registered passes that provide it and where they go, a pass to move, or an
        input to pass.
        """
        spec = str(self)
        available = Availability(initial, self._passes, spec, self.registry)
        for i, p in enumerate(self._passes):
            try:
                p.check_options()
            except AutoshardError as exc:
                exc.add_note(_note(p, i, spec))
                raise
            except Exception as exc:  # a pass of the user's refusing with a builtin (ValueError): name it too
                failed = PassFailed(p.name, i, spec, exc)
                failed.add_note("raised by its check_options(), before any pass ran")
                raise failed from exc
            missing = available.missing(p)
            if missing:
                raise available.refuse(i, p, missing)
            available.add(i, p)
        check_instructions_read(self._passes, spec, self.registry, initial)

    # -- running --------------------------------------------------------------------------------
    def run(self, program: ShardProgram, ctx: PassContext | None = None) -> PipelineResult:
        """Validate against ``program.provided()``, then run each pass with the instrument hooks.

        A failing pass: an ``AutoshardError`` propagates unchanged with a note naming the pass, its
        position and the reproducing spec; any other exception becomes ``PassFailed`` raised from it.
        After each pass, the pipeline checks the pass's contract (``PassContractError``): it returned a
        ``ShardProgram``, set every artifact it ``provides``, and left every other artifact untouched.
        A pass that captures the graph anew drops the measurements of the old one (``facts``, ``times``).
        """
        with _older_objects_frozen():
            return self._run(program, ctx)

    def _run(self, program: ShardProgram, ctx: PassContext | None) -> PipelineResult:
        if not isinstance(program, ShardProgram):
            raise InvalidArgumentTypeError(f"Pipeline.run expects a ShardProgram, got {type(program).__name__}")
        ctx = PassContext() if ctx is None else ctx
        self.validate(program.provided())
        instruments: list[Instrument] = list(ctx.instruments)
        for inst in instruments:
            if not isinstance(inst, Instrument):
                raise InvalidArgumentTypeError(
                    f"instruments must be Instrument instances (Timing(), DumpDir(path), ...), got {inst!r}")
        if ctx.verify_each and not any(isinstance(inst, VerifyEach) for inst in instruments):
            instruments.insert(0, VerifyEach())
        spec, given = str(self), _given(ctx)
        history: list[tuple[str, ShardProgram]] = []

        self._hooks(instruments, "before_pipeline", (self, program), None)
        for index, pass_ in enumerate(self._passes):
            where = (pass_, index, spec, given)
            self._hooks(instruments, "before_pass", (pass_, index, program), where)
            try:
                result = pass_.run(program, ctx)
                self._check_contract(pass_, index, program, result)
                result = _without_stale(pass_, result)
            except Exception as exc:
                self._hooks(reversed(instruments), "after_pass_failed", (pass_, index, program, exc), where)
                if isinstance(exc, AutoshardError):
                    exc.add_note(_note(pass_, index, spec, given))
                    raise
                raise PassFailed(pass_.name, index, spec, exc, given) from exc
            self._hooks(reversed(instruments), "after_pass", (pass_, index, result), where)
            history.append((self.step_spec(index), result))
            program = result
        self._hooks(reversed(instruments), "after_pipeline", (self, program), None)
        return PipelineResult(program, history)

    @staticmethod
    def _hooks(instruments: Iterable[Instrument], hook: str, args: tuple,
               where: tuple[Pass, int, str, str] | None) -> None:
        for inst in instruments:
            try:
                getattr(inst, hook)(*args)
            except Exception as exc:
                note = f"raised by instrument {type(inst).__name__}.{hook}"
                if where is not None:
                    note += "; " + _note(*where)
                exc.add_note(note)
                raise

    @staticmethod
    def _check_contract(pass_: Pass, index: int, before: ShardProgram, after: object) -> None:
        label = f"pass '{pass_.name}' (position {index})"
        if not isinstance(after, ShardProgram):
            raise PassContractError(
                f"{label} returned {type(after).__name__}, not a ShardProgram: "
                "return dataclasses.replace(program, ...)",
                pass_.name,
                index,
            )
        for f in dataclasses.fields(ShardProgram):
            old, new = getattr(before, f.name), getattr(after, f.name)
            if f.name in pass_.provides:
                if new is None:
                    raise PassContractError(
                        f"{label} declares that it provides '{f.name}' but left it unset", pass_.name, index
                    )
            elif new is not old:
                raise PassContractError(
                    f"{label} changed the artifact '{f.name}', which is not in its `provides` "
                    f"({', '.join(sorted(pass_.provides)) or 'nothing'}): declare it or leave it untouched",
                    pass_.name,
                    index,
                )


def _without_stale(pass_: Pass, program: ShardProgram) -> ShardProgram:
    """``program`` without the measurements of a graph ``pass_`` captured anew (``dropped_by``)."""
    stale = {name: None for name in dropped_by(pass_) if getattr(program, name) is not None}
    return dataclasses.replace(program, **stale) if stale else program


def _note(pass_: Pass, index: int, spec: str, given: str = "") -> str:
    return f"in pass '{pass_.name}' (position {index}); reproduce with pipeline: {spec}{given}"


def _given(ctx: PassContext) -> str:
    """The memory model ``ctx`` plans with, for the reproduction: the spec alone plans for the
    default one (Adam, 1F1B with stage j of k holding k - j microbatches); "" when it is the default."""
    call = ctx.memory_model.as_call() if ctx.memory_model is not None else ""
    return f" with memory_model={call}" if call not in ("", "MemoryModel()") else ""
