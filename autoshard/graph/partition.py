"""A split of a DAG into ordered stages, and what it costs: stage costs and boundary traffic.

The functions take the plain ``dict[node, int]`` that ``split_dag`` returns, so any caller can
score any assignment; ``Partition`` is the frozen form the pipeline passes around. They assume
a valid partition (see ``check_partition``); they score, they do not validate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

import networkx as nx
import numpy as np

from autoshard.graph.invariants import check_partition
from autoshard.graph.linearize import Node, is_input, is_output, program_order

Assignment = Mapping[Node, int]


@dataclass(frozen=True)
class SplitInfo:
    """What is known about a split's quality, kept beside it for plans and reports.

    ``bound`` is the balance budget B the bounded strategies keep (stage j costs at most
    B x capacity_j; None for strategies without one); ``bottleneck`` is the achieved
    max_j cost_j / capacity_j; ``boundary_bytes`` counts each value once per boundary it
    crosses. ``proven_optimal`` is set by ``exact`` (None for heuristics). ``separated`` lists
    the ``prefer_together`` groups (e.g. tied weights) that ended up in several stages.
    ``tolerance`` is the one the split was asked for (None for strategies without a bound).
    """

    strategy: str
    bound: float | None
    bottleneck: float
    boundary_bytes: float
    proven_optimal: bool | None = None
    separated: tuple[str, ...] = ()
    tolerance: float | None = None


@dataclass(frozen=True)
class Partition:
    """An assignment of every node to one of ``num_stages`` ordered stages.

    ``assignment`` is read-only and iterates in program order when built by ``from_assignment``,
    so ``stage_nodes`` lists each stage in the order the program runs it. ``info`` describes
    how the split was found; it does not take part in equality.
    """

    assignment: Mapping[Node, int]
    num_stages: int
    info: SplitInfo | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignment", MappingProxyType(dict(self.assignment)))

    def __hash__(self) -> int:
        return hash((tuple(self.assignment.items()), self.num_stages))

    def __reduce__(self) -> tuple:
        """Pickle (and deep-copy) through a plain dict: a mapping proxy cannot be pickled."""
        return (type(self), (dict(self.assignment), self.num_stages, self.info))

    @classmethod
    def from_assignment(
        cls, dag: nx.DiGraph, assignment: Assignment, num_stages: int, info: SplitInfo | None = None
    ) -> Partition:
        """Validate ``assignment`` against ``dag`` and store it in program order, each node whose stage runs
        nothing of it where it runs (``placed_by``): a node ``made_from`` another (a shape's carrier, made
        where it is sent on) in the stage of the last node it follows, that one's or a write's to it; a
        value that each of its ``readers`` recomputes (a size), which has no edges, with the first of them.
        Where the split put them, their stage drew their inputs across for nothing and showed their module
        there, as cut; the split weighs them where they are placed (``costs_as_placed``). Placing a placed
        partition again changes nothing; one that would leave a stage empty is stored as given."""
        check_partition(dag, assignment, num_stages)
        order = program_order(dag)
        placed = dict(assignment)
        for v in order:
            if dag.nodes[v].get("made_from") is not None:
                placed[v] = max(map(assignment.__getitem__, dag.predecessors(v)))
        for v in reversed(order):  # a reader recomputed in turn (a size's item) is placed before it is read
            readers = dag.nodes[v].get("readers")
            if readers:
                placed[v] = placed[readers[0]]
        if len({placed[v] for v in order if not is_input(dag, v)}) < num_stages:  # a stage of such nodes alone:
            placed = dict(assignment)  # it stays as the split made it
        return cls({v: placed[v] for v in order}, num_stages, info)

    def stage_of(self, node: Node) -> int:
        return self.assignment[node]

    def stage_nodes(self, j: int) -> list[Node]:
        """The nodes of stage ``j``, in the assignment's (program) order."""
        return [v for v, s in self.assignment.items() if s == j]

    def stages(self) -> list[list[Node]]:
        """Every stage's nodes, stage 0 first."""
        out: list[list[Node]] = [[] for _ in range(self.num_stages)]
        for v, s in self.assignment.items():
            out[s].append(v)
        return out


def placed_by(dag: nx.DiGraph, node: Node) -> Node | None:
    """The node with which a partition places ``node`` (``Partition.from_assignment``): a carrier's tensor,
    a recomputed value's first reader; None for a node the split places."""
    data = dag.nodes[node]
    return data.get("made_from") or next(iter(data.get("readers") or ()), None)


def remade_values(dag: nx.DiGraph) -> frozenset[Node]:
    """The tensors each stage reading them computes again (``readers``: a mask made from the inputs' sizes)."""
    return frozenset(v for v, data in dag.nodes(data=True) if data.get("readers") and data.get("tensor"))


def made_again(dag: nx.DiGraph) -> list[Node]:
    """The nodes each of whose ``readers``' stages computes again (a size, a mask), last in program order first:
    the order ``also_run`` walks them in."""
    return [v for v in reversed(list(dag.nodes)) if dag.nodes[v].get("readers")]  # the DAG's order is the program's


def also_run(dag: nx.DiGraph, assignment: Assignment,
             again: Sequence[Node] | None = None) -> dict[Node, frozenset[int]]:
    """Per node that each of its ``readers``' stages computes again (``again``: ``made_again``'s), the stages
    running it besides the one a partition places it in: each pays for it, in time and in what it keeps."""
    runs: dict[Node, frozenset[int]] = {}
    for v in made_again(dag) if again is None else again:  # its readers come later, made again in turn first
        runs[v] = frozenset({assignment[v]}).union(*(runs.get(r, (assignment[r],)) for r in dag.nodes[v]["readers"]))
    return {v: stages - {assignment[v]} for v, stages in runs.items() if len(stages) > 1}


