"""``split_dag``: cut a DAG into k ordered, non-empty stages with a named strategy.

A strategy is a function ``fn(problem, **options)`` registered under a name; ``problem`` is a
validated ``SplitProblem`` and the function's keyword-only parameters are the options it
accepts. It returns a ``{node: stage}`` mapping, a stage array indexed like
``problem.graph.nodes``, or an ``Outcome`` that also says whether the result is proven optimal.
``split_dag`` validates the graph, k, the tolerance, the constraints and the option names
first, so strategies only split.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Callable, Collection, Iterable, Literal, Mapping, Sequence, overload

import networkx as nx
import numpy as np

from autoshard.errors import InfeasibleSplitError, InvalidArgumentError, InvalidArgumentTypeError, suggest
from autoshard.graph import coarsen as coarse_graphs
from autoshard.graph import mincut
from autoshard.graph import moves as local_moves
from autoshard.graph.constraints import Constraints, Groups
from autoshard.graph.indexed import IndexedDag, Node
from autoshard.graph.invariants import check_dag, check_num_stages, is_number
from autoshard.graph.limits import StageLimit, laid_along
from autoshard.graph.linearize import INDEX_ORDERS, pull_forward, push_back
from autoshard.graph.partition import SplitInfo
from autoshard.graph.problem import Outcome, SplitProblem

Assignment = dict[Node, int]
#: How many of min-cut's order-DP splits are polished: the best few (a worse start often ends
#: better), fewer on graphs of more than ``MANY_NODES`` nodes, where each costs seconds.
REFINED_CANDIDATES = 4
REFINED_CANDIDATES_MANY_NODES = 1
MANY_NODES = 20_000
#: Nodes costing at least this share of the smallest stage budget get orders of their own.
HEAVY_SHARE = 0.1
#: Rounds of min-cut refinement and single-node moves at most; each must gain to go on.
POLISH_ROUNDS = 5
#: Coarse graphs min-cut also splits: values with one reader merged into it from these quantiles
#: of such values' sizes up (two graphs, one with more merged), each cluster costing at most
#: ``COARSE_CLUSTER_SHARE`` of the smallest stage budget; only up to ``COARSE_MAX_NODES`` nodes,
#: as it about doubles min-cut's time.
COARSE_QUANTILES = (1 / 3, 2 / 3)
COARSE_CLUSTER_SHARE = 0.1
COARSE_MAX_NODES = 5_000
#: Nor when at least this share of the nodes costs nothing, as in a traced model weighed by its
#: parameters (GPT-2 0.93, Llama 0.91, BERT 0.82; random layered graphs 0.08-0.11): single-node
#: moves shift such nodes without touching a budget, and on the benchmark the coarse graphs found
#: no fewer bytes on any graph with half its nodes free (every traced model, transformer-48)
#: while taking two to three times as long.
COARSE_MAX_FREE_SHARE = 0.5
#: On such mostly cost-free graphs min-cut's random kicks also stop after this many in a row find
#: nothing better. Over the traced benchmark models and four diffusers models (k = 2, 4, 8) kicks
#: gained on one graph only, with at most 23 fruitless kicks between two gains, while all 100
#: took 70-90% of the split's time (one more gain, 0.03% of T5's export graph at k = 4, came
#: after 60); on the random layered graphs gains still come after 50.
MOSTLY_FREE_KICK_PATIENCE = 30


StrategyFn = Callable[..., "np.ndarray | Mapping[Node, int] | Outcome"]


@dataclass(frozen=True)
class _Strategy:
    fn: StrategyFn
    honours_constraints: bool


_REGISTRY: dict[str, _Strategy] = {}


def register_strategy(name: str, fn: StrategyFn, *, honours_constraints: bool = False) -> None:
    """Make ``fn`` available as ``split_dag(..., strategy=name)``.

    ``fn(problem, **options)`` gets a validated ``SplitProblem`` and must return a valid
    partition; its keyword-only parameters are the options ``split_dag`` lets through. Only a
    strategy registered with ``honours_constraints=True`` is given hard constraints (it must
    then respect ``problem.rules`` and ``problem.budgets``); the others refuse them.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentTypeError(f"a strategy name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise InvalidArgumentTypeError(f"strategy {name!r} must be callable, got {fn!r}")
    if name in _REGISTRY:
        raise InvalidArgumentError(f"strategy {name!r} is already registered; pick another name")
    _REGISTRY[name] = _Strategy(fn, honours_constraints)


def strategies() -> tuple[str, ...]:
    """The registered strategy names, in registration order (the default first)."""
    return tuple(_REGISTRY)


def _options_of(fn: StrategyFn) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def check_strategy(strategy: Any) -> None:
    """Refuse a name no strategy is registered under."""
    if not isinstance(strategy, str) or strategy not in _REGISTRY:
        raise InvalidArgumentError(
            f"unknown strategy {strategy!r}{suggest(strategy, strategies()) if isinstance(strategy, str) else ''}; "
            f"known strategies: {', '.join(strategies())}"
        )


def honours_constraints(strategy: str) -> bool:
    """Whether ``strategy`` keeps hard constraints (``cut_before``, ``together``, ``capacities``,
    ``memory_budgets``); the others refuse them, so callers can refuse before any work."""
    check_strategy(strategy)
    return _REGISTRY[strategy].honours_constraints


def _lookup(strategy: Any, options: dict[str, Any]) -> _Strategy:
    check_strategy(strategy)
    entry = _REGISTRY[strategy]
    accepted = _options_of(entry.fn)
    for name in options:
        if name not in accepted:
            raise InvalidArgumentError(
                f"strategy {strategy!r} has no option {name!r}; "
                f"its options: {', '.join(accepted) or 'none'}"
            )
    return entry


def check_tolerance(tolerance: Any) -> None:
    """Refuse a tolerance that is not a finite number >= 0."""
    if not is_number(tolerance):
        raise InvalidArgumentTypeError(f"tolerance must be a number, got {tolerance!r}")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise InvalidArgumentError(f"tolerance must be finite and >= 0, got {tolerance!r}")


@dataclass(frozen=True)
class SplitResult:
    """A split (``{node: stage}`` in program order) and what is known about its quality."""

    assignment: Assignment
    info: SplitInfo


@overload
def split_dag(dag: nx.DiGraph | IndexedDag, k: int, strategy: str = ..., tolerance: float = ..., *,
              return_info: Literal[False] = ..., **options: Any) -> Assignment: ...


@overload
def split_dag(dag: nx.DiGraph | IndexedDag, k: int, strategy: str = ..., tolerance: float = ..., *,
              return_info: Literal[True], **options: Any) -> SplitResult: ...


def split_dag(
    dag: nx.DiGraph | IndexedDag,
    k: int,
    strategy: str = "min-cut",
    tolerance: float = 0.02,
    *,
    cut_before: Collection[Node] = (),
    together: Groups = (),
    prefer_together: Groups = (),
    capacities: Sequence[float] | float | None = None,
    memory_budgets: Sequence[float] | float | None = None,
    memory_in_flight: Sequence[float] | float | None = None,
    stage_ranges: Mapping[Node, Any] | None = None,
    return_info: bool = False,
    **options: Any,
) -> Assignment | SplitResult:
    """Assign every node of ``dag`` to one of k ordered, non-empty stages.

    ``tolerance`` is how far above the best bottleneck (slowest stage, relative to its capacity)
    of program order (the graph's insertion order, made topological) a strategy may go to send
    fewer bytes between stages: the best over every ordered split is NP-hard to find and can be
    lower (independent nodes costing 3, 3, 2, 2 in two stages: 6 in that order, 5 as 3+2 | 3+2). Constraints (see
    ``autoshard.graph.constraints``): ``cut_before`` nodes start a stage, ``together`` groups
    stay in one stage, ``prefer_together`` groups do when the bound allows, ``stage_ranges``
    (``{node: stage}``, ``{node: (first, last)}`` or ``StageRange``) pins nodes to stages, ``capacities``
    are relative stage speeds and ``memory_budgets`` limit each stage's memory (for any of
    these, one number applies to every stage). Stage j's memory is the sum of the node
    attribute ``memory`` (``MEMORY``: held once, such as weights and optimizer state) plus
    ``memory_in_flight[j]`` times the sum of ``activation_memory`` (``ACTIVATION_MEMORY``:
    kept per microbatch; a node without it keeps none), so
    ``sum(memory) + memory_in_flight[j] * sum(activation_memory) <= memory_budgets[j]``; under
    1F1B stage j of k keeps k - j microbatches. ``memory_in_flight`` needs ``memory_budgets``;
    without it only ``memory`` counts. ``options`` go to the strategy (see ``strategies()`` and
    each strategy's docstring). Returns ``{node: stage}`` in program order, or a
    ``SplitResult`` when ``return_info`` is true. Constraints no split of the orders tried can
    meet raise ``InfeasibleSplitError`` naming them (a ``together`` group only a split out of
    program order keeps whole among them; the message says so). Budgets and capacities hold up to
    a round-off of 1e-9 of the graph's total. A registered strategy's answer is checked: one that
    is not a valid split keeping its constraints raises ``InvalidArgumentError``. ``dag`` may come
    indexed (``IndexedDag``), so that splitting one graph many times indexes and orders it once.
    """
    if isinstance(dag, IndexedDag):
        dag.derived(_check_contract)  # once, however often it is split
    else:
        check_dag(dag)
    k = check_num_stages(dag, k)
    check_tolerance(tolerance)
    entry = _lookup(strategy, options)
    constraints = Constraints.build(cut_before, together, prefer_together, capacities, memory_budgets,
                                    memory_in_flight, stage_ranges)
    if constraints.hard() and not entry.honours_constraints:
        raise InvalidArgumentError(
            f"strategy {strategy!r} cannot honour {', '.join(constraints.names())}; use one of "
            f"{', '.join(n for n, e in _REGISTRY.items() if e.honours_constraints)}")
    problem = SplitProblem(dag, k, float(tolerance), constraints)
    if entry.honours_constraints and constraints.prefer_together:
        problem = problem.with_preferences()
    outcome = entry.fn(problem, **options)
    if not isinstance(outcome, Outcome):
        outcome = Outcome(outcome)
    bounded = entry.honours_constraints
    stages = _valid_stages(problem, outcome.stages, strategy, bounded)
    assignment = problem.assignment(stages)
    if not return_info:
        return assignment
    info = SplitInfo(
        strategy=strategy,
        bound=problem.bound if bounded else None,
        bottleneck=problem.bottleneck(stages),
        boundary_bytes=problem.graph.total_bytes(stages, k),
        proven_optimal=outcome.proven_optimal,
        separated=problem.separated(stages),
        tolerance=float(tolerance) if bounded else None,
    )
    return SplitResult(assignment, info)


def _check_contract(g: IndexedDag) -> None:
    check_dag(g.dag)


def _non_int_stage(stages: Iterable[Any]) -> Any:
    """The first stage that is not an int (a float, a bool), or None."""
    return next((s for s in stages if not isinstance(s, Integral) or isinstance(s, bool)), None)


def _valid_stages(problem: SplitProblem, answer: Any, strategy: str, bounded: bool) -> np.ndarray:
    """A strategy's answer as a stage array indexed like the graph's nodes, refused unless it is a
    valid split that keeps every constraint the strategy was given (a registered strategy may err),
    the cost budget included when it is ``bounded``."""
    try:
        stages = problem.graph.stages_of(answer) if isinstance(answer, Mapping) else np.asarray(answer)
    except (KeyError, OverflowError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"strategy {strategy!r} did not return a stage for every node ({type(exc).__name__}: {exc})") from exc
    # Converting to int64 truncated a float stage (0.6 became 0) and took True for 1: refuse them.
    if isinstance(answer, Mapping):
        odd = _non_int_stage(answer.values())
    else:
        odd = None if stages.dtype.kind in "iu" else _non_int_stage(stages.ravel().tolist())
    if odd is not None:
        raise InvalidArgumentError(f"strategy {strategy!r} returned stage {odd!r}, a {type(odd).__name__}; "
                                   f"stages are the ints 0..{problem.k - 1}")
    stages = stages.astype(np.int64)
    if stages.shape != (problem.graph.n,):
        raise InvalidArgumentError(
            f"strategy {strategy!r} returned {stages.size} stages for a graph of {problem.graph.n} nodes")
    broken = problem.violations(stages, bounded)
    if broken:
        raise InvalidArgumentError(f"strategy {strategy!r} returned an invalid split: {'; '.join(broken)}")
    return stages


# -- strategies ------------------------------------------------------------------------------


def fixed_order(problem: SplitProblem) -> np.ndarray:
    """The fixed-order optimum: contiguous stages of program order.

    Among the splits whose every stage fits the budget (1 + tolerance) x the best bottleneck of
    program order, the one sending the fewest bytes between stages. No options.
    """
    return problem.dp_split(problem.graph.program())


def _check_orders(orders: Any) -> None:
    if isinstance(orders, str) or not isinstance(orders, Sequence):
        raise InvalidArgumentTypeError(f"orders must be a list of order names, got {orders!r}")
    for name in orders:
        if not isinstance(name, str) or name not in INDEX_ORDERS:
            raise InvalidArgumentError(
                f"unknown order {name!r}; known orders: {', '.join(INDEX_ORDERS)}"
            )


def min_cut(
    problem: SplitProblem,
    *,
    orders: Sequence[str] = ("live-bytes", "dfs"),
    refine: bool = True,
    moves: bool = True,
    coarsen: bool = True,
) -> np.ndarray:
    """Fewest boundary bytes within the fixed-order budget: order DPs, then local improvement.

    1. The fixed-order DP (with the budget of ``fixed-order``) over program order, over each of
       ``orders`` (names from ``linearize.ORDERS``) and over program and the first of ``orders``
       with the costly nodes (each at least ``HEAVY_SHARE`` of the smallest stage budget)
       pulled forward and pushed back (``linearize.pull_forward``, ``push_back``): in a fixed
       order a costly node leaves a gap in the cut positions balance can use.
    2. If ``refine``, the best few distinct DP splits are polished (a worse start often ends
       better): each boundary moves to a minimum s-t cut inside a balance-safe corridor of
       program order and ``orders`` whenever that sends strictly fewer bytes (``mincut``) and,
       if ``moves``, passes of single-node moves that may cost bytes for a while (``moves``)
       alternate with that until neither gains.
    3. If ``moves``, iterated local search from the best (``moves.improve`` with kicks: random
       perturbations from a seeded generator, so still deterministic); after step 4, single-node
       moves that let fewer values cross at no more bytes or bottleneck (``moves.fewer_values``).
    4. If ``coarsen`` too (and the problem has no pins, together groups or memory budgets, and
       at most ``COARSE_MAX_NODES`` nodes), steps 1-3 again on coarse graphs whose single-reader
       values are merged into their readers (``coarsen``; each polishing only its best DP
       split), each split projected back and polished on the full graph; the best of all is kept.

    Program order is always tried and no step keeps a worse split, so the result never sends
    more bytes than ``fixed-order`` and never exceeds its budget. Options: ``orders`` (extra
    orders to try), ``refine`` (bool, steps 2-4), ``moves`` (bool, the single-node moves and
    steps 3-4), ``coarsen`` (bool, step 4).
    """
    _check_orders(orders)
    for name, flag in (("refine", refine), ("moves", moves), ("coarsen", coarsen)):
        if not isinstance(flag, bool):
            raise InvalidArgumentTypeError(f"{name} must be a bool, got {flag!r}")
    many = problem.graph.n > MANY_NODES
    stages = _min_cut(problem, orders, refine, moves, coarsen,
                      REFINED_CANDIDATES_MANY_NODES if many else REFINED_CANDIDATES)
    return _fewer_values(problem, stages) if refine and moves else stages


def _fewer_values(problem: SplitProblem, stages: np.ndarray) -> np.ndarray:
    """``moves.fewer_values`` from ``stages``, no stage costing more than its bottleneck lets it."""
    g, rules = problem.graph, problem.rules
    limits = [StageLimit("cost", g.cost, problem.bottleneck(stages) * rules.capacities), *problem.limits()[1:]]
    return local_moves.fewer_values(g, stages, problem.k, limits, problem.pinned_boundaries(stages),
                                    _grouped(problem), rules.ranges)


def _min_cut(problem: SplitProblem, orders: Sequence[str], refine: bool, moves: bool, coarsen: bool,
             count: int) -> np.ndarray:
    """``min_cut`` polishing the best ``count`` DP splits (one on coarse graphs, where the search
    itself is only one of three and more polished candidates found nothing better)."""
    g = problem.graph
    corridors = [g.program()] + [problem.respect_pins(g.derived(INDEX_ORDERS[name])) for name in orders]
    candidates = _dp_candidates(problem, corridors + _heavy_orders(problem, corridors[:2]))
    if not refine:
        return candidates[0]
    best = min((_polish(problem, s, corridors, moves) for s in candidates[:count]),
               key=lambda s: _score(problem, s))
    if not moves:
        return best
    found = [_improve(problem, best)]
    if coarsen and _coarsens(problem):
        coarse = (_coarse_split(problem, size, orders, corridors) for size in _coarse_thresholds(problem))
        found += [s for s in coarse if s is not None]
    return min(found, key=lambda s: _score(problem, s))


def _improve(problem: SplitProblem, stages: np.ndarray) -> np.ndarray:
    """Iterated local search from ``stages`` (``moves.improve`` with kicks)."""
    g = problem.graph
    patience = MOSTLY_FREE_KICK_PATIENCE if _free_share(g) >= COARSE_MAX_FREE_SHARE else None
    return local_moves.improve(g, stages, problem.k, problem.limits(), problem.pinned_boundaries(stages),
                               _grouped(problem), local_moves.kicks_for(g.n), patience, problem.rules.ranges)


def _free_share(g: IndexedDag) -> float:
    """The share of non-input nodes that cost nothing (1 when there are none)."""
    return float(np.mean(g.cost[g.num_inputs:] == 0)) if g.n > g.num_inputs else 1.0


def _coarse_thresholds(problem: SplitProblem) -> list[float]:
    """The smallest value size each coarse graph merges: ``COARSE_QUANTILES`` of the mergeable sizes."""
    sizes = coarse_graphs.single_reader_sizes(problem.graph)
    if not len(sizes):
        return []
    return sorted(set(np.quantile(sizes, COARSE_QUANTILES, method="lower").tolist()))


def _coarsens(problem: SplitProblem) -> bool:
    """Whether min-cut also splits coarse graphs: rules tied to single nodes (pins, together
    groups, stage ranges, per-node memory) are not carried over to clusters, and large graphs and
    graphs of mostly cost-free nodes skip it."""
    rules, g = problem.rules, problem.graph
    return (g.n <= COARSE_MAX_NODES and _free_share(g) < COARSE_MAX_FREE_SHARE and not len(rules.pins)
            and not rules.groups and rules.memory is None and rules.ranges is None)


def _coarse_split(problem: SplitProblem, min_bytes: float, orders: Sequence[str],
                  corridors: list[np.ndarray]) -> np.ndarray | None:
    """Min-cut on the graph with single-reader values of at least ``min_bytes`` merged, projected
    back and polished on the full graph (no kicks there: the coarse search made the big steps);
    None if the coarse graph cannot be split within the budget."""
    g = problem.graph
    roots = coarse_graphs.clusters(g, min_bytes, COARSE_CLUSTER_SHARE * float(problem.budgets.min()))
    dag, cluster = coarse_graphs.quotient(g, roots)
    coarse = SplitProblem(dag, problem.k, problem.tolerance,
                          Constraints(capacities=problem.constraints.capacities), bound=problem.bound)
    try:
        split = _min_cut(coarse, orders, refine=True, moves=True, coarsen=False, count=1)
    except InfeasibleSplitError:
        return None
    return _polish(problem, coarse_graphs.project(coarse.graph, split, cluster), corridors, True)


def _score(problem: SplitProblem, stages: np.ndarray) -> tuple[float, float]:
    """What min-cut minimises: boundary bytes, then the bottleneck."""
    return problem.graph.total_bytes(stages, problem.k), problem.bottleneck(stages)


def _dp_candidates(problem: SplitProblem, orders: list[np.ndarray]) -> list[np.ndarray]:
    """The DP split of each order that meets the budget, distinct, best first (ties: order tried).

    The first order must be program order: its failure means the rules cannot be met and raises.
    """
    found = [problem.dp_split(orders[0])]
    for order in orders[1:]:
        try:
            split = problem.dp_split(order)
        except InfeasibleSplitError:
            continue  # this order cannot meet the program-order budget
        if not any(np.array_equal(split, s) for s in found):
            found.append(split)
    return sorted(found, key=lambda s: _score(problem, s))


def _heavy_orders(problem: SplitProblem, bases: list[np.ndarray]) -> list[np.ndarray]:
    """Each of ``bases`` with the costly nodes pulled forward, and with them pushed back."""
    g = problem.graph
    heavy = np.flatnonzero(g.cost[g.num_inputs :] >= HEAVY_SHARE * float(problem.budgets.min())) + g.num_inputs
    if not len(heavy):
        return []
    return [problem.respect_pins(move(g, base, heavy)) for base in bases for move in (pull_forward, push_back)]


def _grouped(problem: SplitProblem) -> np.ndarray | None:
    """Every node of a together group: single-node moves leave them where they are."""
    groups = [members for _, members in problem.rules.groups]
    return np.unique(np.concatenate(groups)) if groups else None


def _polish(problem: SplitProblem, stages: np.ndarray, orders: list[np.ndarray], moves: bool) -> np.ndarray:
    """Min-cut refinement of ``stages``, alternating with single-node moves until neither gains."""
    g, k = problem.graph, problem.k
    limits = problem.limits()
    budgets = mincut.Budgets(g, limits, k)
    groups = [members for _, members in problem.rules.groups]
    for round_ in range(POLISH_ROUNDS):
        pinned = problem.pinned_boundaries(stages)
        refined = mincut.refine(g, stages, k, budgets, orders, pinned, groups, problem.rules.ranges)
        if not moves or (round_ and np.array_equal(refined, stages)):
            return refined  # the moves of the last round already stopped at ``stages``
        moved = local_moves.improve(g, refined, k, limits, pinned, _grouped(problem), bounds=problem.rules.ranges)
        if not g.total_bytes(moved, k) < g.total_bytes(refined, k):
            return refined
        stages = moved
    return stages


def greedy(problem: SplitProblem) -> np.ndarray:
    """fairscale's rule, kept as a baseline: fill a stage until its cost reaches total / k.

    Walks program order and closes the current stage once its running cost reaches total / k.
    To always give exactly k non-empty stages it also closes a stage when the nodes left are
    just enough to give each remaining stage one, and never opens a stage past the k-th (the
    last one takes the rest). Ignores ``tolerance``; no options, no constraints.
    """
    g, k = problem.graph, problem.k
    weights = laid_along(g.cost, g.program()[g.num_inputs :], g.num_inputs).tolist()
    target = sum(weights) / k
    cuts: list[int] = []
    running = 0.0
    for i, w in enumerate(weights):
        running += w
        stages_left = k - 1 - len(cuts)
        if stages_left and (running >= target or len(weights) - i - 1 == stages_left):
            cuts.append(i + 1)
            running = 0.0
    return problem.stages_from_cuts(g.program(), np.array(cuts, dtype=np.int64))


def uniform(problem: SplitProblem) -> np.ndarray:
    """Equal numbers of non-input nodes per stage (sizes differ by at most one), in program order.

    Ignores costs and ``tolerance``; no options, no constraints.
    """
    g, k = problem.graph, problem.k
    n = g.n - g.num_inputs
    return problem.stages_from_cuts(g.program(), np.array([i * n // k for i in range(1, k)], dtype=np.int64))


def _exact(problem: SplitProblem, *, time_limit: float = 30.0) -> Outcome:
    """The fewest boundary bytes over all ordered partitions within the budget, by MILP.

    Warm-started from ``min-cut`` (whose result is also the fallback), stops after
    ``time_limit`` seconds with the best split found; ``proven_optimal`` says whether HiGHS
    proved it optimal. Needs the optional dependency ``highspy`` (``pip install
    'autoshard[exact]'``). Options: ``time_limit`` (seconds).
    """
    from autoshard.graph.exact import solve

    return solve(problem, min_cut, time_limit)


register_strategy("min-cut", min_cut, honours_constraints=True)
register_strategy("fixed-order", fixed_order, honours_constraints=True)
register_strategy("greedy", greedy)
register_strategy("uniform", uniform)
register_strategy("exact", _exact, honours_constraints=True)
