"""Move stage boundaries off any single order with minimum s-t cuts.

A DP over one order can only cut that order into pieces; the cheapest boundary may need nodes
that the order interleaves. Boundary j is the down-closed set S_j of nodes in stages <= j, and
the values crossing it depend on S_j alone, so each boundary can be re-chosen on its own: any
down-closed S with S_{j-1} ⊆ S ⊆ S_{j+1} keeps the partition ordered, and a minimum cut of a
flow network finds the S that sends the fewest bytes.

A plain minimum cut ignores balance (it usually empties a stage), so each cut runs in a
*corridor*: a head of the two stages pinned to stage j and a tail pinned to stage j+1, each
just heavy enough that every S between them keeps both stages within the bound. Corridors come
from several topological orders. A move is kept only if the total boundary bytes strictly
drop, so refinement never makes a partition worse.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import networkx as nx

from autoshard.graph.balance import slack
from autoshard.graph.linearize import Node, Order, is_input, is_output, program_order
from autoshard.graph.partition import stage_costs, total_boundary_bytes

Assignment = dict[Node, int]

_SOURCE = ("source",)
_SINK = ("sink",)
#: Capacities are integers so max-flow saturation tests are exact; bytes are scaled to this.
_RESOLUTION = 2**40
#: Sweeps over all boundaries; each accepted move strictly lowers the bytes, so few are needed.
_MAX_PASSES = 8


def _node(u: Node) -> Hashable:
    return ("node", u)


def _value(u: Node) -> Hashable:
    return ("value", u)


def _cost(dag: nx.DiGraph, v: Node) -> float:
    return float(dag.nodes[v]["cost"])


class _Boundary:
    """The flow network whose minimum cuts are the cheapest down-closed choices for boundary j.

    Nodes of stages j and j+1 outside the pins are free. Inputs, earlier stages and the head
    pins are tied to the source; later stages and the tail pins to the sink. A value v becomes
    an edge node(v) -> value(v) with capacity bytes(v) and uncapacitated edges value(v) -> each
    reader, so it is paid once however many readers sit on the far side. Uncapacitated reverse
    edges reader -> producer keep the source side down-closed.
    """

    def __init__(
        self, dag: nx.DiGraph, stage: Assignment, j: int, head: Order, tail: Order
    ) -> None:
        self.dag, self.stage, self.j = dag, stage, j
        self.head, self.tail = head, tail
        self.pinned = {**dict.fromkeys(head, "source"), **dict.fromkeys(tail, "sink")}
        self.free = [v for v in stage if self.side(v) == "free"]
        self.scale = _RESOLUTION / (sum(float(dag.nodes[v]["bytes"]) for v in stage) or 1.0)
        self.network = nx.DiGraph()
        self.network.add_nodes_from([_SOURCE, _SINK, *map(_node, self.free)])
        for u in stage:
            self._add_value(u)
        for u in self.free:
            for p in dag.predecessors(u):
                if self.side(p) == "free":
                    self.network.add_edge(_node(u), _node(p))

    def side(self, v: Node) -> str:
        if is_input(self.dag, v) or self.stage[v] < self.j:
            return "source"
        if self.stage[v] > self.j + 1:
            return "sink"
        return self.pinned.get(v, "free")

    def _anchor(self, v: Node) -> Hashable:
        """Where v sits in the network: the source, the sink, or its own free node."""
        side = self.side(v)
        if side == "free":
            return _node(v)
        return _SOURCE if side == "source" else _SINK

    def _add_value(self, u: Node) -> None:
        """Add u's value if whether it crosses boundary j depends on the cut."""
        producer = self._anchor(u)
        readers = [self._anchor(v) for v in self.dag.successors(u)]
        if is_output(self.dag, u):
            readers.append(_SINK)
        readers = [r for r in readers if r != producer]
        if producer == _SINK or not readers or (producer == _SOURCE and _SINK in readers):
            return  # never crosses, or crosses whatever the cut
        capacity = round(float(self.dag.nodes[u]["bytes"]) * self.scale)
        self.network.add_edge(producer, _value(u), capacity=capacity)
        for r in readers:
            self.network.add_edge(_value(u), r)

    def best_move(self) -> Assignment:
        """The partition with boundary j at a minimum cut of the corridor.

        ``nx.minimum_cut`` leaves on the source side every node that cannot reach the sink,
        so stage j takes as much of the corridor as the cheapest cut allows.
        """
        source_side = nx.minimum_cut(self.network, _SOURCE, _SINK)[1][0]
        stage = dict(self.stage)
        for v in self.free + self.tail:
            stage[v] = self.j + 1
        for v in self.head + [v for v in self.free if _node(v) in source_side]:
            stage[v] = self.j
        return stage


