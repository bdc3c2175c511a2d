"""``split_dag``: cut a DAG into k ordered, non-empty stages with a named strategy.

A strategy is a function ``fn(dag, k, tolerance, **options) -> dict[node, int]`` registered
under a name; its keyword-only parameters are the options it accepts. ``split_dag`` validates
the graph, k, the tolerance and the option names before calling it, so strategies only split.
"""

from __future__ import annotations

import inspect
import math
from bisect import bisect_right
from typing import Any, Callable, Sequence

import networkx as nx

from autoshard.errors import InfeasibleSplitError, InvalidArgumentError, InvalidArgumentTypeError
from autoshard.graph import mincut
from autoshard.graph.balance import live_bytes_at_cuts, min_bottleneck, min_bytes_partition
from autoshard.graph.invariants import check_dag, check_num_stages, is_number
from autoshard.graph.linearize import ORDERS, Node, Order, is_input, non_inputs, program_order
from autoshard.graph.partition import bottleneck, total_boundary_bytes

Assignment = dict[Node, int]
StrategyFn = Callable[..., Assignment]

_REGISTRY: dict[str, StrategyFn] = {}


def register_strategy(name: str, fn: StrategyFn) -> None:
    """Make ``fn`` available as ``split_dag(..., strategy=name)``.

    ``fn(dag, k, tolerance, **options)`` gets a validated graph and k and must return a valid
    partition; its keyword-only parameters are the options ``split_dag`` lets through.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentTypeError(f"a strategy name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise InvalidArgumentTypeError(f"strategy {name!r} must be callable, got {fn!r}")
    if name in _REGISTRY:
        raise InvalidArgumentError(f"strategy {name!r} is already registered; pick another name")
    _REGISTRY[name] = fn


def strategies() -> tuple[str, ...]:
    """The registered strategy names, in registration order (the default first)."""
    return tuple(_REGISTRY)


def _options_of(fn: StrategyFn) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _lookup(strategy: Any, options: dict[str, Any]) -> StrategyFn:
    if strategy not in _REGISTRY:
        raise InvalidArgumentError(
            f"unknown strategy {strategy!r}; known strategies: {', '.join(strategies())}"
        )
    fn = _REGISTRY[strategy]
    accepted = _options_of(fn)
    for name in options:
        if name not in accepted:
            raise InvalidArgumentError(
                f"strategy {strategy!r} has no option {name!r}; "
                f"its options: {', '.join(accepted) or 'none'}"
            )
    return fn


def _check_tolerance(tolerance: Any) -> None:
    if not is_number(tolerance):
        raise InvalidArgumentTypeError(f"tolerance must be a number, got {tolerance!r}")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise InvalidArgumentError(f"tolerance must be finite and >= 0, got {tolerance!r}")


def split_dag(
    dag: nx.DiGraph, k: int, strategy: str = "min-cut", tolerance: float = 0.02, **options: Any
) -> dict[Node, int]:
    """Assign every node of ``dag`` to one of k ordered, non-empty stages.

    ``tolerance`` is how far above the best achievable bottleneck (slowest stage) a strategy
    may go to send fewer bytes between stages; ``options`` go to the strategy (see
    ``strategies()`` and each strategy's docstring). The result lists nodes in program order.
    """
    check_dag(dag)
    check_num_stages(dag, k)
    _check_tolerance(tolerance)
    fn = _lookup(strategy, options)
    assignment = fn(dag, k, float(tolerance), **options)
    return {v: assignment[v] for v in program_order(dag)}


def _weights(dag: nx.DiGraph, sequence: Order) -> list[float]:
    """Node costs along ``sequence``; the first carries the inputs' cost, as stage 0 does."""
    weights = [float(dag.nodes[v]["cost"]) for v in sequence]
    weights[0] += sum(float(dag.nodes[v]["cost"]) for v in dag.nodes if is_input(dag, v))
    return weights


def _from_cuts(dag: nx.DiGraph, order: Order, cuts: Sequence[int]) -> Assignment:
    """Stage per node when the non-input sequence of ``order`` is cut before each position."""
    assignment = dict.fromkeys(order, 0)
    for i, v in enumerate(non_inputs(dag, order)):
        assignment[v] = bisect_right(cuts, i)
    return assignment


def _bound(dag: nx.DiGraph, k: int, tolerance: float) -> float:
    """The stage-cost budget: (1 + tolerance) x the best bottleneck over program order."""
    sequence = non_inputs(dag, program_order(dag))
    return (1.0 + tolerance) * min_bottleneck(_weights(dag, sequence), k)


def _dp_split(dag: nx.DiGraph, order: Order, k: int, bound: float) -> Assignment:
    """The contiguous split of ``order`` with the fewest boundary bytes within ``bound``."""
    sequence = non_inputs(dag, order)
    live = live_bytes_at_cuts(dag, order)
    return _from_cuts(dag, order, min_bytes_partition(_weights(dag, sequence), live, k, bound))


def fixed_order(dag: nx.DiGraph, k: int, tolerance: float) -> Assignment:
    """The fixed-order optimum: contiguous stages of program order.

    Among the splits whose every stage costs at most (1 + tolerance) x the best bottleneck of
    program order, the one sending the fewest bytes between stages. No options.
    """
    return _dp_split(dag, program_order(dag), k, _bound(dag, k, tolerance))


def _check_orders(orders: Any) -> None:
    if isinstance(orders, str) or not isinstance(orders, Sequence):
        raise InvalidArgumentTypeError(f"orders must be a list of order names, got {orders!r}")
    for name in orders:
        if name not in ORDERS:
            raise InvalidArgumentError(
                f"unknown order {name!r}; known orders: {', '.join(ORDERS)}"
            )


def _fewest_bytes(dag: nx.DiGraph, k: int, candidates: list[Assignment]) -> Assignment:
    """The candidate sending the fewest bytes, then the lowest bottleneck, then the first."""
    return min(
        candidates,
        key=lambda a: (total_boundary_bytes(dag, a, k), bottleneck(dag, a, k)),
    )


def min_cut(
    dag: nx.DiGraph,
    k: int,
    tolerance: float,
    *,
    orders: Sequence[str] = ("live-bytes", "dfs"),
    refine: bool = True,
) -> Assignment:
    """Fewest boundary bytes within the fixed-order budget, searched over several orders.

    Runs the fixed-order DP over program order and over each of ``orders`` (names from
    ``linearize.ORDERS``: "program", "live-bytes", "dfs"), all with the budget of
    ``fixed-order``, and keeps the split sending the fewest bytes (then the lowest bottleneck,
    then the earliest order). If ``refine``, it then moves each boundary to a minimum s-t cut
    inside a balance-safe corridor of each of those orders whenever that sends strictly fewer
    bytes (see ``mincut``). Program order is always tried first, so the result never sends
    more bytes than ``fixed-order`` and never exceeds its budget.

    Options: ``orders`` (extra orders to try), ``refine`` (bool, min-cut refinement).
    """
    _check_orders(orders)
    if not isinstance(refine, bool):
        raise InvalidArgumentTypeError(f"refine must be a bool, got {refine!r}")
    bound = _bound(dag, k, tolerance)
    tried = [program_order(dag)] + [ORDERS[name](dag) for name in orders]
    candidates = []
    for order in tried:
        try:
            candidates.append(_dp_split(dag, order, k, bound))
        except InfeasibleSplitError:
            continue  # this order cannot meet the program-order budget
    best = _fewest_bytes(dag, k, candidates)
    return mincut.refine(dag, best, k, bound, tried) if refine else best


def greedy(dag: nx.DiGraph, k: int, tolerance: float) -> Assignment:
    """fairscale's rule, kept as a baseline: fill a stage until its cost reaches total / k.

    Walks program order and closes the current stage once its running cost reaches total / k.
    To always give exactly k non-empty stages it also closes a stage when the nodes left are
    just enough to give each remaining stage one, and never opens a stage past the k-th (the
    last one takes the rest). Ignores ``tolerance``; no options.
    """
    weights = _weights(dag, non_inputs(dag, program_order(dag)))
    target = sum(weights) / k
    cuts: list[int] = []
    running = 0.0
    for i, w in enumerate(weights):
        running += w
        stages_left = k - 1 - len(cuts)
        if stages_left and (running >= target or len(weights) - i - 1 == stages_left):
            cuts.append(i + 1)
            running = 0.0
    return _from_cuts(dag, program_order(dag), cuts)


def uniform(dag: nx.DiGraph, k: int, tolerance: float) -> Assignment:
    """Equal numbers of non-input nodes per stage (sizes differ by at most one), in program order.

    Ignores costs and ``tolerance``; no options.
    """
    n = len(non_inputs(dag, program_order(dag)))
    return _from_cuts(dag, program_order(dag), [i * n // k for i in range(1, k)])


register_strategy("min-cut", min_cut)
register_strategy("fixed-order", fixed_order)
register_strategy("greedy", greedy)
register_strategy("uniform", uniform)
