"""The split passes: adapters from the program to the split search (``autoshard.costs.split_search``).

``split`` takes the strategy as an option; ``split-greedy``, ``split-uniform``, ``split-exact``
and ``split-fixed-order`` fix it, so a pipeline names the policy it uses. Each pass turns its
options, the ``constraints`` artifact and the run's cost models into a ``SplitRequest`` and
returns the ``Partition`` the search finds: module-level constraints resolved to node sets
(``autoshard.graph.scopes``), per-node and per-stage costs read through ``passes.analyses`` (which
caches them for the run). The search places tied weights, holds ``max-memory`` and balances
training memory for ``cost=memory``; its module docstrings say how.

A split reads the cost it balances off the DAG, so one whose cost (or, with ``max-memory``, memory
cost) reads a measurement needs it (``needs``): ``cost=flops``, ``activations`` or ``memory`` the
``facts`` of ``shape-prop``, ``cost=time`` the ``times`` of ``profile``, both before ``build-dag``.

The bounded strategies (``split``, ``split-fixed-order``, ``split-exact``) take the tolerance,
constraints and budgets; ``split-greedy`` and ``split-uniform``, kept for comparison, use only
the stage count and cost, and refuse the others by name when a spec sets them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import AbstractSet, Any, ClassVar, Sequence

import networkx as nx

from autoshard.capture.guard import check_inputs
from autoshard.costs.models import memory_parts
from autoshard.costs.split_search import MemoryCount, SplitRequest, search_split, summed_memory, training_memory
from autoshard.costs.ties import tie_groups
from autoshard.errors import InvalidArgumentError, PinConflictError
from autoshard.graph.constraints import StageRange
from autoshard.graph.invariants import check_order
from autoshard.graph.split import check_strategy, check_tolerance, honours_constraints, strategies
from autoshard.graph.scopes import check_cuts_outside_no_split, cut_before_nodes, no_split_modules, pinned_nodes
from autoshard.passes.analyses import (
    charges_weights, check_cost_name, cost_reads, held_stage_costs, memory_model, node_costs,
)
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.passes.constraints import SplitConstraints
from autoshard.passes.options import kebab
from autoshard.passes.stages import no_stage_count


def check_cut_order(program: ShardProgram) -> None:
    """Refuse an ``order`` that is not a topological order of the DAG: the splitter would silently
    cut along another one (or fail on a missing node), hiding the mistake of the pass that made it."""
    try:
        check_order(program.dag, program.order)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"the 'order' artifact is not a topological order of the DAG ({exc}); the pass that provides "
            "'order' must list every DAG node once, each after its inputs") from exc


def pinned_stages(dag: nx.DiGraph, pins: Sequence[tuple[str, int]],
                  optional: AbstractSet[str] = frozenset()) -> dict[str, StageRange]:
    """Each node a pin holds, with its stage; a node two pins hold at different stages is refused.
    A name in ``optional`` that the graph does not run or read holds nothing."""
    found: dict[str, StageRange] = {}
    held_by = pinned_nodes(dag, [name for name, _ in pins], optional)
    for name, stage in pins:
        for node in sorted(held_by.get(name, ()), key=str):
            held = found.setdefault(node, StageRange(stage, stage, f"pin {name!r}"))
            if held.first != stage:
                raise PinConflictError(
                    f"{held.label} holds node {node!r} in stage {held.first} but pin {name!r} holds it in stage "
                    f"{stage} (one is inside the other, or they share a weight); pin them to one stage",
                    str(node), (held.first, stage))
    return found


def inputs_checked_first(dag: nx.DiGraph) -> dict[str, StageRange]:
    """The check of the model's inputs, held in stage 0: the first stage takes a call's arguments through it.
    A split free to place it, at no cost, after a stage of mode checks alone left stages that refused their
    own example (Reformer, k = 4); ``SplitPass.run`` then splits again with it held there. (``greedy`` and
    ``uniform``, which hold no node to a stage, may still place it so.)"""
    target = f"{check_inputs.__module__}.{check_inputs.__qualname__}"
    return {node: StageRange(0, 0, "the check of the model's inputs") for node, data in dag.nodes(data=True)
            if data.get("target") == target}


#: Strategies kept for comparison: they do not bound the bottleneck, so a tolerance means nothing to them.
UNBOUNDED_STRATEGIES = ("greedy", "uniform")
#: Options only the bounded strategies honour, refused by name elsewhere.
HARD_OPTIONS = ("cut_before", "no_split", "capacities", "max_memory")


@dataclass(frozen=True)
class _SplitPassBase(Pass):
    """What every split pass shares: the stage count, the cost, the checks and the run (not registered).

    A subclass declares the other options (``_BoundedSplit``, ``_BaselineSplit``) and provides
    ``strategy``, the ``split_dag`` strategy: an option of ``split``, a class constant of the others.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"dag", "order"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})
    reads: ClassVar[frozenset[str]] = frozenset({"constraints"})

    stages: int | None = option(None, help="number of stages k (shard_model fills it in)")
    cost: str = option("params", help="registered cost model to balance (params, nodes, flops, ...)")

    def needs(self) -> frozenset[str]:
        """The DAG and order, and the measurements the cost reads (``cost=flops``: ``facts``,
        ``cost=time``: ``times``), as does the memory cost when there is a ``max-memory``."""
        needs = self.requires | cost_reads(self.cost)
        return needs | cost_reads(self.memory_cost) if self.max_memory else needs

    def strategy_options(self) -> dict[str, Any]:
        """Options for the strategy itself (none unless a subclass has some)."""
        return {}

    def _unused_names(self) -> tuple[str, ...]:
        """Options the strategy has no use for: one kept for comparison does not bound the bottleneck."""
        return ("tolerance",) if self.strategy in UNBOUNDED_STRATEGIES else ()

    def options_unused(self) -> dict[str, Any]:
        """The options set away from their defaults that the strategy has no use for, with their defaults."""
        defaults = {f.name: f.default for f in self.options()}
        return {name: defaults[name] for name in self._unused_names()
                if name in defaults and getattr(self, name) != defaults[name]}

    def check_options(self) -> None:
        check_cost_name(self.cost)
        check_cost_name(self.memory_cost)
        check_tolerance(self.tolerance)
        unused = self.options_unused()
        if unused:
            given = ", ".join(f"{kebab(name)}={getattr(self, name)!r}" for name in unused)
            raise InvalidArgumentError(
                f"'{self.name}' with strategy {self.strategy!r} has no use for {given}, which would change "
                "nothing: leave it out, or pick a strategy that takes it (min-cut)")
        self._check_stage_options()

    def _check_stage_options(self) -> None:
        """Refuse, under the names the spec uses and before any capture, what the splitter would refuse
        only after it: a stage count below 1, per-stage values that are not usable numbers or not one
        per stage, and constraints given to a strategy that cannot keep them."""
        if self.stages is not None and self.stages < 1:
            raise InvalidArgumentError(f"'{self.name}' needs stages >= 1, got stages={self.stages}")
        for name, positive in (("capacities", True), ("max_memory", False)):
            values = getattr(self, name)
            for j, value in enumerate(values):
                if not math.isfinite(value) or value < 0 or (positive and value == 0):
                    raise InvalidArgumentError(
                        f"'{self.name}' {kebab(name)}: entry {j} is {value!r}; each must be finite and "
                        f"{'> 0' if positive else '>= 0'}")
            if values and self.stages is not None and len(values) not in (1, self.stages):
                raise InvalidArgumentError(
                    f"'{self.name}' {kebab(name)} has {len(values)} values for {self.stages} stages: give one per "
                    "stage, or one for every stage")
        hard = [kebab(n) for n in HARD_OPTIONS if getattr(self, n)]
        if hard and not honours_constraints(self.strategy):
            raise InvalidArgumentError(
                f"'{self.name}' with strategy {self.strategy!r} cannot honour {', '.join(hard)}: leave "
                f"{'it' if len(hard) == 1 else 'them'} out, or pick a strategy that does "
                f"({', '.join(s for s in strategies() if honours_constraints(s))})")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        if self.stages is None:
            raise no_stage_count(self)
        given = program.constraints or SplitConstraints()
        if given.names() and not honours_constraints(self.strategy):
            raise InvalidArgumentError(
                f"'{self.name}' with strategy {self.strategy!r} cannot honour {', '.join(given.names())} (from the "
                "passes before it or the call): drop them, or pick a strategy that does "
                f"({', '.join(s for s in strategies() if honours_constraints(s))})")
        check_cut_order(program)
        request = self.request(program, ctx, given)
        partition = search_split(request)
        checked = inputs_checked_first(program.dag)
        if any(partition.assignment[node] for node in checked) and honours_constraints(self.strategy):
            # rare, so no split pays for the range otherwise (every local move would check it)
            partition = search_split(dataclasses.replace(request, stage_ranges={**request.stage_ranges, **checked}))
        return dataclasses.replace(program, partition=partition)

    def request(self, program: ShardProgram, ctx: PassContext, given: SplitConstraints) -> SplitRequest:
        """The search this pass asks for: its options, ``given`` resolved to nodes, the run's cost models."""
        dag, order, k = program.dag, program.order, self.stages
        no_split = no_split_modules(dag, (*self.no_split, *given.no_split), given.optional)
        cuts = cut_before_nodes(dag, order, (*self.cut_before, *given.cut_before), given.optional)
        check_cuts_outside_no_split(order, cuts, no_split)
        labels: dict[str, str] = {}
        for path, node in cuts:  # errors name each cut by the path the user wrote, not its node
            labels.setdefault(node, path)
        training = self.cost == "memory" and self._exact_memory(ctx)
        memory = self._memory_count(program, ctx) if self.max_memory or training else None
        return SplitRequest(
            dag, order, k, self.strategy,
            node_costs=lambda apart: node_costs(program, ctx, self.cost, apart),
            # training memory is balanced as the budgets count it: one count of a plan serves both
            stage_totals=memory.stage_totals if training and memory is not None else
            lambda assignment: held_stage_costs(program, ctx, self.cost, assignment, k),
            charges_weights=charges_weights(ctx, self.cost),
            tolerance=self.tolerance, strategy_options=self.strategy_options(),
            capacities=self.capacities, max_memory=self.max_memory, memory=memory,
            training_memory_cost=training, keep_tied=self.keep_tied,
            ties=ctx.analysis(("tie-groups", dag), lambda: tie_groups(dag)),
            together={label: nodes for label, (_, nodes) in no_split.items()},
            cut_before=labels,
            stage_ranges=ctx.analysis(("pins", dag, given), lambda: pinned_stages(dag, given.pins, given.optional)),
        )

    def _exact_memory(self, ctx: PassContext) -> bool:
        """Whether ``max-memory`` limits the training-memory model (weights once, activations in flight)."""
        return self.memory_cost == "memory" and charges_weights(ctx, "memory")

    def _memory_count(self, program: ShardProgram, ctx: PassContext) -> MemoryCount:
        """How the memory ``max-memory`` limits is counted, read through the run's cached models."""
        dag, k = program.dag, self.stages
        if not self._exact_memory(ctx):
            return summed_memory(self.memory_cost, lambda apart: node_costs(program, ctx, self.memory_cost, apart),
                                 lambda assignment: held_stage_costs(program, ctx, self.memory_cost, assignment, k))
        model = memory_model(ctx)
        return training_memory(dag, k, model, lambda apart: ctx.analysis(
            ("memory-parts", dag, apart), lambda: memory_parts(dag, apart, model)))


