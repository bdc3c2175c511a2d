"""Hypothesis strategies for graphs that satisfy the splitter's graph contract.

Nodes are named ``in<i>`` (model inputs, inserted first) and ``v<i>`` (computations, inserted
in a topological order). Weights mix zeros, small integers, fractions and powers of ten, so
ties, zero-cost nodes and heavy tails all show up. Requires ``hypothesis``.
"""

from __future__ import annotations

import networkx as nx
from hypothesis import strategies as st

from autoshard.graph.constraints import Constraints
from autoshard.graph.indexed import program_order

#: Node weights: zeros and small integers make ties; powers of ten make heavy tails.
weights = st.one_of(
    st.just(0.0),
    st.integers(0, 10).map(float),
    st.floats(0.0, 100.0, allow_nan=False, allow_infinity=False),
    st.integers(0, 6).map(lambda e: float(10**e)),
)


def _add_node(draw: st.DrawFn, dag: nx.DiGraph, name: str, flags: bool, **attrs: bool) -> None:
    output = draw(st.booleans()) if flags else False
    dag.add_node(name, cost=draw(weights), bytes=draw(weights), output=output, **attrs)


def _add_inputs(draw: st.DrawFn, dag: nx.DiGraph, max_inputs: int) -> list[str]:
    names = [f"in{i}" for i in range(draw(st.integers(0, max_inputs)))]
    for name in names:
        dag.add_node(name, cost=draw(weights), bytes=draw(weights), input=True)
    return names


@st.composite
def chains(
    draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 8, flags: bool = True
) -> nx.DiGraph:
    """A path v0 -> v1 -> ..., optionally fed by one input and with random ``output`` flags.

    Every valid partition of a chain is contiguous, so brute force over cut positions is the
    true optimum.
    """
    dag = nx.DiGraph()
    inputs = _add_inputs(draw, dag, 1 if flags else 0)
    names = [f"v{i}" for i in range(draw(st.integers(min_nodes, max_nodes)))]
    for name in names:
        _add_node(draw, dag, name, flags)
    nx.add_path(dag, inputs + names)
    return dag


def _predecessors(draw: st.DrawFn, earlier: list[str], hub: str | None) -> list[str]:
    """Readers of the previous node make chains; random earlier picks make skips and fan-in."""
    preds = [earlier[-1]] if earlier and draw(st.booleans()) else []
    if earlier:
        preds += draw(st.lists(st.sampled_from(earlier), max_size=2))
    if hub is not None and draw(st.booleans()):
        preds.append(hub)
    return list(dict.fromkeys(preds))


@st.composite
def dags(
    draw: st.DrawFn,
    min_nodes: int = 1,
    max_nodes: int = 8,
    max_inputs: int = 2,
    flags: bool = True,
) -> nx.DiGraph:
    """A random small DAG: chains, diamonds, long skips, fan-out/fan-in, one many-reader hub.

    ``min_nodes``/``max_nodes`` count non-input nodes; ``flags`` allows ``output`` flags and up
    to ``max_inputs`` inputs.
    """
    dag = nx.DiGraph()
    inputs = _add_inputs(draw, dag, max_inputs if flags else 0)
    names = [f"v{i}" for i in range(draw(st.integers(min_nodes, max_nodes)))]
    earlier = list(inputs)
    hub = draw(st.sampled_from([None, *inputs, *names]))
    for name in names:
        _add_node(draw, dag, name, flags)
        for p in _predecessors(draw, earlier, hub if hub in earlier else None):
            dag.add_edge(p, name)
        earlier.append(name)
    return dag


@st.composite
def split_problems(
    draw: st.DrawFn, graphs: st.SearchStrategy[nx.DiGraph] | None = None, max_stages: int = 4
) -> tuple[nx.DiGraph, int]:
    """A graph and a feasible number of stages (1..min(max_stages, non-input nodes))."""
    dag = draw(graphs if graphs is not None else dags())
    splittable = sum(1 for v in dag.nodes if not dag.nodes[v].get("input", False))
    return dag, draw(st.integers(1, max(1, min(max_stages, splittable))))


