"""What the measuring passes learnt about each node, and the one place that reads and writes it.

``shape-prop`` records a ``NodeFacts`` per node and ``profile`` a time in seconds, with whether it
timed the node's backward too (the profile's own setting: one loaded from a file says it as a
fresh one does). Both ride on the traced graph's nodes (``fx.Node.meta``) because every function
that reads them (``build_dag``, the in-place and randomness orderings, ``verify``) is handed the
graph module alone; the string keys stay in this module, and the rest of the code goes through
``node_facts``, ``node_seconds``, ``node_timed_backward`` and the ``record_*`` writers. The passes
also keep each record as an artifact of the program (``facts``, ``times``), so a pipeline says
who makes them and who needs them.

Its own module, with no torch machinery behind it, because the graph analyses that read the
facts (``autoshard.lowering``) are themselves imported by the code that runs graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch.fx as fx

from autoshard.costs.memory import SavedFacts
from autoshard.costs.values import ValueMeta

_FACTS_KEY = "autoshard_facts"
_SECONDS_KEY = "autoshard_seconds"
_BACKWARD_KEY = "autoshard_seconds_with_backward"


@dataclass(frozen=True)
class NodeFacts:
    """What one run on the example inputs showed about a node."""

    value: ValueMeta
    flops: int
    allocated: int
    draws_random: bool = False  # it advanced a random generator (dropout, even inside a leaf)
    aliases_input: bool = False  # its value shares memory with its first input (nn.Identity, a view)
    written_inputs: tuple[str, ...] = ()  # the arguments it wrote in place, graph values by name (seen: any of them)
    writes_own_buffers: bool = False  # a module kept whole that wrote a buffer of its own in place (a step counter)
    training: SavedFacts | None = None  # what autograd keeps of it (None: fake tensors could not run the graph)


def node_facts(node: fx.Node) -> NodeFacts | None:
    """The facts ``shape-prop`` recorded on ``node``, or None if it has not run."""
    return node.meta.get(_FACTS_KEY)


def node_seconds(node: fx.Node) -> float | None:
    """The seconds ``profile`` measured for ``node``, or None if it has not run (or ``node`` is no compute node)."""
    return node.meta.get(_SECONDS_KEY)


def node_timed_backward(node: fx.Node) -> bool:
    """Whether ``node``'s seconds are its forward and backward together (``profile{backward=true}``)."""
    return bool(node.meta.get(_BACKWARD_KEY, False))


def record_facts(graph: fx.Graph, facts: Mapping[str, NodeFacts]) -> None:
    """Put ``facts[node.name]`` on each node of ``graph`` it names; call it on a copy, never on an artifact."""
    _record(graph, _FACTS_KEY, facts)


def record_seconds(graph: fx.Graph, seconds: Mapping[str, float], backward: bool = False) -> None:
    """Put ``seconds[node.name]`` on each node of ``graph`` it names, and whether they include the
    node's ``backward``; call it on a copy, never on an artifact."""
    _record(graph, _SECONDS_KEY, seconds)
    _record(graph, _BACKWARD_KEY, dict.fromkeys(seconds, backward))


def _record(graph: fx.Graph, key: str, values: Mapping[str, object]) -> None:
    for node in graph.nodes:
        if node.name in values:
            node.meta[key] = values[node.name]