@dataclass(frozen=True)
class _BoundedSplit(_SplitPassBase):
    """The options of the strategies that bound the bottleneck and keep constraints (not registered)."""

    tolerance: float = option(0.0, help="allowed bottleneck above the optimum, as a fraction")
    cut_before: tuple[str, ...] = option((), help="module paths at whose first node a stage starts")
    no_split: tuple[str, ...] = option((), help="module paths or class names kept whole in one stage")
    capacities: tuple[float, ...] = option((), help="relative speed of each stage; cost / speed is balanced")
    max_memory: tuple[float, ...] = option((), help="memory budget per stage (one value: every stage)")
    memory_cost: str = option("memory", help="cost model that max-memory limits (memory: exact training memory)")
    keep_tied: bool = option(True, help="keep nodes sharing a weight in one stage when the balance allows and "
                                        "count a shared weight once per stage; false: charge it to its first reader")


@dataclass(frozen=True)
class _BaselineSplit(_SplitPassBase):
    """A strategy kept for comparison (not registered): it bounds nothing and keeps no constraints,
    so its only options are the stage count and the cost; a spec setting another is refused as an
    unknown option, naming the ones it has. The shared code reads the others as these constants."""

    tolerance: ClassVar[float] = 0.0
    cut_before: ClassVar[tuple[str, ...]] = ()
    no_split: ClassVar[tuple[str, ...]] = ()
    capacities: ClassVar[tuple[float, ...]] = ()
    max_memory: ClassVar[tuple[float, ...]] = ()
    memory_cost: ClassVar[str] = "memory"
    keep_tied: ClassVar[bool] = True


