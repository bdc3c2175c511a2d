"""Shape propagation: run the traced graph once and record, per node, its value's structure,
the memory it allocated and the FLOPs it performed. The ``shape-prop`` pass stores the result on
the graph's nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from autoshard import progress
from autoshard.costs.execution import Mode, NodeCall, run_graph
from autoshard.costs.flops import NodeFlopCounter
from autoshard.costs.values import ValueMeta, allocated_bytes, describe_value

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    from autoshard.passes.base import ExampleInputs

FACTS_KEY = "autoshard_facts"
"""``fx.Node.meta`` key under which ``shape-prop`` stores a node's ``NodeFacts``."""


@dataclass(frozen=True)
class NodeFacts:
    """What one run on the example inputs showed about a node."""

    value: ValueMeta
    flops: int
    allocated: int


def node_facts(node: fx.Node) -> NodeFacts | None:
    """The facts ``shape-prop`` recorded on ``node``, or None if it has not run."""
    return node.meta.get(FACTS_KEY)


def propagate(gm: fx.GraphModule, inputs: "ExampleInputs", mode: Mode = "auto", seed: int = 0) -> dict[str, NodeFacts]:
    """Run ``gm`` on ``inputs`` and return the facts of every placeholder and compute node."""
    facts: dict[str, NodeFacts] = {}
    measured = sum(node.op not in ("get_attr", "output") for node in gm.graph.nodes)
    with NodeFlopCounter() as flops, progress.task("shape propagation", total=measured) as advance:
        def hook(call: NodeCall) -> Any:
            value = flops.measure(call)
            node = call.node
            if node.op not in ("get_attr", "output"):
                allocated = allocated_bytes(value, (call.args, call.kwargs))
                facts[node.name] = NodeFacts(describe_value(value), flops.per_node[node.name], allocated)
                advance()
            return value

        run_graph(gm, inputs, mode, hook, seed)
    return facts
