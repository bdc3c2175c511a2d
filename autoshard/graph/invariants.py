"""The one definition of a valid graph and a valid partition, shared by the splitter and tests.

Every check raises a typed error whose message names the broken rule and the node involved,
so a caller can fix the graph or the request without reading this code.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Mapping

import networkx as nx
import numpy as np

from autoshard.arguments import whole_number
from autoshard.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidGraphError,
    TooManyStagesError,
    plural,
)
from autoshard.graph.indexed import IndexedDag, Node, is_input

WEIGHTS = ("cost", "bytes")


def is_number(value: Any) -> bool:
    """A real number that is not a bool (``True`` is an int in Python, never a weight here) and
    that a float can hold (``10**400`` cannot)."""
    if not isinstance(value, Real) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


#: Weight types accepted without a closer look; anything else goes through ``is_number``.
_PLAIN_NUMBERS = frozenset({int, float})


def _check_weight(dag: nx.DiGraph, node: Node, name: str) -> None:
    data = dag.nodes[node]
    if name not in data:
        raise InvalidGraphError(f"node {node!r} has no '{name}' attribute; every node needs one")
    value = data[name]
    if not is_number(value):
        raise InvalidGraphError(f"node {node!r} has '{name}'={value!r}; it must be a number")
    if not math.isfinite(value) or value < 0:
        raise InvalidGraphError(
            f"node {node!r} has '{name}'={value!r}; it must be finite and >= 0"
        )


def _check_acyclic(dag: nx.DiGraph) -> None:
    index = {v: i for i, v in enumerate(dag.nodes)}
    if all(index[u] < index[v] for u, v in dag.edges) or nx.is_directed_acyclic_graph(dag):
        return  # the first test is the common case: insertion order is already topological
    cycle = [u for u, _ in nx.find_cycle(dag)]
    raise InvalidGraphError(
        f"the graph has a cycle through node {cycle[0]!r} ({' -> '.join(map(repr, cycle))}); "
        "a dataflow graph must be acyclic"
    )


def check_weights(dag: nx.DiGraph, names: tuple[str, ...], required: bool = True) -> None:
    """Raise ``InvalidGraphError`` unless every node has each attribute in ``names``, finite and >= 0.

    With ``required`` false a node may lack an attribute (it then counts 0), but a value given
    must still be a finite number >= 0. Checks all values at once when they are plain ints and
    floats; otherwise (or when that check fails) node by node, to name the first offender.
    """
    missing = None if required else 0.0
    for name in names:
        values = [data.get(name, missing) for _, data in dag.nodes(data=True)]
        plain = set(map(type, values)) <= _PLAIN_NUMBERS
        try:
            array = np.array(values, dtype=float) if plain else None
        except OverflowError:  # an int too large for a float: named below
            array = None
        if array is None or not (np.all(np.isfinite(array)) and np.all(array >= 0)):
            for node in dag.nodes:
                if required or name in dag.nodes[node]:
                    _check_weight(dag, node, name)
        total = sum(float(data.get(name, 0.0)) for _, data in dag.nodes(data=True))
        if not math.isfinite(total):  # each is finite, but sums of them (stage costs) would not be
            raise InvalidGraphError(f"the nodes' '{name}' values sum past the largest float ({total}); "
                                    "express them in larger units")


def check_dag(dag: Any) -> None:
    """Raise ``InvalidGraphError`` unless ``dag`` satisfies the graph contract."""
    if not isinstance(dag, nx.DiGraph) or dag.is_multigraph():
        raise InvalidGraphError(f"expected a networkx.DiGraph (one edge per reader), got {type(dag).__name__}")
    check_weights(dag, WEIGHTS)
    for node in dag.nodes:
        if is_input(dag, node) and dag.in_degree(node) > 0:
            first = next(iter(dag.predecessors(node)))
            raise InvalidGraphError(
                f"input node {node!r} has a predecessor ({first!r}); inputs must be sources"
            )
    _check_acyclic(dag)


def max_stages(dag: nx.DiGraph | IndexedDag) -> int:
    """How many non-empty stages ``dag`` can fill: one per non-input node."""
    if isinstance(dag, IndexedDag):
        return dag.n - dag.num_inputs
    return sum(1 for v in dag.nodes if not is_input(dag, v))


def check_stage_count(k: Any, maximum: int, detail: str) -> int:
    """``k`` as an int, or raise unless it is a whole number in ``1..maximum``; ``detail`` says
    where the maximum is from."""
    k = whole_number(k, "the number of stages", at_least=1)
    if k > maximum:
        raise TooManyStagesError(k, maximum, detail)
    return k


def check_num_stages(dag: nx.DiGraph | IndexedDag, k: Any) -> int:
    """``k`` as an int, or raise unless it is a whole number in ``1..max_stages(dag)``."""
    maximum = max_stages(dag)
    return check_stage_count(k, maximum, f"the graph has {plural(maximum, 'non-input node')} and each stage needs one")


def _check_stage_values(dag: nx.DiGraph, assignment: Mapping[Node, Any], k: int) -> None:
    for node in dag.nodes:
        if node not in assignment:
            raise InvalidArgumentError(f"covering: node {node!r} is not assigned to a stage")
        stage = assignment[node]
        if not isinstance(stage, Integral) or isinstance(stage, bool):
            raise InvalidArgumentError(
                f"range: node {node!r} is assigned to stage {stage!r}, a {type(stage).__name__}; "
                f"stages are the ints 0..{k - 1}"
            )
        if not 0 <= stage < k:
            raise InvalidArgumentError(
                f"range: node {node!r} is assigned to stage {stage!r}; stages are 0..{k - 1}"
            )
    if len(assignment) != dag.number_of_nodes():
        extra = next(v for v in assignment if v not in dag)
        raise InvalidArgumentError(f"covering: {extra!r} is assigned but is not a graph node")


def _check_inputs_and_content(dag: nx.DiGraph, assignment: Mapping[Node, int], k: int) -> None:
    filled = [False] * k
    for node in dag.nodes:
        if is_input(dag, node):
            if assignment[node] != 0:
                raise InvalidArgumentError(
                    f"inputs: input node {node!r} is in stage {assignment[node]}, not stage 0"
                )
        else:
            filled[assignment[node]] = True
    if not all(filled):
        j = filled.index(False)
        raise InvalidArgumentError(f"non-empty: stage {j} has no non-input node")


def _check_ordered(dag: nx.DiGraph, assignment: Mapping[Node, int]) -> None:
    for u, v in dag.edges:
        if assignment[u] > assignment[v]:
            raise InvalidArgumentError(
                f"ordered: backward edge {u!r} -> {v!r} from stage {assignment[u]} "
                f"to stage {assignment[v]}"
            )


def check_partition(dag: nx.DiGraph, assignment: Any, k: int) -> None:
    """Raise ``InvalidArgumentError`` unless ``assignment`` is a valid k-stage partition of ``dag``.

    Valid means: covering (every node, and only nodes, assigned to a stage in 0..k-1), every
    stage holds a non-input node, inputs sit in stage 0, and no edge runs to an earlier stage.
    The message starts with the name of the broken rule.
    """
    k = check_num_stages(dag, k)
    if not isinstance(assignment, Mapping):
        raise InvalidArgumentTypeError(
            f"a partition must be a mapping node -> stage, got {type(assignment).__name__}"
        )
    _check_stage_values(dag, assignment, k)
    _check_inputs_and_content(dag, assignment, k)
    _check_ordered(dag, assignment)


def check_order(dag: nx.DiGraph, order: Any) -> None:
    """Raise ``InvalidArgumentError`` unless ``order`` lists every node once, topologically."""
    index = {v: i for i, v in enumerate(order)}
    if len(index) != len(order) or len(index) != dag.number_of_nodes():
        raise InvalidArgumentError(
            f"an order must list each of the {dag.number_of_nodes()} nodes exactly once; "
            f"got {len(order)} entries, {len(index)} distinct"
        )
    for v in dag.nodes:
        if v not in index:
            raise InvalidArgumentError(f"the order does not list node {v!r}")
    for u, v in dag.edges:
        if index[u] > index[v]:
            raise InvalidArgumentError(f"the order puts {v!r} before its input {u!r}")