@dataclass(frozen=True)
class SplitPass(_BoundedSplit):
    """Cut the ordered DAG into exactly k stages: smallest bottleneck, then fewest boundary bytes.

    The bottleneck (the costliest stage) is at most (1 + tolerance) times the best achievable
    for the given order; among such splits the one with the fewest bytes crossing boundaries
    wins. Values used several stages later are carried through. Example:
    ``split{stages=4 cost=params cut-before=layers.2 no-split=TransformerEncoderLayer}``.
    """

    name: ClassVar[str] = "split"

    strategy: str = option("min-cut", help="splitting strategy of autoshard.graph.split_dag")
    moves: bool = option(True, help="min-cut: local moves after the refinement (false: faster, more bytes)")
    coarsen: bool = option(True, help="min-cut: also split coarse graphs, single-reader values merged "
                                      "into their readers (false: faster, more bytes)")

    def strategy_options(self) -> dict[str, Any]:
        return {"moves": self.moves, "coarsen": self.coarsen} if self.strategy == "min-cut" else {}

    def _unused_names(self) -> tuple[str, ...]:
        return super()._unused_names() + (() if self.strategy == "min-cut" else ("moves", "coarsen"))

    def check_options(self) -> None:
        check_strategy(self.strategy)
        super().check_options()


