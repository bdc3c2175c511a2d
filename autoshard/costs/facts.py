"""What ``shape-prop`` learnt about each node, kept on the node (``fx.Node.meta``).

Its own module, with no torch machinery behind it, because the graph analyses that read the
facts (``autoshard.graph``) are themselves imported by the code that runs graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autoshard.costs.memory import SavedFacts
from autoshard.costs.values import ValueMeta


FACTS_KEY = "autoshard_facts"
"""``fx.Node.meta`` key under which ``shape-prop`` stores a node's ``NodeFacts``."""


@dataclass(frozen=True)
class NodeFacts:
    """What one run on the example inputs showed about a node."""

    value: ValueMeta
    flops: int
    allocated: int
    draws_random: bool = False  # it advanced a random generator (dropout, even inside a leaf)
    aliases_input: bool = False  # its value shares memory with its first input (nn.Identity, a view)
    training: SavedFacts | None = None  # what autograd keeps of it (None: fake tensors could not run the graph)


def node_facts(node: fx.Node) -> NodeFacts | None:
    """The facts ``shape-prop`` recorded on ``node``, or None if it has not run."""
    return node.meta.get(FACTS_KEY)
