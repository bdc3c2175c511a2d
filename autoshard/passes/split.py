"""The split passes: adapters from the program to ``autoshard.graph.split_dag``.

``split`` takes the strategy as an option; ``split-greedy``, ``split-uniform``, ``split-exact``
and ``split-fixed-order`` fix it, so a pipeline names the policy it uses. All share the module-
level constraints, resolved here to node sets (``autoshard.graph.scopes``).

Two things the splitter's additive node costs cannot say directly are settled here:

* Tied weights. ``params`` and ``memory`` count a shared weight once per stage that holds it, so
  what a node costs depends on where the weight's other readers go. The pass splits with each
  tie charged to its first reader and preferred in one stage; if that separates a tie, it
  splits again under other placements (``costs.ties.tie_placements``: a tie kept together, or
  charged to every reader) and keeps the plan with the lowest true bottleneck, every weight
  counted once per stage holding it. ``SplitInfo.bottleneck`` is that true figure, and
  ``SplitInfo.separated`` lists the shared weights whose readers ended up in several stages.
  ``keep-tied=false`` skips the search and the preference: each shared weight is charged to its
  first reader, as a tie-unaware splitter would (for comparison).
* Training memory. With ``max-memory`` and ``memory-cost=memory`` (the default) each stage must
  fit the model of ``autoshard.costs.memory`` exactly: weight state once, plus activations times
  the microbatches in flight at that stage under 1F1B. A budget no split fits is reported with
  the stage that is short and by how much, measured on the best-balanced plan. ``cost=memory``
  balances that same per-stage memory: the splitter sees one microbatch per node, so the pass
  bisects on a memory bound held as per-stage budgets (``min-cut`` and ``fixed-order``; other
  strategies balance the one-microbatch node costs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import AbstractSet, Any, ClassVar, Mapping, Sequence

import networkx as nx

from autoshard.costs.memory import memory_shortfall, stage_memory
from autoshard.costs.models import memory_parts
from autoshard.costs.ties import TieGroup, TiePlacement, charged_apart, tie_groups, tie_placements
from autoshard.errors import InfeasibleSplitError, InvalidArgumentError
from autoshard.graph import Partition, split_dag
from autoshard.graph.constraints import ACTIVATION_MEMORY, MEMORY, StageRange
from autoshard.graph.invariants import check_order
from autoshard.graph.split import check_strategy, check_tolerance, honours_constraints, strategies
from autoshard.graph.scopes import check_cuts_outside_no_split, cut_before_nodes, no_split_modules, pinned_nodes
from autoshard.passes.analyses import charges_weights, check_cost_name, held_stage_costs, memory_model, node_costs
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.passes.constraints import SplitConstraints
from autoshard.passes.options import kebab


def weighted_in_order(
    dag: nx.DiGraph, order: Sequence[str], costs: Mapping[str, float],
    extra: Mapping[str, Mapping[str, float]] | None = None,
) -> nx.DiGraph:
    """A copy of ``dag`` with ``cost`` and each ``extra`` attribute set, inserted in ``order``."""
    weighted = nx.DiGraph()
    for node in order:
        values = {name: per_node[node] for name, per_node in (extra or {}).items()}
        weighted.add_node(node, **{**dag.nodes[node], "cost": costs[node], **values})
    weighted.add_edges_from(dag.edges(data=True))
    return weighted


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
    for name, stage in pins:
        try:
            nodes = pinned_nodes(dag, name)
        except InvalidArgumentError:
            if name in optional:
                continue
            raise
        for node in sorted(nodes, key=str):
            held = found.setdefault(node, StageRange(stage, stage, f"pin {name!r}"))
            if held.first != stage:
                raise InfeasibleSplitError(
                    f"{held.label} holds node {node!r} in stage {held.first} but pin {name!r} holds it in stage "
                    f"{stage} (one is inside the other, or they share a weight); pin them to one stage")
    return found


#: Strategies whose ``cost=memory`` split searches the training-memory bound, and how many halvings.
MEMORY_SEARCH_STRATEGIES = ("min-cut", "fixed-order")
MEMORY_SEARCH_STEPS = 12
#: Strategies kept for comparison: they do not bound the bottleneck, so a tolerance means nothing to them.
UNBOUNDED_STRATEGIES = ("greedy", "uniform")


def _each_stage(values: tuple[float, ...], k: int) -> tuple[float, ...]:
    """One value per stage; a single value applies to every stage (the splitter checks the rest)."""
    return values * k if len(values) == 1 else values


@dataclass(frozen=True)
class _Attempt:
    """One split and what it truly costs: bottleneck, tie groups separated, fit in the budgets."""

    partition: Partition
    separated: tuple[str, ...]
    memory: tuple[float, ...]
    fits: bool

    def rank(self) -> tuple[float, int, float]:
        """Lower is better: the true bottleneck, then fewer separated ties, then fewer boundary bytes."""
        info = self.partition.info
        return info.bottleneck, len(info.separated), info.boundary_bytes


@dataclass(frozen=True)
class _SplitWithConstraints(Pass):
    """Shared options and behaviour of the split passes (not registered itself).

    Each subclass provides ``strategy``, the ``split_dag`` strategy: an option of ``split``, a
    class constant of the others.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"dag", "order"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})
    reads: ClassVar[frozenset[str]] = frozenset({"constraints"})

    stages: int | None = option(None, help="number of stages k (shard_model fills it in)")
    cost: str = option("params", help="registered cost model to balance (params, nodes, flops, ...)")
    tolerance: float = option(0.0, help="allowed bottleneck above the optimum, as a fraction")
    cut_before: tuple[str, ...] = option((), help="module paths at whose first node a stage starts")
    no_split: tuple[str, ...] = option((), help="module paths or class names kept whole in one stage")
    capacities: tuple[float, ...] = option((), help="relative speed of each stage; cost / speed is balanced")
    max_memory: tuple[float, ...] = option((), help="memory budget per stage (one value: every stage)")
    memory_cost: str = option("memory", help="cost model that max-memory limits (memory: exact training memory)")
    keep_tied: bool = option(True, help="keep nodes sharing a weight in one stage when the balance allows and "
                                        "count a shared weight once per stage; false: charge it to its first reader")

    def strategy_options(self) -> dict[str, Any]:
        """Options for the strategy itself (none unless a subclass has some)."""
        return {}

    def _unused_names(self) -> tuple[str, ...]:
        """Options the strategy has no use for: one kept for comparison does not bound the bottleneck."""
        return ("tolerance",) if self.strategy in UNBOUNDED_STRATEGIES else ()

    def options_unused(self) -> dict[str, Any]:
        """The options set away from their defaults that the strategy has no use for, with their defaults."""
        defaults = {f.name: f.default for f in self.options()}
        return {name: defaults[name] for name in self._unused_names() if getattr(self, name) != defaults[name]}

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
        hard = [kebab(n) for n in ("cut_before", "no_split", "capacities", "max_memory") if getattr(self, n)]
        if hard and not honours_constraints(self.strategy):
            raise InvalidArgumentError(
                f"'{self.name}' with strategy {self.strategy!r} cannot honour {', '.join(hard)}: leave "
                f"{'it' if len(hard) == 1 else 'them'} out, or pick a strategy that does "
                f"({', '.join(s for s in strategies() if honours_constraints(s))})")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        if self.stages is None:
            raise InvalidArgumentError(f"'{self.name}' needs a stage count: write {self.name}{{stages=K}}")
        given = program.constraints or SplitConstraints()
        if given.names() and not honours_constraints(self.strategy):
            raise InvalidArgumentError(
                f"'{self.name}' with strategy {self.strategy!r} cannot honour {', '.join(given.names())} (from the "
                "passes before it or the call): drop them, or pick a strategy that does "
                f"({', '.join(s for s in strategies() if honours_constraints(s))})")
        check_cut_order(program)
        split = self._split(program, ctx)
        if not self._balances_training_memory(ctx):
            return split
        return self._memory_balanced(program, ctx, split.partition.info.bottleneck)

    def _balances_training_memory(self, ctx: PassContext) -> bool:
        """Whether ``cost=memory`` is the training-memory model, whose activations count once per
        microbatch in flight: not an additive node cost, so it is balanced by a budget search.
        Only for the strategies cheap enough to probe (``split`` with min-cut, ``split-fixed-order``)."""
        return (self.cost == "memory" and self._exact_memory(ctx)
                and getattr(self, "strategy", None) in MEMORY_SEARCH_STRATEGIES)

    def _memory_balanced(self, program: ShardProgram, ctx: PassContext, found: float) -> ShardProgram:
        """The split whose costliest stage, in training memory with every microbatch in flight, is
        within the tolerance of the least any probe reaches: bisect on a memory bound applied as
        per-stage budgets (scaled by capacity, capped by ``max-memory``), then split within it."""
        k = self.stages
        speeds = _each_stage(self.capacities or (1.0,), k)
        caps = _each_stage(self.max_memory, k) if self.max_memory else (math.inf,) * k

        def within(bound: float) -> _SplitWithConstraints:
            return dataclasses.replace(self, max_memory=tuple(min(bound * s, c) for s, c in zip(speeds, caps)))

        def fits(bound: float) -> bool:
            probe = within(bound)
            if isinstance(probe, SplitPass):
                probe = dataclasses.replace(probe, moves=False)
            try:
                return probe._split(program, ctx).partition.info.bottleneck <= bound * (1 + 1e-9)
            except InfeasibleSplitError:
                return False

        low, high = 0.0, found
        for _ in range(MEMORY_SEARCH_STEPS):
            middle = (low + high) / 2
            low, high = (low, middle) if fits(middle) else (middle, high)
        bound = high * (1 + self.tolerance)
        split = within(bound)._split(program, ctx).partition
        # The inner split's bound is on one microbatch's memory; the plan is held to this one.
        info = dataclasses.replace(split.info, bound=bound)
        return dataclasses.replace(program, partition=dataclasses.replace(split, info=info))

    def _split(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        """Split once under the pass's options (ties searched, ``max-memory`` held)."""
        groups = ctx.analysis(("tie-groups", program.dag), lambda: tie_groups(program.dag))
        first_try = TiePlacement(preferred=groups if self.keep_tied else ())
        try:
            first = self._attempt(program, ctx, groups, first_try)
        except InfeasibleSplitError as exc:
            if not self.max_memory:
                raise
            first = self._attempt(program, ctx, groups, first_try, budgets=False)
            if not first.fits:
                raise InfeasibleSplitError(
                    f"no split into {self.stages} stages fits max-memory ({exc}); in the best-balanced plan "
                    f"{self._shortfall(program, ctx, first)}") from exc
        attempts = [first]
        if first.separated and first.partition.info.bound is not None:  # a bounded strategy, not a baseline
            for placement in self._retries(ctx, groups, first):
                with contextlib.suppress(InfeasibleSplitError):  # e.g. a tie kept together no split allows
                    attempts.append(self._attempt(program, ctx, groups, placement))
        fitting = [a for a in attempts if a.fits]
        if not fitting:
            raise InfeasibleSplitError(
                f"no split into {self.stages} stages fits max-memory with each shared weight counted in every stage "
                f"holding it: in the plan that fits when it is counted once, {self._shortfall(program, ctx, first)}")
        best = min(fitting, key=_Attempt.rank)  # the first of equals: ties preferred together
        return dataclasses.replace(program, partition=best.partition)

    def _retries(self, ctx: PassContext, groups: Sequence[TieGroup], first: _Attempt) -> list[TiePlacement]:
        """Placements worth another split after ``first`` separated some ties.

        Tie-aware, when the balanced cost or the memory budget counts the weights; with
        ``keep-tied=false`` only what makes the memory fit: every shared weight charged to each
        reader, which over-counts but never under-counts.
        """
        if self.keep_tied and (charges_weights(ctx, self.cost) or not first.fits):
            return tie_placements(groups, first.separated)
        return [] if first.fits else [TiePlacement(charged_apart(groups))]

    def _exact_memory(self, ctx: PassContext) -> bool:
        """Whether ``max-memory`` limits the training-memory model (weights once, activations in flight)."""
        return self.memory_cost == "memory" and charges_weights(ctx, "memory")

    def _memory_attributes(
        self, program: ShardProgram, ctx: PassContext, apart: frozenset[str],
    ) -> tuple[dict[str, Mapping[str, float]], dict[str, Any]]:
        """The node attributes and ``split_dag`` options that carry ``max-memory``."""
        budgets: dict[str, Any] = {"memory_budgets": self.max_memory}
        if not self._exact_memory(ctx):
            return {MEMORY: node_costs(program, ctx, self.memory_cost, apart)}, budgets
        model = memory_model(ctx)
        held, kept = ctx.analysis(("memory-parts", program.dag, apart), lambda: memory_parts(program.dag, apart, model))
        budgets["memory_in_flight"] = model.all_in_flight(self.stages)
        return {MEMORY: held, ACTIVATION_MEMORY: kept}, budgets

    def _held_memory(self, program: ShardProgram, ctx: PassContext, assignment: Mapping[str, int]) -> list[float]:
        """Each stage's memory under ``memory-cost``, every weight once per stage holding it."""
        if self._exact_memory(ctx):
            return [s.total for s in stage_memory(program.dag, assignment, self.stages, memory_model(ctx))]
        return held_stage_costs(program, ctx, self.memory_cost, assignment, self.stages)

    def _attempt(
        self, program: ShardProgram, ctx: PassContext, groups: Sequence[TieGroup], placement: TiePlacement,
        budgets: bool = True,
    ) -> _Attempt:
        """Split with the ties placed as ``placement`` says; score the result by its true costs."""
        k, dag = self.stages, program.dag
        extra: dict[str, Mapping[str, float]] = {}
        limits: dict[str, Any] = {}
        if self.max_memory and budgets:
            extra, limits = self._memory_attributes(program, ctx, placement.apart)
        weighted = weighted_in_order(dag, program.order, node_costs(program, ctx, self.cost, placement.apart), extra)
        given = program.constraints or SplitConstraints()
        no_split = no_split_modules(dag, (*self.no_split, *given.no_split))
        cut_before = (*self.cut_before, *given.cut_before)
        cuts = list(zip(cut_before, cut_before_nodes(dag, program.order, cut_before)))
        check_cuts_outside_no_split(program.order, cuts, no_split)
        labels: dict[str, str] = {}
        for path, node in cuts:  # errors name each pin by the path the user wrote, not its node
            labels.setdefault(node, path)
        together = {**{label: nodes for label, (_, nodes) in no_split.items()},
                    **{g.label: g.readers for g in placement.together}}
        result = split_dag(
            weighted, k, self.strategy, self.tolerance,
            cut_before=labels,
            together=together,
            prefer_together={g.label: g.readers for g in placement.preferred},
            stage_ranges=ctx.analysis(("pins", dag, given), lambda: pinned_stages(dag, given.pins, given.optional)),
            capacities=self.capacities or None,
            return_info=True, **limits, **self.strategy_options(),
        )
        assignment = result.assignment
        speeds = _each_stage(self.capacities or (1.0,), k)
        totals = held_stage_costs(program, ctx, self.cost, assignment, k)
        split_up = [g for g in groups if len({assignment[v] for v in g.readers}) > 1]
        info = dataclasses.replace(result.info, bottleneck=max(t / c for t, c in zip(totals, speeds)),
                                   separated=tuple(w for g in split_up for w in g.weights))
        memory = tuple(self._held_memory(program, ctx, assignment)) if self.max_memory else ()
        fits = all(m <= b for m, b in zip(memory, _each_stage(self.max_memory, k)))
        return _Attempt(Partition.from_assignment(weighted, assignment, k, info),
                        tuple(g.label for g in split_up), memory, fits)

    def _shortfall(self, program: ShardProgram, ctx: PassContext, attempt: _Attempt) -> str:
        """Which stage of ``attempt`` is over its budget, and by how much."""
        budgets = _each_stage(self.max_memory, self.stages)
        if self._exact_memory(ctx):
            stages = stage_memory(program.dag, attempt.partition.assignment, self.stages, memory_model(ctx))
            return memory_shortfall(stages, budgets) or ""
        j = next(j for j, (need, budget) in enumerate(zip(attempt.memory, budgets)) if need > budget)
        return (f"stage {j} needs {attempt.memory[j]:,.0f} under memory-cost {self.memory_cost!r} but max-memory[{j}] "
                f"is {budgets[j]:,.0f}: {attempt.memory[j] - budgets[j]:,.0f} short; raise the budget or add stages")


@dataclass(frozen=True)
class SplitPass(_SplitWithConstraints):
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
class SplitFixedOrderPass(_SplitWithConstraints):
    """Split as contiguous runs of the given order: the fixed-order optimum (no refinement).

    Same bound as ``split``; among the splits of the order itself, the fewest boundary bytes.
    Example: ``split-fixed-order{stages=4}``.
    """

    name: ClassVar[str] = "split-fixed-order"
    strategy: ClassVar[str] = "fixed-order"


@dataclass(frozen=True)
class SplitExactPass(_SplitWithConstraints):
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
class SplitGreedyPass(_SplitWithConstraints):
    """fairscale's greedy rule, for comparison: close a stage once it reaches total / k.

    Has no tolerance (refused) and takes no constraints besides keep-tied (which it only reports).
    Example: ``split-greedy{stages=4}``.
    """

    name: ClassVar[str] = "split-greedy"
    strategy: ClassVar[str] = "greedy"


@dataclass(frozen=True)
class SplitUniformPass(_SplitWithConstraints):
    """Equal numbers of nodes per stage, ignoring costs, for comparison.

    Has no tolerance (refused) and takes no constraints besides keep-tied (which it only reports).
    Example: ``split-uniform{stages=4}``.
    """

    name: ClassVar[str] = "split-uniform"
    strategy: ClassVar[str] = "uniform"