@dataclass(frozen=True)
class SplitFixedOrderPass(_BoundedSplit):
    """Split as contiguous runs of the given order: the fixed-order optimum (no refinement).

    Same bound as ``split``; among the splits of the order itself, the fewest boundary bytes.
    Example: ``split-fixed-order{stages=4}``.
    """

    name: ClassVar[str] = "split-fixed-order"
    strategy: ClassVar[str] = "fixed-order"


@dataclass(frozen=True)
class SplitExactPass(_BoundedSplit):
    """Split by MILP: the fewest boundary bytes over all ordered splits within the bound.

    Warm-started from ``min-cut``; after ``time-limit`` seconds it keeps the best split found,
    and the partition's ``info.proven_optimal`` says whether HiGHS proved it optimal. A tied
    weight the first split places apart costs a few more splits (see the module docstring), each
    with its own time limit. Needs the ``exact`` extra (highspy). Example:
    ``split-exact{stages=8 time-limit=30}``.
    """

    name: ClassVar[str] = "split-exact"
    strategy: ClassVar[str] = "exact"

    time_limit: float = option(30.0, help="seconds the solver may search before keeping its best")

    def strategy_options(self) -> dict[str, Any]:
        return {"time_limit": self.time_limit}

    def check_options(self) -> None:
        super().check_options()
        if not (math.isfinite(self.time_limit) and self.time_limit > 0):
            raise InvalidArgumentError(f"'{self.name}' needs time-limit > 0 seconds, got {self.time_limit!r}")


@dataclass(frozen=True)
class SplitGreedyPass(_BaselineSplit):
    """fairscale's greedy rule, for comparison: close a stage once it reaches total / k.

    Has no tolerance (refused) and takes no constraints besides keep-tied (which it only reports).
    Example: ``split-greedy{stages=4}``.
    """

    name: ClassVar[str] = "split-greedy"
    strategy: ClassVar[str] = "greedy"


@dataclass(frozen=True)
class SplitUniformPass(_BaselineSplit):
    """Equal numbers of nodes per stage, ignoring costs, for comparison.

    Has no tolerance (refused) and takes no constraints besides keep-tied (which it only reports).
    Example: ``split-uniform{stages=4}``.
    """

    name: ClassVar[str] = "split-uniform"
    strategy: ClassVar[str] = "uniform"
