"""Shape propagation: run the traced graph once and record, per node, its value's structure,
the memory it allocated, the FLOPs it performed, whether it drew random numbers, whether its
value shares memory with its first input and which of its inputs it wrote to; then probe what
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
from autoshard.generators import generator_states

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    from autoshard.inputs import ExampleInputs


def _aliases_first_input(call: NodeCall, value: Any) -> bool:
    """Whether ``value`` shares memory with the node's first argument, when that is a graph value:
    an in-place write to either then changes both (``nn.Identity`` returns its input)."""
    first = call.node.args[0] if call.node.args else None
    return isinstance(first, fx.Node) and shares_memory(value, call.args[0])


def _input_versions(call: NodeCall) -> dict[str, int]:
    """The version counters of the node's arguments that are graph values, by name, those in the lists,
    tuples and dicts it is given included: running the node moves one when it writes there in place,
    whatever the op's name says (a module kept whole that writes to its input, first or not, or to a
    tensor of a list it is given)."""
    versions: dict[str, int] = {}

    def note(arg: Any, value: Any) -> None:
        if isinstance(arg, fx.Node):
            if isinstance(value, torch.Tensor) and not value.is_inference():
                versions[arg.name] = value._version
        elif isinstance(arg, (list, tuple)) and isinstance(value, (list, tuple)) and len(arg) == len(value):
            for a, v in zip(arg, value):
                note(a, v)
        elif isinstance(arg, dict) and isinstance(value, dict):
            for key, a in arg.items():
                if key in value:
                    note(a, value[key])

    note(call.node.args, call.args)
    note(call.node.kwargs, call.kwargs)
    return versions


def _own_buffer_versions(call: NodeCall) -> list[int]:
    """The version counters of the buffers of the module a ``call_module`` node calls (none for other nodes):
    one moves when the module writes its own buffer in place (``self.steps += 1``), which its arguments'
    counters do not show."""
    if call.node.op != "call_module":
        return []
    module = call.interpreter.module.get_submodule(str(call.node.target))
    return [b._version for b in module.buffers() if not b.is_inference()]


def _written(before: dict[str, int], after: dict[str, int]) -> tuple[str, ...]:
    """The arguments whose version counter moved between ``before`` and ``after``."""
    return tuple(name for name, version in before.items() if after.get(name) != version)


def propagate(gm: fx.GraphModule, inputs: "ExampleInputs", mode: Mode = "auto", seed: int = 0) -> dict[str, NodeFacts]:
    """Run ``gm`` on ``inputs`` and return the facts of every placeholder and compute node."""
    facts: dict[str, NodeFacts] = {}
    real = resolve_mode(gm, inputs, mode) == "real"  # fake tensors draw nothing
    measured = sum(node.op not in ("get_attr", "output") for node in gm.graph.nodes)
    probe, flops = TrainingProbe(gm), NodeFlopCounter()
    states: list[bytes] | None = None  # the generators' as the node about to run finds them (real runs)
    with progress.task("shape propagation", total=measured) as advance:
        def hook(call: NodeCall) -> Any:
            nonlocal states
            if real and states is None:
                states = generator_states()
            versions, own = _input_versions(call), _own_buffer_versions(call)
            value = flops.measure(call)
            writes = _written(versions, _input_versions(call))
            own_written = own != _own_buffer_versions(call)
            probe.measure(call, value, flops.ops_per_node[call.node.name])
            node = call.node
            if node.op not in ("get_attr", "output"):
                allocated = allocated_bytes(value, (call.args, call.kwargs))
                before, states = states, generator_states() if real else None
                draws = real and before != states  # (what one node leaves, the next finds: read once)
                aliases = node.op != "placeholder" and _aliases_first_input(call, value)
                facts[node.name] = NodeFacts(describe_value(value), flops.per_node[node.name], allocated,
                                             draws, aliases, writes, own_written)
                advance()
            return value

        run_graph(gm, inputs, mode, hook, seed)
    training = probe.facts()
    return {name: dataclasses.replace(f, training=training.get(name)) for name, f in facts.items()}