def _motif(draw: st.DrawFn, dag: nx.DiGraph, names: list[str], room: int, flags: bool) -> None:
    """Append one motif after the last node: a chain, diamond, long skip, fan-out or fan-in."""
    tail = names[-1]

    def add(reads: list[str]) -> str:
        name = f"v{sum(1 for n in names if n.startswith('v'))}"
        _add_node(draw, dag, name, flags)
        dag.add_edges_from((r, name) for r in dict.fromkeys(reads))
        names.append(name)
        return name

    kind = draw(st.sampled_from(["chain", "diamond", "skip", "fan-out", "fan-in"]))
    if kind == "chain":
        for _ in range(min(room, draw(st.integers(1, 3)))):
            add([names[-1]])
    elif kind == "diamond" and room >= 3:
        ends = [add([tail]) for _ in range(min(room - 1, draw(st.integers(2, 3))))]
        add(ends)
    elif kind == "fan-out" and room >= 2:
        for _ in range(min(room, draw(st.integers(2, 4)))):
            add([tail])  # one value, many readers
    elif kind == "fan-in":
        add([tail, *draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))])
    else:  # a long skip: read the tail and the oldest node
        add([tail, names[0]])


@st.composite
def shaped_dags(draw: st.DrawFn, max_nodes: int = 8, flags: bool = True) -> nx.DiGraph:
    """Motifs in sequence: chains, diamonds, long skips, fan-out (one value, many readers), fan-in.

    Built from one source (an input when ``flags``) with at most ``max_nodes`` non-input
    nodes; weights include zeros and heavy tails.
    """
    dag = nx.DiGraph()
    inputs = _add_inputs(draw, dag, 1) if flags else []
    _add_node(draw, dag, "v0", flags)
    dag.add_edges_from((i, "v0") for i in inputs)
    names = [*inputs, "v0"]
    while len(names) - len(inputs) < max_nodes and draw(st.booleans()):
        _motif(draw, dag, names, max_nodes - (len(names) - len(inputs)), flags)
    return dag


@st.composite
def constrained_problems(
    draw: st.DrawFn, graphs: st.SearchStrategy[nx.DiGraph] | None = None, max_stages: int = 4
) -> tuple[nx.DiGraph, int, Constraints]:
    """A graph, k and random constraints: pins, together groups, stage ranges, capacities, memory
    budgets.

    Many draws are infeasible on purpose, so a test can check that those raise. Stage ranges
    hold nodes to (around) their stage in a random split of program order, so they alone can be
    met along program order. When memory
    budgets are drawn, every node gets a ``memory`` attribute, and sometimes per-stage
    microbatches in flight with an ``activation_memory`` attribute on some nodes.
    """
    dag, k = draw(split_problems(graphs, max_stages))
    computed = [v for v in dag.nodes if not dag.nodes[v].get("input", False)]
    nodes = list(dag.nodes)
    cut_before = draw(st.lists(st.sampled_from(computed), max_size=min(2, k - 1), unique=True))
    group = st.lists(st.sampled_from(nodes), min_size=min(2, len(nodes)), max_size=3, unique=True)
    together = draw(st.lists(group, max_size=2))
    ranges = {}
    if draw(st.booleans()):
        along = [v for v in program_order(dag) if v in computed]
        cuts = [] if k == 1 else sorted(draw(st.lists(st.integers(1, len(along) - 1), min_size=k - 1,
                                                      max_size=k - 1, unique=True)))
        for v in draw(st.lists(st.sampled_from(along), max_size=2, unique=True)):
            stage = sum(along.index(v) >= c for c in cuts)
            ranges[v] = (stage, min(stage + draw(st.integers(0, 1)), k - 1))
    capacities = draw(st.none() | st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=k, max_size=k))
    budgets = in_flight = None
    if draw(st.booleans()):
        for v in nodes:
            dag.nodes[v]["memory"] = draw(st.integers(0, 4).map(float))
        budgets = draw(st.lists(st.integers(0, 12).map(float), min_size=k, max_size=k))
        if draw(st.booleans()):
            in_flight = draw(st.lists(st.integers(0, 3).map(float), min_size=k, max_size=k))
            for v in draw(st.lists(st.sampled_from(nodes), unique=True)):
                dag.nodes[v]["activation_memory"] = draw(st.integers(0, 3).map(float))
    return dag, k, Constraints.build(cut_before, together, (), capacities, budgets, in_flight, ranges)
