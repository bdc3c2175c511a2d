"""The constraint passes: ``pin``, ``no-split`` and ``cut-before`` add to the ``constraints``
artifact, which the split passes read (``autoshard.passes.constraints``).

They need no graph: they name modules, classes and weights, which the split resolves against
its DAG, so they may come anywhere before it. A user's pass adds constraints the same way:
``dataclasses.replace(program, constraints=(program.constraints or SplitConstraints()).adding(...))``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from autoshard.errors import InvalidArgumentError
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.passes.constraints import SplitConstraints, names_of, pins_of
from autoshard.passes.pipeline import Pipeline


def _added(program: ShardProgram, **more: object) -> ShardProgram:
    """``program`` with its constraints (none yet: empty) extended by ``more``."""
    return dataclasses.replace(program, constraints=(program.constraints or SplitConstraints()).adding(**more))


def _check_names(pass_: Pass, names: tuple[str, ...]) -> None:
    if not names or not all(names):
        raise InvalidArgumentError(f"'{pass_.name}' needs at least one module path or class name: "
                                   f"write {pass_.name}{{modules=NAME}}")


@dataclass(frozen=True)
class PinPass(Pass):
    """Hold a module, every module of a class, or the readers of a weight in one stage.

    ``module`` is a module path, a class name or a parameter or buffer name; the split keeps
    each node inside it (or reading it) in stage ``stage``, and what it feeds no earlier.
    Several names pin each to that stage. Example: ``pin{module=encoder stage=0}``.
    """

    name: ClassVar[str] = "pin"
    provides: ClassVar[frozenset[str]] = frozenset({"constraints"})

    module: tuple[str, ...] = option((), help="module paths, class names or weight names to pin")
    stage: int = option(0, help="the stage that holds them (0 is the first)")
    optional: bool = option(False, help="names the graph does not run or read pin nothing (false: refused)")

    def check_options(self) -> None:
        if not self.module or not all(self.module):
            raise InvalidArgumentError(
                "'pin' needs a module path, class or weight name: write pin{module=NAME stage=J}")
        if self.stage < 0:
            raise InvalidArgumentError(f"'pin' needs stage >= 0, got stage={self.stage}")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return _added(program, pins=[(name, self.stage) for name in self.module], optional=self.optional)


@dataclass(frozen=True)
class NoSplitPass(Pass):
    """Keep modules whole: each module path, or each module of a class, sits in one stage.

    Example: ``no-split{modules=TransformerEncoderLayer}``.
    """

    name: ClassVar[str] = "no-split"
    provides: ClassVar[frozenset[str]] = frozenset({"constraints"})

    modules: tuple[str, ...] = option((), help="module paths or class names kept whole")
    optional: bool = option(False, help="names the graph does not run keep nothing whole (false: refused)")

    def check_options(self) -> None:
        _check_names(self, self.modules)

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return _added(program, no_split=self.modules, optional=self.optional)


@dataclass(frozen=True)
class CutBeforePass(Pass):
    """Start a stage at each module: at the first node that runs inside it.

    Example: ``cut-before{modules=layers.2,layers.4}``.
    """

    name: ClassVar[str] = "cut-before"
    provides: ClassVar[frozenset[str]] = frozenset({"constraints"})

    modules: tuple[str, ...] = option((), help="module paths at whose first node a stage starts")
    optional: bool = option(False, help="paths the graph does not run start no stage (false: refused)")

    def check_options(self) -> None:
        _check_names(self, self.modules)

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return _added(program, cut_before=self.modules, optional=self.optional)


#: The passes that add to the constraints, each with an ``optional`` option.
CONSTRAINT_PASSES = (PinPass, NoSplitPass, CutBeforePass)


def with_constraints(pipeline: Pipeline, pin: Any = None, no_split: Any = None, cut_before: Any = None,
                     optional: bool = False) -> Pipeline:
    """``pipeline`` with ``pin``, ``no-split`` and ``cut-before`` passes for a call's constraints
    (``pin={name: stage}``, lists of names), placed before the first pass that reads them, so the
    pipeline's spec (in errors and saved plans) says what was asked. ``optional``: the names may
    be of what the graph does not run or read."""
    steps: list[Pass] = []
    if pin is not None:
        by_stage: dict[int, list[str]] = {}
        for name, stage in pins_of(pin):
            by_stage.setdefault(stage, []).append(name)
        steps += [PinPass(module=tuple(names), stage=stage, optional=optional)
                  for stage, names in sorted(by_stage.items())]
    if no_split is not None and names_of("no_split", no_split):
        steps.append(NoSplitPass(modules=names_of("no_split", no_split), optional=optional))
    if cut_before is not None and names_of("cut_before", cut_before):
        steps.append(CutBeforePass(modules=names_of("cut_before", cut_before), optional=optional))
    if not steps:
        return pipeline
    reader = next((i for i, step in enumerate(pipeline) if "constraints" in step.reads | step.requires), None)
    if reader is None:
        given = ", ".join(f"{n}=" for n, v in (("pin", pin), ("no_split", no_split), ("cut_before", cut_before)) if v)
        raise InvalidArgumentError(f"{given} was given, but no pass of the pipeline '{pipeline}' reads constraints; "
                                   "add 'split'")
    return pipeline[:reader] + steps + pipeline[reader:]
