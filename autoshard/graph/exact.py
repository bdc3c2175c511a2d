"""The ``exact`` strategy: fewest boundary bytes over all ordered partitions, by MILP (HiGHS).

Variables y[v, j] = 1 when node v sits in stage <= j (j = 0..k-2; stage <= k-1 holds for all).
They are monotone in j and closed under predecessors (a node's inputs are at or before it), so
every solution is an ordered partition. A value's bytes are charged at boundary j through
z[u, j] >= y[u, j] - y[v, j] for each reader v (and z[u, j] >= y[u, j] for a model output):
once per boundary however many readers lie beyond it. Stage rows keep each stage within its
cost and memory budgets and non-empty; together groups share their y; each pin chooses its
boundary with binaries w[p, j].

A node and all its ancestors must fit in the stages up to its own (and with its descendants in
the stages from its own on), which bounds the stages each node can take; the y outside those
windows are fixed before solving. On random layered graphs that leaves two or three stages per
node and cuts the root gap of the relaxation by more than half. The solve is
warm-started from ``min-cut``; a solution that only bends a budget within HiGHS's tolerance is
solved again with tighter tolerances; on a time-out the best split found (at worst ``min-cut``'s) is
returned and ``proven_optimal`` is False. A proven result is deterministic; what a time-out
leaves can depend on the machine's speed. Needs ``highspy``, the ``exact`` extra.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from autoshard.errors import InvalidArgumentError, MissingDependencyError
from autoshard.graph.indexed import IndexedDag
from autoshard.graph.invariants import is_number
from autoshard.graph.limits import slack
from autoshard.graph.problem import Outcome, SplitProblem

ZERO, ONE = -1, -2  # y codes for a fixed 0 or 1; variables are column indices >= 0


def _import_highspy() -> Any:
    try:
        import highspy
    except ImportError as err:
        raise MissingDependencyError(
            "strategy 'exact' needs the MILP solver highspy: pip install 'autoshard[exact]'"
        ) from err
    return highspy


def _silent_solver(highspy: Any) -> Any:
    """A HiGHS instance that prints nothing.

    The public ``highspy.Highs`` prints a banner on stdout before options can silence it
    (ERGO-Code/HiGHS#1702); the core class it wraps does not.
    """
    solver = highspy._core._Highs()
    solver.setOptionValue("output_flag", False)
    return solver


#: Up to this many nodes, stage windows use the weight of each node's whole ancestor and
#: descendant sets (bitsets: n^2 / 8 bytes); above it, of its heaviest chains.
CLOSURE_MAX_NODES = 20_000
_ROWS_PER_CHUNK = 2048
#: HiGHS settings measured on the layered benchmark graphs (``benchmarks/split_quality.py``):
#: the root LP bound of this model is weak (about 0.8 of the optimum), so the proof comes from
#: branching on good incumbents. More primal-heuristic effort finds them sooner, and a restart
#: after root fixings only repeats the costly root cut loop. Together they prove layered-1000 at
#: k = 8 in 28 s instead of 37 s and layered-5000 at k = 4 within 40 s instead of not at all;
#: either alone gains nothing. Small graphs are unaffected.
_SEARCH_OPTIONS = {"mip_heuristic_effort": 0.2, "mip_allow_restart": False}
#: HiGHS's row tolerance for a second solve when the first bent a budget: a stage of 1e6 + 1
#: against a budget of 1e6 is within its default (1e-6 of the row's scale), not within ours.
TIGHT_FEASIBILITY = 1e-10


def _heaviest_chains(g: IndexedDag, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the heaviest path ending at it and the heaviest path starting at it."""
    w = weights.tolist()
    into, out = list(w), list(w)
    for v in range(g.n):
        preds = g.pred[v]
        if preds:
            into[v] += max(into[u] for u in preds)
    for v in range(g.n - 1, -1, -1):
        succs = g.succ[v]
        if succs:
            out[v] += max(out[u] for u in succs)
    return np.array(into), np.array(out)


def _closure_sums(n: int, parents: list[list[int]], weights: np.ndarray) -> np.ndarray:
    """Per node v (``parents`` lists each node's parents, numbered before it) and per column of
    ``weights`` (n x L), the total weight of v and of everything that reaches it via ``parents``."""
    words = (n + 63) // 64
    reach = np.zeros((n, words), dtype=np.uint64)
    for v in range(n):
        if parents[v]:
            np.bitwise_or.reduce(reach[parents[v]], axis=0, out=reach[v])
        reach[v, v >> 6] |= np.uint64(1) << np.uint64(v & 63)
    sums = np.empty(weights.shape)
    for lo in range(0, n, _ROWS_PER_CHUNK):
        bits = np.unpackbits(reach[lo : lo + _ROWS_PER_CHUNK].view(np.uint8), axis=1, bitorder="little")
        sums[lo : lo + _ROWS_PER_CHUNK] = bits[:, :n] @ weights
    return sums


def _closures(g: IndexedDag, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node and column of ``weights`` (n x L), the weight of the node with all its
    ancestors, and with all its descendants: what it drags into the stages up to (from) its own.

    Bitsets up to ``CLOSURE_MAX_NODES`` nodes; above, the heaviest chains, a weaker bound.
    """
    if g.n > CLOSURE_MAX_NODES:
        chains = [_heaviest_chains(g, column) for column in weights.T]
        return np.column_stack([c[0] for c in chains]), np.column_stack([c[1] for c in chains])
    pred, succ = g.pred, g.succ
    into = _closure_sums(g.n, [pred[v] for v in range(g.n)], weights)
    flipped = [[g.n - 1 - u for u in succ[g.n - 1 - v]] for v in range(g.n)]
    out = _closure_sums(g.n, flipped, weights[::-1].copy())[::-1]
    return into, out


def stage_ranges(problem: SplitProblem, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Earliest and latest stage each node can take under the budgets (inputs: stage 0).

    A node in stage j has all its ancestors in stages <= j, so it and its ancestors must fit in
    the budgets of stages 0..j; likewise it and its descendants in stages j..k-1 (see
    ``_closures``), and within its ``stage_ranges``. The ranges are widened to hold ``start``, a
    feasible split, against round-off.
    """
    g, k = problem.graph, problem.k
    earliest = np.zeros(g.n, dtype=np.int64)
    latest = np.full(g.n, k - 1, dtype=np.int64)
    limits = problem.limits()
    least = np.column_stack([limit.least() for limit in limits])
    into_all, out_all = _closures(g, np.where(np.arange(g.n)[:, None] < g.num_inputs, 0.0, least))
    for i, limit in enumerate(limits):
        weights, budgets, into, out = least[:, i], limit.budgets, into_all[:, i], out_all[:, i]
        fixed = float(weights[: g.num_inputs].sum())
        round_off = slack(float(weights.sum()) + float(budgets.sum()))
        before = np.cumsum(budgets) + round_off
        after = np.cumsum(budgets[::-1])[::-1] + round_off
        earliest = np.maximum(earliest, np.searchsorted(before, into + fixed, side="left"))
        latest = np.minimum(latest, np.searchsorted(-after, -out, side="right") - 1)
    if problem.rules.ranges is not None:
        earliest = np.maximum(earliest, problem.rules.ranges.earliest)
        latest = np.minimum(latest, problem.rules.ranges.latest)
    earliest, latest = np.minimum(earliest, start), np.maximum(latest, start)
    earliest[: g.num_inputs] = 0
    latest[: g.num_inputs] = 0
    return earliest, latest


class _Model:
    """Columns and rows of the MILP, with fixed y folded into row bounds."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[float, float, list[tuple[int, float]]]] = []

    def column(self, cost: float = 0.0, integer: bool = True) -> int:
        """A new column in [0, 1] (binary unless ``integer`` is false)."""
        self.cost.append(cost)
        if integer:
            self.integer.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        """lower <= sum(coef * y) <= upper, where fixed codes contribute constants."""
        live = []
        for code, coef in terms:
            if code == ONE:
                lower, upper = lower - coef, upper - coef
            elif code != ZERO:
                live.append((code, coef))
        if live:
            self.rows.append((lower, upper, live))

    def solve(self, highspy: Any, start: np.ndarray, time_limit: float,
              feasibility: float | None = None) -> tuple[np.ndarray | None, bool]:
        """(solution columns or None, whether proven optimal); ``feasibility``: HiGHS's tolerance on
        rows (its default when None)."""
        solver = _silent_solver(highspy)
        inf = highspy.kHighsInf
        n = len(self.cost)
        empty = np.zeros(0, dtype=np.int32)
        solver.addCols(n, np.array(self.cost), np.zeros(n), np.ones(n), 0, empty, empty, np.zeros(0))
        starts, index, value = [], [], []
        for _, _, terms in self.rows:
            starts.append(len(index))
            index.extend(c for c, _ in terms)
            value.extend(coef for _, coef in terms)
        lower = np.array([max(r[0], -inf) for r in self.rows])
        upper = np.array([min(r[1], inf) for r in self.rows])
        solver.addRows(len(self.rows), lower, upper, len(index), np.array(starts, dtype=np.int32),
                       np.array(index, dtype=np.int32), np.array(value))
        kinds = np.array([highspy.HighsVarType.kInteger] * len(self.integer))
        solver.changeColsIntegrality(len(self.integer), np.array(self.integer, dtype=np.int32), kinds)
        solver.setOptionValue("time_limit", float(time_limit))
        solver.setOptionValue("mip_rel_gap", 0.0)
        if feasibility is not None:
            for option in ("mip_feasibility_tolerance", "primal_feasibility_tolerance"):
                solver.setOptionValue(option, feasibility)
        for option, value in _SEARCH_OPTIONS.items():
            solver.setOptionValue(option, value)
        hint = highspy.HighsSolution()
        hint.col_value = start.tolist()
        hint.value_valid = True
        solver.setSolution(hint)
        solver.run()
        status = solver.getModelStatus()
        if solver.getInfo().primal_solution_status != int(highspy.SolutionStatus.kSolutionStatusFeasible):
            return None, False
        return np.array(solver.getSolution().col_value), status == highspy.HighsModelStatus.kOptimal


class _Formulation:
    """Builds the MILP for one problem and maps solutions back to stage arrays."""

    def __init__(self, problem: SplitProblem, start: np.ndarray) -> None:
        self.problem = problem
        g, k = problem.graph, problem.k
        self.model = _Model()
        self.earliest, self.latest = stage_ranges(problem, start)
        self.y = np.full((g.n, max(k - 1, 0)), ZERO, dtype=np.int64)
        for v in range(g.n):
            for j in range(k - 1):
                if j >= self.latest[v]:
                    self.y[v, j] = ONE
                elif j >= self.earliest[v]:
                    self.y[v, j] = self.model.column()
        self.z: list[tuple[int, int, int]] = []  # (value node, boundary, column)
        self.w: list[list[int]] = []
        scale = float(g.nbytes.max()) or 1.0
        self._order_rows()
        self._stage_rows()
        self._group_rows()
        self._pin_rows()
        self._value_rows(scale)

    def _order_rows(self) -> None:
        g, y, m = self.problem.graph, self.y, self.model
        for j in range(self.problem.k - 1):
            for v in range(g.n):
                if j + 1 < self.problem.k - 1:
                    m.row([(y[v, j + 1], 1.0), (y[v, j], -1.0)], 0.0, np.inf)
            for u, v in zip(g.src.tolist(), g.dst.tolist()):
                m.row([(y[u, j], 1.0), (y[v, j], -1.0)], 0.0, np.inf)

    def _member(self, v: int, j: int) -> list[tuple[int, float]]:
        """Terms of 'v is in stage j': y[v, j] - y[v, j-1], with y[v, k-1] = 1."""
        k = self.problem.k
        terms = [(self.y[v, j], 1.0) if j < k - 1 else (ONE, 1.0)]
        if j > 0:
            terms.append((self.y[v, j - 1], -1.0))
        return terms

    def _stage_rows(self) -> None:
        problem = self.problem
        g = problem.graph
        nodes = range(g.num_inputs, g.n)
        for j in range(problem.k):
            members = [t for v in nodes for t in self._member(v, j)]
            self.model.row(members, 1.0, np.inf)  # non-empty
            for limit in problem.limits():  # in units of the budget, so tolerances are relative
                weights = limit.weights(j)
                unit = float(limit.budgets[j]) or 1.0
                fixed = float(weights[: g.num_inputs].sum()) if j == 0 else 0.0
                terms = [(c, coef * float(weights[v]) / unit) for v in nodes
                         for c, coef in self._member(v, j) if weights[v]]
                room = float(limit.budgets[j]) - fixed + limit.round_off(j)
                self.model.row(terms, -np.inf, room / unit)

    def _group_rows(self) -> None:
        for _, members in self.problem.rules.groups:
            first = int(members[0])
            for v in members[1:].tolist():
                for j in range(self.problem.k - 1):
                    self.model.row([(self.y[first, j], 1.0), (self.y[v, j], -1.0)], 0.0, 0.0)

    def _pin_rows(self) -> None:
        """Each pinned prefix P is exactly the set of stages <= some boundary j (chosen by w)."""
        g, k = self.problem.graph, self.problem.k
        for pin in self.problem.rules.pins.tolist():
            inside = np.arange(g.n) < g.num_inputs + pin
            tops = [v for v in range(g.n) if inside[v] and not any(inside[s] for s in g.succ[v])]
            bottoms = [v for v in range(g.n) if not inside[v] and not any(not inside[p] for p in g.pred[v])]
            choice = [self.model.column() for _ in range(k - 1)]
            self.model.row([(c, 1.0) for c in choice], 1.0, 1.0)
            for j, c in enumerate(choice):
                for v in tops:
                    self.model.row([(self.y[v, j], 1.0), (c, -1.0)], 0.0, np.inf)
                for v in bottoms:
                    self.model.row([(self.y[v, j], 1.0), (c, 1.0)], -np.inf, 1.0)
            self.w.append(choice)

    def _value_rows(self, scale: float) -> None:
        g, y, m = self.problem.graph, self.y, self.model
        for u in range(g.n):
            readers = g.succ[u]
            if not readers and not g.output[u]:
                continue
            for j in range(self.problem.k - 1):
                if y[u, j] == ZERO:
                    continue
                beyond = [v for v in readers if y[v, j] != ONE]
                if not beyond and not g.output[u]:
                    continue
                z = m.column(float(g.nbytes[u]) / scale, integer=False)
                self.z.append((u, j, z))
                if g.output[u]:
                    m.row([(z, 1.0), (y[u, j], -1.0)], 0.0, np.inf)
                for v in beyond:
                    m.row([(z, 1.0), (y[u, j], -1.0), (y[v, j], 1.0)], 0.0, np.inf)

    def columns(self, stages: np.ndarray) -> np.ndarray:
        """The column values that encode ``stages`` (a feasible start)."""
        values = np.zeros(len(self.model.cost))
        k, g = self.problem.k, self.problem.graph
        for v in range(g.n):
            for j in range(k - 1):
                if self.y[v, j] >= 0:
                    values[self.y[v, j]] = float(stages[v] <= j)
        crossings = g.crossings(stages, k)
        for u, j, z in self.z:
            values[z] = float(stages[u] <= j < stages[u] + crossings[u])
        for pin, choice in zip(self.problem.rules.pins.tolist(), self.w):
            values[choice[self.problem.pinned_boundary(stages, pin)]] = 1.0
        return values

    def stages(self, columns: np.ndarray) -> np.ndarray:
        g, k = self.problem.graph, self.problem.k
        stages = np.full(g.n, k - 1, dtype=np.int64)
        for j in range(k - 2, -1, -1):
            code = self.y[:, j]
            inside = np.where(code >= 0, columns[np.maximum(code, 0)] > 0.5, code == ONE)
            stages[inside] = j
        return stages


def _within_rows(problem: SplitProblem, stages: np.ndarray) -> bool:
    """Whether every stage keeps its budgets within the round-off its row allows (1e-9 of the total).

    ``is_valid`` allows round-off of the budgets' sum too, so it can accept a row HiGHS bent within its
    own tolerance: a chain costing 20, 5e-8, 0 came out 20 + 5e-8 in one of two stages where 20 fits.
    """
    k = problem.k
    return all(bool(np.all(limit.sums(stages, k) <= limit.budgets + [limit.round_off(j) for j in range(k)]))
               for limit in problem.limits())


def solve(problem: SplitProblem, warm_start: Callable[[SplitProblem], np.ndarray], time_limit: float) -> Outcome:
    """The MILP's best split within ``time_limit`` seconds, never worse than ``warm_start``'s."""
    if not is_number(time_limit) or not time_limit > 0:
        raise InvalidArgumentError(f"time_limit must be a number of seconds > 0, got {time_limit!r}")
    k, g = problem.k, problem.graph
    highspy = _import_highspy()
    start = warm_start(problem)
    if k == 1:
        return Outcome(start, proven_optimal=True)
    formulation = _Formulation(problem, start)
    started = time.monotonic()
    for feasibility in (None, TIGHT_FEASIBILITY):
        remaining = time_limit - (time.monotonic() - started)
        if remaining <= 0:
            break
        columns, proven = formulation.model.solve(highspy, formulation.columns(start), remaining, feasibility)
        if columns is None:
            return Outcome(start, proven_optimal=False)
        stages = formulation.stages(columns)
        if g.total_bytes(start, k) <= g.total_bytes(stages, k):
            # The solver's optimum (within its feasibility tolerances, so over a slightly larger set
            # of splits) is a lower bound: a start that sends no more is optimal too.
            return Outcome(start, proven_optimal=proven)
        if problem.is_valid(stages) and _within_rows(problem, stages):
            return Outcome(stages, proven_optimal=proven)
        # better only by bending a budget within HiGHS's tolerance: solve again, held tighter
    return Outcome(start, proven_optimal=False)
