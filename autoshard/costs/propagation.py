"""Shape propagation: run the traced graph once and record, per node, its value's structure,
the memory it allocated, the FLOPs it performed, whether it drew random numbers, whether its
value shares memory with its first input and whether it wrote to that input; then probe what
training keeps of each node on fake tensors (``costs.saved``). The ``shape-prop`` pass stores
the result on the graph's nodes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoshard import progress
from autoshard.costs.execution import Mode, NodeCall, resolve_mode, run_graph
from autoshard.costs.facts import NodeFacts
from autoshard.costs.flops import NodeFlopCounter
from autoshard.costs.saved import TrainingProbe
from autoshard.costs.values import allocated_bytes, describe_value, shares_memory
from autoshard.generators import generator_states, same_states

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    from autoshard.inputs import ExampleInputs


def _aliases_first_input(call: NodeCall, value: Any) -> bool:
    """Whether ``value`` shares memory with the node's first argument, when that is a graph value:
    an in-place write to either then changes both (``nn.Identity`` returns its input)."""
    first = call.node.args[0] if call.node.args else None
    return isinstance(first, fx.Node) and shares_memory(value, call.args[0])


def _first_input_version(call: NodeCall) -> int | None:
    """The version counter of the node's first argument, when that is a graph value: running the
    node moves it when it writes there in place, whatever the op's name says (a module kept whole
    that writes to its input)."""
    first = call.node.args[0] if call.node.args else None
    value = call.args[0] if isinstance(first, fx.Node) else None
    return value._version if isinstance(value, torch.Tensor) and not value.is_inference() else None


def propagate(gm: fx.GraphModule, inputs: "ExampleInputs", mode: Mode = "auto", seed: int = 0) -> dict[str, NodeFacts]:
    """Run ``gm`` on ``inputs`` and return the facts of every placeholder and compute node."""
    facts: dict[str, NodeFacts] = {}
    real = resolve_mode(gm, inputs, mode) == "real"  # fake tensors draw nothing
    measured = sum(node.op not in ("get_attr", "output") for node in gm.graph.nodes)
    probe = TrainingProbe(gm)
    with NodeFlopCounter() as flops, progress.task("shape propagation", total=measured) as advance:
        def hook(call: NodeCall) -> Any:
            before = generator_states() if real else []
            version = _first_input_version(call)
            value = flops.measure(call)
            writes = version is not None and _first_input_version(call) != version
            probe.measure(call, value)
            node = call.node
            if node.op not in ("get_attr", "output"):
                allocated = allocated_bytes(value, (call.args, call.kwargs))
                draws = real and not same_states(before, generator_states())
                aliases = node.op != "placeholder" and _aliases_first_input(call, value)
                facts[node.name] = NodeFacts(describe_value(value), flops.per_node[node.name], allocated,
                                             draws, aliases, writes)
                advance()
            return value

        run_graph(gm, inputs, mode, hook, seed)
    training = probe.facts()
    return {name: dataclasses.replace(f, training=training.get(name)) for name, f in facts.items()}
