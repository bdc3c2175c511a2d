"""The pass protocol: a frozen dataclass whose fields are its options.

A pass reads some fields of an immutable ``ShardProgram`` (its ``requires``) and returns a new
program with more fields filled in (its ``provides``). The user's model is never written to.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from autoshard.inputs import ExampleInputs
from autoshard.passes.constraints import SplitConstraints
from autoshard.passes.options import format_pass

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    import networkx as nx
    import torch

    from autoshard.capture.result import TraceResult
    from autoshard.costs.facts import NodeFacts
    from autoshard.costs.memory_model import MemoryModel
    from autoshard.costs.timing import TimeProfile
    from autoshard.graph.partition import Partition
    from autoshard.sharded import ShardedModel

__all__ = ["ExampleInputs", "Instrument", "Pass", "PassContext", "ShardProgram", "SplitConstraints", "option"]


@dataclass(frozen=True)
class ShardProgram:
    """Everything the pipeline knows about one model; each field is an *artifact*.

    A field is "provided" once it is not ``None``. Passes return ``dataclasses.replace``
    copies, so every intermediate program stays valid and can be dumped or compared.
    ``facts`` (``shape-prop``: shapes, FLOPs, saved tensors, by node name) and ``times``
    (``profile``) are measurements of ``traced``'s nodes; ``costs.facts`` reads them off the nodes.
    """

    model: "torch.nn.Module"
    example_inputs: ExampleInputs | None = None
    constraints: SplitConstraints | None = None
    traced: "TraceResult | None" = None
    facts: "Mapping[str, NodeFacts] | None" = None
    times: "TimeProfile | None" = None
    dag: "nx.DiGraph | None" = None
    order: tuple[str, ...] | None = None
    partition: "Partition | None" = None
    sharded: "ShardedModel | None" = None
    verification: str | None = None

    #: Artifacts that only instruct later passes: one no later pass reads changes nothing.
    INSTRUCTIONS: ClassVar[frozenset[str]] = frozenset({"constraints"})
    #: Measurements of the traced graph's nodes: ``build-dag`` copies them onto the DAG, so a pass that
    #: needs one and the DAG needs a DAG built after it; a new capture has none of them.
    MEASUREMENTS: ClassVar[frozenset[str]] = frozenset({"facts", "times"})

    @classmethod
    def artifact_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def provided(self) -> frozenset[str]:
        return frozenset(n for n in self.artifact_names() if getattr(self, n) is not None)


def option(default: Any = dataclasses.MISSING, help: str = "") -> Any:
    """Declare a pass option: a dataclass field with a one-line help text."""
    if default is dataclasses.MISSING:
        return field(metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class PassContext:
    """Explicit run context: instruments, the models the run plans with, the analysis cache and
    checking switches.

    ``memory_model`` is the optimizer and schedule training memory is planned for (None: Adam,
    1F1B with stage j of k holding k - j microbatches); ``cost_models`` the run's own cost models by name (a user's
    ``cost(node)`` function); ``analyses`` caches results keyed by the artifacts they read.
    """

    instruments: list["Instrument"] = field(default_factory=list)
    analyses: dict[Any, Any] = field(default_factory=dict)
    verify_each: bool = False
    memory_model: "MemoryModel | None" = None
    cost_models: dict[str, Callable[["ShardProgram"], dict[str, float]]] = field(default_factory=dict)

    def analysis(self, key: Any, compute: Callable[[], Any]) -> Any:
        """Return a cached analysis result, computing it on first use.

        Artifacts are immutable, so keys built from artifact identities invalidate themselves
        when a pass provides a new artifact.
        """
        if key not in self.analyses:
            self.analyses[key] = compute()
        return self.analyses[key]


@dataclass(frozen=True)
class Pass(ABC):
    """A named, typed unit of work over a ``ShardProgram``.

    Subclasses set ``name``, ``requires`` and ``provides`` and implement ``run``. Their dataclass
    fields are their options; declare them with ``option(default, help=...)``. ``reads`` names
    artifacts the pass uses when an earlier pass provides them but runs without (``constraints``).
    """

    name: ClassVar[str]
    requires: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()
    reads: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        """Return a new program with this pass's ``provides`` filled in."""

    def needs(self) -> frozenset[str]:
        """The artifacts this pass needs with its options: ``requires`` plus those its options call for.
        Validation checks these, so a pipeline missing one is refused before anything runs."""
        return self.requires

    def check_options(self) -> None:
        """Refuse option values this pass cannot work with. Called when its pipeline is validated,
        before any pass runs, so a mistake costs no capture. The default checks nothing."""

    def __str__(self) -> str:
        """The canonical text spec of this pass, e.g. ``split{stages=4}``."""
        try:
            return format_pass(self)
        except Exception:  # an option value the text syntax cannot express
            return repr(self)

    @classmethod
    def summary(cls) -> str:
        """The first line of the docstring, listed by ``autoshard passes``."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    @classmethod
    def options(cls) -> tuple[dataclasses.Field, ...]:
        return tuple(f for f in dataclasses.fields(cls) if f.init)


class Instrument:
    """Base class; every hook is a no-op. Override the ones you need.

    ``index`` is the 0-based position of the pass in the pipeline. ``after_pass`` receives the
    program the pass returned; ``after_pass_failed`` the program it was given and the exception.
    The pipeline hooks receive the ``Pipeline`` being run, annotated as the sequence of passes it
    is (``passes.pipeline`` imports this module).
    """

    def before_pipeline(self, pipeline: Sequence[Pass], program: ShardProgram) -> None:
        pass

    def before_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        pass

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        pass

    def after_pass_failed(self, pass_: Pass, index: int, program: ShardProgram, exc: BaseException) -> None:
        pass

    def after_pipeline(self, pipeline: Sequence[Pass], program: ShardProgram) -> None:
        pass
