"""The tie-placement search: split, and split again under other placements of shared weights.

``params`` and ``memory`` count a shared weight once per stage that holds it, so what a node
costs depends on where the weight's other readers go. The first split charges each tie to its
first reader and prefers its readers in one stage; if that separates a tie, the DAG is split
again under other placements (``costs.ties.tie_placements``: a tie kept together, or charged to
every reader) and the plan with the lowest true bottleneck is kept, every weight counted once
per stage holding it. ``SplitInfo.bottleneck`` is that true figure and ``SplitInfo.separated``
lists the shared weights whose readers ended up in several stages. ``keep_tied=False`` skips the
search and the preference, as a tie-unaware splitter would.

``max_memory`` is held by the whole count (``MemoryCount.stage_totals``: for training memory,
``costs.memory.stage_memory``), while the splitter sums per-node parts; what a stage holds beyond
them (received and sent values, one backward, a shared weight in several stages) depends on the
cuts. So a split whose whole stages exceed their budgets is made again under budgets tightened by
that part (``fitted``), and a returned plan holds every budget by the model. Where no such split
fits, the exact search over the order (``program_order``, ``in_order``) is the last resort; a budget
it finds no split for either is reported with the stage that is short, its parts and the shortfall.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import networkx as nx

from autoshard.costs.split_search.program_order import JUDGEMENT_LIMIT, SearchGaveUp, serves, splits_in_order
from autoshard.costs.split_search.request import SplitRequest
from autoshard.costs.ties import TiePlacement, charged_apart, tie_placements
from autoshard.errors import InfeasibleSplitError, amount
from autoshard.graph import Partition, SplitInfo, split_dag, total_boundary_bytes
from autoshard.graph.constraints import ACTIVATION_MEMORY
from autoshard.graph.linearize import program_order
from autoshard.graph.problem import ORDER_ADVICE


#: How many times a split whose whole stages exceed their budgets is made again under tighter ones.
TIGHTENING_ROUNDS = 12
#: Halvings of the scale of the budgets the closest split of the order a refusal names fits, past
#: those that bring the overshoot of the split it starts from under one budget.
CLOSEST_STEPS = 10
#: Below what a stage held, relative to its budget: more than the splitter's round-off (1e-9 of the total).
_ROUND_OFF = 1e-6


@dataclass(frozen=True)
class Attempt:
    """One split and what it truly costs: bottleneck, tie groups separated, fit in the budgets.

    ``memory`` is each stage's memory as ``max_memory`` counts it; ``counted`` what the splitter's
    per-node sums saw of it (the rest: received and sent values, one backward, a shared weight held
    by several stages), by which a budget is tightened to split again."""

    partition: Partition
    separated: tuple[str, ...]
    memory: tuple[float, ...]
    fits: bool
    counted: tuple[float, ...] = ()

    def rank(self) -> tuple[float, int, float]:
        """Lower is better: the true bottleneck, then fewer separated ties, then fewer boundary bytes."""
        info = self.partition.info
        return info.bottleneck, len(info.separated), info.boundary_bytes

    def overshoot(self, budgets: tuple[float, ...]) -> float:
        """How far the stage furthest over its budget is over, as a fraction of that budget."""
        return max((m - b) / b if b else float(m > 0) for m, b in zip(self.memory, budgets))


@dataclass(frozen=True)
class ExactSearch:
    """What the exact search over the order (``in_order``) came to: the split it found that fits, or
    None, what a refusal says of the search ("" where it did not run) and the closest split it found
    (None: the refusal names the closest the splitter made)."""

    found: Attempt | None = None
    note: str = ""
    closest: Attempt | None = None


def split_placing_ties(request: SplitRequest, exact: bool = True) -> Partition:
    """The best split of ``request`` over the tie placements worth trying, ``max_memory`` held. Where
    none fits, ``exact``: the split the exact search over the order finds (``in_order``), before the
    budget is refused (the bisection's probes, many and below the least bound, go without)."""
    first_try = TiePlacement(preferred=request.ties if request.keep_tied else ())
    try:
        first = fitted(request, first_try)
    except InfeasibleSplitError as exc:
        if not request.max_memory:
            raise
        first = attempt(request, first_try, budgets=())
        if not first.fits:
            searched = in_order(request, first_try, first) if exact else ExactSearch()
            if searched.found is not None:
                return searched.found.partition
            raise refusal(request, searched, f"({_in_max_memory_terms(exc)})", "best-balanced plan", first) from exc
    attempts = [first]
    if first.separated and first.partition.info.bound is not None:  # a bounded strategy, not a baseline
        for placement in retries(request, first):
            with contextlib.suppress(InfeasibleSplitError):  # e.g. a tie kept together no split allows
                attempts.append(fitted(request, placement))
    fitting = [a for a in attempts if a.fits]
    if not fitting and request.max_memory:
        # The split balanced without budgets, if it fits them: a larger budget is then never refused where
        # a smaller one was planned by it (the searches under each budget start from other splits).
        unbounded = attempt(request, first_try, budgets=())
        attempts.append(unbounded)
        fitting = [unbounded] if unbounded.fits else []
    if not fitting:
        closest = min(attempts, key=lambda a: a.overshoot(request.each_stage(request.max_memory)))
        searched = in_order(request, first_try, closest) if exact else ExactSearch()
        if searched.found is not None:
            return searched.found.partition
        tried = (f"with every stage counted whole (received and sent values, one backward, each shared weight in "
                 f"every stage holding it), split again up to {TIGHTENING_ROUNDS} times under budgets tightened by "
                 "what the per-node sums missed")
        raise refusal(request, searched, tried, "closest plan", closest)
    return min(fitting, key=Attempt.rank).partition  # the first of equals: ties preferred together


def refusal(request: SplitRequest, searched: ExactSearch, tried: str, named: str,
            near: Attempt) -> InfeasibleSplitError:
    """The refusal of a budget no split fits: the least budgets a split of the order fits and that
    split's shortfall, where the exact search found them; else how the splitter tried, what the exact
    search came to, and the shortfall of the split it made nearest (``near``, which it calls ``named``)."""
    if searched.closest is not None:
        return InfeasibleSplitError(f"no split into {request.k} stages fits max_memory{searched.note}; in that split "
                                    f"{shortfall(request, searched.closest)}")
    return InfeasibleSplitError(f"no split into {request.k} stages fits max_memory {tried}{searched.note}; in the "
                                f"{named} {shortfall(request, near)}")


def in_order(request: SplitRequest, placement: TiePlacement, near: Attempt) -> ExactSearch:
    """The last resort before a budget is refused: the split the exact search over ``request.order``
    finds (``program_order``), scored as ``attempt`` scores a split, weights charged as ``placement``
    charges them (its plan's info: the bottleneck as its bound, the boundary bytes, the ties it
    separates); where it finds none, the closest split of the order (the least scale of the budgets
    one fits, searched up to what ``near``, a split that does not fit, needs; where the halving gave up,
    the least it met, not called the least), and what the refusal says of the search (it named the plan
    balanced without budgets, or the last tightened one: up to 23 times further over than the closest)."""
    if not serves(request):
        return ExactSearch()
    where = "program order" if list(request.order) == program_order(request.dag) else "the linearized order"
    splits, budgets = splits_in_order(request), request.each_stage(request.max_memory)
    try:
        assignment = splits.fitting(budgets)
    except SearchGaveUp:
        return ExactSearch(note=f"; an exact search over the splits of {where} gave up after {JUDGEMENT_LIMIT:,} "
                                "stages judged")
    if assignment is not None:
        return ExactSearch(_exact(request, placement, assignment))
    over = near.overshoot(budgets)  # halved to 2 ** -CLOSEST_STEPS of the budgets however far over
    least = splits.least_scaled(budgets, 1.0, 1.0 + over, CLOSEST_STEPS + max(0, math.ceil(math.log2(over))))
    if least is None:
        return ExactSearch(note=f"; no split of {where} into {request.k} contiguous stages fits either (an exact "
                                "search)")
    scale = math.ceil(least.scale * 1e4) / 1e4  # rounded up: "1x" of a budget one byte short misleads
    closest = _exact(request, placement, least.assignment)
    if not least.exact:  # gave up halving: a split fits this scale, a smaller one may fit too
        return ExactSearch(note=f": a split of {where} into {request.k} contiguous stages fits {scale:g}x these, the "
                                f"least an exact search met before it gave up after {JUDGEMENT_LIMIT:,} stages judged "
                                "(a lower scale may fit)", closest=closest)
    return ExactSearch(note=f": the least budgets a split of {where} into {request.k} contiguous stages fits are "
                            f"{scale:g}x these (an exact search)", closest=closest)


def _exact(request: SplitRequest, placement: TiePlacement, assignment: Mapping[str, int]) -> Attempt:
    """A split the exact search found, as an ``Attempt`` with its plan's info (bottleneck as bound)."""
    weighted = request.costed(placement.apart, budgeted=False).dag
    boundary = total_boundary_bytes(weighted, assignment, request.k)
    found = scored(request, placement, weighted, assignment,
                   SplitInfo(request.strategy, None, 0.0, boundary, tolerance=request.tolerance))
    info = found.partition.info
    return dataclasses.replace(found, partition=dataclasses.replace(
        found.partition, info=dataclasses.replace(info, bound=info.bottleneck)))


def _in_max_memory_terms(refusal: InfeasibleSplitError) -> str:
    """The splitter's refusal in the terms of a caller who gave ``max_memory``, not the splitter's own
    parameters (``memory_budgets``, ``memory_in_flight``), which that caller never set."""
    return (str(refusal).replace(ORDER_ADVICE, "").replace("memory_budgets", "the budgets")
            .replace("memory_in_flight", "microbatches in flight"))


def fitted(request: SplitRequest, placement: TiePlacement) -> Attempt:
    """``attempt``, made again while its whole stages exceed ``max_memory`` (judged against the original
    budgets; the last attempt when none fits): ``_tightened``, then, if no split fit, again with the
    stages under their budgets squeezed too (the cut moves, and with it what the stage over misses).
    Each budget vector is split once, without the splitter's local moves (four fifths of a budgeted
    plan's time went to them); the one that fits is split again with them, kept where it still fits."""
    found = attempt(request, placement)
    if not request.max_memory or found.fits:
        return found
    fast = request
    if request.strategy_options.get("moves"):
        fast = dataclasses.replace(request, strategy_options={**request.strategy_options, "moves": False})
    tried: dict[tuple[float, ...], Attempt | None] = {}
    for squeeze_the_rest in (False, True):
        last = _tightened(fast, placement, found, tried, squeeze_the_rest)
        if last.fits:
            break
    if not last.fits or fast is request:
        return last
    tight = next(budgets for budgets, made in tried.items() if made is last)  # ``found`` did not fit
    with contextlib.suppress(InfeasibleSplitError):
        moved = attempt(request, placement, budgets=tight)
        if moved.fits:
            return moved
    return last


def _tightened(request: SplitRequest, placement: TiePlacement, found: Attempt,
               tried: dict[tuple[float, ...], Attempt | None], squeeze_the_rest: bool) -> Attempt:
    """Split again from ``found`` under tightened budgets until the whole stages fit. Each round
    tightens the budget of every stage over it: first to the budget less what the splitter missed
    there (right if the new stage misses as much), and when no split meets that, to just below what
    the splitter counted there (the stage must hold less than it did: a stage holding less also
    misses less, its backward and, at a narrower cut, its received values). ``squeeze_the_rest``:
    then the stages under their budgets to just below what they counted (an empty one left), the
    others kept. When no such split exists, every stage's budget is set to the original less what
    that stage misses now (a stage tightened earlier may need less room than it was given), so
    budgets may rise again; the rounds are counted, so it ends. ``tried``: the attempt each budget
    vector gave (None: no split)."""
    budgets = request.each_stage(request.max_memory)
    tight = budgets
    for _ in range(TIGHTENING_ROUNDS):
        if found.fits:
            break
        over = [m > b for m, b in zip(found.memory, budgets)]
        missed = [max(0.0, b - (m - c)) for b, m, c in zip(budgets, found.memory, found.counted)]
        less = [max(0.0, c - _ROUND_OFF * b) for c, b in zip(found.counted, budgets)]  # a budget is never negative
        proposals = [tuple(min(t, p) if o else t for t, p, o in zip(tight, proposal, over))
                     for proposal in (missed, less)]
        if squeeze_the_rest:
            squeezed = tuple(t if o or p <= 0 else min(t, p) for t, p, o in zip(tight, less, over))
            if squeezed != tight:  # ``tight`` gave ``found``: no new split
                proposals.append(squeezed)
        proposals.append(tuple(missed))  # every stage by what it misses now, the earlier tightening let go
        for tighter in proposals:
            if tighter not in tried:
                try:
                    tried[tighter] = attempt(request, placement, budgets=tighter)
                except InfeasibleSplitError:
                    tried[tighter] = None
            if tried[tighter] is not None:
                found, tight = tried[tighter], tighter
                break
        else:
            break
    return found


def retries(request: SplitRequest, first: Attempt) -> list[TiePlacement]:
    """Placements worth another split after ``first`` separated some ties.

    Tie-aware, when the balanced cost or the memory budget counts the weights; with
    ``keep_tied=False`` only what makes the memory fit: every shared weight charged to each
    reader, which over-counts but never under-counts.
    """
    if request.keep_tied and (request.charges_weights or not first.fits):
        return tie_placements(request.ties, first.separated)
    return [] if first.fits else [TiePlacement(charged_apart(request.ties))]


def attempt(request: SplitRequest, placement: TiePlacement, budgets: tuple[float, ...] | None = None) -> Attempt:
    """Split with the ties placed as ``placement`` says, each stage's counted memory held to ``budgets``
    (default ``max_memory``; ``()``: none); score the result by its true costs, fit judged against
    ``max_memory``."""
    k, memory = request.k, request.memory
    budgets = request.max_memory if budgets is None else budgets
    limits: dict[str, Any] = {}
    if budgets:
        limits = {"memory_budgets": budgets}
        if memory.in_flight is not None:
            limits["memory_in_flight"] = memory.in_flight
    weighted = request.costed(placement.apart, budgeted=bool(budgets))
    result = split_dag(
        weighted, k, request.strategy, request.tolerance,
        cut_before=request.cut_before,
        together={**request.together, **{g.label: g.readers for g in placement.together}},
        prefer_together={g.label: g.readers for g in placement.preferred},
        stage_ranges=request.stage_ranges,
        capacities=request.capacities or None,
        return_info=True, **limits, **request.strategy_options,
    )
    return scored(request, placement, weighted.dag, result.assignment, result.info)


def scored(request: SplitRequest, placement: TiePlacement, weighted: nx.DiGraph, assignment: Mapping[str, int],
           info: SplitInfo) -> Attempt:
    """``assignment`` of ``weighted`` (the DAG costed under ``placement``) as an ``Attempt``: ``info`` with
    the true bottleneck and the ties separated, each stage's memory and fit as ``max_memory`` counts it."""
    k, memory = request.k, request.memory
    speeds = request.each_stage(request.capacities or (1.0,))
    partition = Partition.from_assignment(weighted, assignment, k, info)
    assignment = partition.assignment  # its nodes placed where they run, as every stage count counts them
    totals = request.stage_totals(assignment)
    split_up = [g for g in request.ties if len({assignment[v] for v in g.readers}) > 1]
    info = dataclasses.replace(info, bottleneck=max(t / c for t, c in zip(totals, speeds)),
                               separated=tuple(w for g in split_up for w in g.weights))
    held = tuple(memory.stage_totals(assignment)) if request.max_memory else ()
    fits = all(m <= b for m, b in zip(held, request.each_stage(request.max_memory)))
    summed = tuple(counted(request, placement, assignment)) if held else ()
    return Attempt(dataclasses.replace(partition, info=info), tuple(g.label for g in split_up), held, fits, summed)


def counted(request: SplitRequest, placement: TiePlacement, assignment: Mapping[str, int]) -> list[float]:
    """Per stage, the memory the splitter summed for ``assignment``: the node attributes of
    ``placement``, activations times the microbatches each stage keeps in flight."""
    sums = [[0.0, 0.0] for _ in range(request.k)]
    for name, per_node in request.memory.node_attributes(placement.apart).items():
        column = 1 if name == ACTIVATION_MEMORY else 0
        for node, stage in assignment.items():
            sums[stage][column] += per_node.get(node, 0.0)
    in_flight = request.memory.in_flight or (1.0,) * request.k
    return [held + n * kept for (held, kept), n in zip(sums, in_flight)]


def shortfall(request: SplitRequest, found: Attempt) -> str:
    """Which stage of ``found`` is over its budget, and by how much."""
    budgets, memory = request.each_stage(request.max_memory), request.memory
    if memory.shortfall is not None:
        return memory.shortfall(found.partition.assignment, budgets)
    j = next(j for j, (need, budget) in enumerate(zip(found.memory, budgets)) if need > budget)
    return (f"stage {j} needs {found.memory[j]:,.0f} under memory-cost {memory.name!r} but max_memory[{j}] "
            f"is {amount(budgets[j])}: {found.memory[j] - budgets[j]:,.0f} short; raise the budget or add stages")