def costs_as_placed(dag: nx.DiGraph, costs: Mapping[Node, float]) -> dict[Node, float]:
    """``costs`` with each node's moved onto the node it is placed by (``placed_by``): a split weighs every
    stage as its partition holds it. (A carrier after an in-place write to its tensor sits with the write.)"""
    moved = dict(costs)
    for v in program_order(dag):  # a first reader recomputed in turn passes on what it got
        by = placed_by(dag, v)
        if by is not None:
            moved[by] += moved[v]
            moved[v] = 0.0
    return moved


def stage_costs(dag: nx.DiGraph, assignment: Assignment, k: int) -> list[float]:
    """Sum of ``cost`` per stage; input nodes count toward stage 0."""
    costs = [0.0] * k
    for v in program_order(dag):
        costs[assignment[v]] += float(dag.nodes[v]["cost"])
    return costs


def bottleneck(dag: nx.DiGraph, assignment: Assignment, k: int) -> float:
    """The slowest stage's cost: what limits pipeline throughput."""
    return max(stage_costs(dag, assignment, k))


def crossed_boundaries(dag: nx.DiGraph, assignment: Assignment, k: int, node: Node) -> range:
    """The boundaries ``node``'s value crosses: from its stage up to its last reader's stage.

    A model output is read after the last stage, so it crosses every later boundary. A node
    ``made_from`` another (a zero-byte carrier of a tensor's shape) is made again, for nothing, by
    every stage holding that one's value, so it crosses only the boundaries past the last of them.
    """
    first = assignment[node]
    last = k - 1 if is_output(dag, node) else max((assignment[v] for v in dag.successors(node)), default=first)
    source = dag.nodes[node].get("made_from")
    if source is not None:
        first = max(first, crossed_boundaries(dag, assignment, k, source).stop)
    return range(first, last)


def boundary_values(dag: nx.DiGraph, assignment: Assignment, k: int) -> list[list[Node]]:
    """Per boundary j (between stage j and j+1), the producers whose value crosses it.

    Each value appears once per boundary however many readers it has; producers are listed in
    program order.
    """
    values: list[list[Node]] = [[] for _ in range(k - 1)]
    for v in program_order(dag):
        for j in crossed_boundaries(dag, assignment, k, v):
            values[j].append(v)
    return values


def stage_between(inputs: Sequence[Node], rest: Sequence[Node], j: int, a: int, b: int) -> dict[Node, int]:
    """The assignment running ``rest[a:b]`` in stage j, what comes before in stage j - 1 and what comes after
    in j + 1 (the model ``inputs`` in stage 0): stage j of any contiguous split of ``rest`` with those cuts
    receives and sends what it does here. In the order of ``inputs``, then ``rest``."""
    assignment = dict.fromkeys(inputs, 0)
    for nodes, stage in ((rest[:a], j - 1), (rest[a:b], j), (rest[b:], j + 1)):
        assignment.update(dict.fromkeys(nodes, stage))
    return assignment


class Cuts:
    """The values crossing each cut of the contiguous splits of ``rest`` (the model ``inputs`` in the first
    stage), as ``boundary_values`` lists them: cut p, before ``rest[p]``, is crossed by each value made before
    it (an input: before every node) and read at or after it (a model output: after the last node); a carrier
    ``made_from`` another, only once that one's last reader is before it (``crossed_boundaries``). Each cut's
    values are found once, from every value's span of cuts, where ``boundary_values`` walks the whole graph
    for every split."""

    def __init__(self, dag: nx.DiGraph, inputs: Sequence[Node], rest: Sequence[Node]) -> None:
        position = {**dict.fromkeys(inputs, -1), **{v: i for i, v in enumerate(rest)}}
        self.values = program_order(dag)
        last = {v: len(rest) if is_output(dag, v) else max(map(position.__getitem__, dag.successors(v)),
                                                           default=position[v])
                for v in self.values}
        made_from = dict(dag.nodes(data="made_from"))
        self.first = np.array([position[v] if made_from[v] is None else max(position[v], last[made_from[v]])
                               for v in self.values])
        self.last = np.array([last[v] for v in self.values])
        self.crossed: dict[int, list[Node]] = {}

    def crossing(self, p: int) -> list[Node]:
        """The values crossing cut p, in program order."""
        if p not in self.crossed:
            self.crossed[p] = [self.values[i] for i in np.flatnonzero((self.first < p) & (p <= self.last))]
        return self.crossed[p]


def boundary_bytes(dag: nx.DiGraph, assignment: Assignment, k: int) -> list[float]:
    """Bytes sent across each boundary: the sum of ``bytes`` of the values crossing it."""
    return [
        sum(float(dag.nodes[v]["bytes"]) for v in values)
        for values in boundary_values(dag, assignment, k)
    ]


def total_boundary_bytes(dag: nx.DiGraph, assignment: Assignment, k: int) -> float:
    """All bytes sent between stages, in O(n + m)."""
    return sum(
        float(dag.nodes[v]["bytes"]) * len(crossed_boundaries(dag, assignment, k, v))
        for v in program_order(dag)
    )