def _shortest_end(dag: nx.DiGraph, sequence: Order, need: float) -> int:
    """How many leading nodes of ``sequence`` (at least one) it takes to cost ``need``."""
    total = 0.0
    for i, v in enumerate(sequence, 1):
        total += _cost(dag, v)
        if total >= need:
            return i
    return len(sequence) + 1


def _corridor(
    dag: nx.DiGraph, stage: Assignment, j: int, order: Order, bound: float
) -> tuple[Order, Order] | None:
    """Head and tail pins for boundary j along ``order``, or None when no room is left.

    The two stages' nodes along ``order`` form a topological order of them, so a head is
    down-closed and a tail up-closed. The head is the shortest that keeps stage j+1 within the
    bound, the tail the shortest that keeps stage j within it; when they do not overlap, any
    cut between them respects the bound and leaves both stages non-empty.
    """
    region = [v for v in order if stage[v] in (j, j + 1) and not is_input(dag, v)]
    fixed = sum(_cost(dag, v) for v in order if is_input(dag, v)) if j == 0 else 0.0
    region_cost = sum(_cost(dag, v) for v in region)
    round_off = slack(region_cost + fixed)
    head = _shortest_end(dag, region, region_cost - bound - round_off)
    tail = _shortest_end(dag, region[::-1], region_cost + fixed - bound - round_off)
    if head + tail > len(region):
        return None
    return region[:head], region[len(region) - tail :]


def _within(dag: nx.DiGraph, candidate: Assignment, j: int, k: int, bound: float) -> bool:
    costs = stage_costs(dag, candidate, k)
    return max(costs[j], costs[j + 1]) <= bound + slack(sum(costs))


def _refine_boundary(
    dag: nx.DiGraph, stage: Assignment, j: int, k: int, bound: float, orders: Sequence[Order]
) -> Assignment | None:
    """A partition sending strictly fewer bytes by moving boundary j, or None.

    Tries one corridor per order and keeps the cheapest move (the first on ties).
    """
    best, best_bytes = None, total_boundary_bytes(dag, stage, k)
    threshold = best_bytes - slack(best_bytes)
    for order in orders:
        pins = _corridor(dag, stage, j, order, bound)
        if pins is None:
            continue
        candidate = _Boundary(dag, stage, j, *pins).best_move()
        sent = total_boundary_bytes(dag, candidate, k)
        if sent < threshold and sent < best_bytes and _within(dag, candidate, j, k, bound):
            best, best_bytes = candidate, sent
    return best


def refine(
    dag: nx.DiGraph, assignment: Assignment, k: int, bound: float, orders: Sequence[Order]
) -> Assignment:
    """Improve a valid partition boundary by boundary until no corridor cut lowers its bytes.

    ``orders`` are topological orders of ``dag`` that define the corridors. The result is
    valid, keeps every stage within ``bound`` and sends at most as many bytes as the input.
    """
    stage = {v: assignment[v] for v in program_order(dag)}
    for _ in range(_MAX_PASSES):
        improved = False
        for j in range(k - 1):
            better = _refine_boundary(dag, stage, j, k, bound, orders)
            if better is not None:
                stage, improved = better, True
        if not improved:
            break
    return stage
