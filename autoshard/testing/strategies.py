"""Hypothesis strategies for graphs that satisfy the splitter's graph contract.

Nodes are named ``in<i>`` (model inputs, inserted first) and ``v<i>`` (computations, inserted
in a topological order). Weights mix zeros, small integers, fractions and powers of ten, so
ties, zero-cost nodes and heavy tails all show up. Requires ``hypothesis``.
"""

from __future__ import annotations

import networkx as nx
from hypothesis import strategies as st

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
