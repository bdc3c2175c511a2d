"""What crosses each stage boundary on the wire: tensors, never tuples of them.

``torch.distributed.pipelining`` sends a flat tuple of tensors. A boundary value that is a tuple
(a module returning several tensors, ``torch.split``, the capture's input guard) cannot be sent
as such; but when every later stage only takes items out of it (``value[i]``), those items can
be: the sending stage takes them out, and the receiving stage gets one input per item where it
had the tuple. Any other value crosses as itself (``boundaries`` checks it is a tensor).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from autoshard.sharded import ShardedModel


@dataclass(frozen=True)
class Wire:
    """One tensor sent across a boundary: the value ``name`` itself, or its item ``index``."""

    name: str
    index: int | None = None

    def __str__(self) -> str:
        return self.name if self.index is None else f"{self.name}[{self.index}]"


def node_named(graph: fx.Graph, name: str) -> fx.Node | None:
    return next((node for node in graph.nodes if node.name == name and node.op != "output"), None)


def _is_item_read(user: fx.Node, value: fx.Node) -> bool:
    return (user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2
            and user.args[0] is value and isinstance(user.args[1], int) and not user.kwargs)


def items_read_after(sharded: ShardedModel, name: str, boundary: int) -> list[int] | None:
    """The item indices the stages after ``boundary`` take out of ``name``, or None if one of them
    uses the value whole. A middle stage that only passes it on is not a use."""
    last = sharded.num_stages - 1
    indices: set[int] = set()
    for index in range(boundary + 1, sharded.num_stages):
        value = node_named(sharded.stages[index].graph, name)
        for user in value.users if value is not None else ():
            if user.op == "output" and index < last:
                continue
            if not _is_item_read(user, value):
                return None
            indices.add(user.args[1])
    return sorted(indices)


def wire_layout(sharded: ShardedModel, is_tensor: dict[str, bool]) -> list[list[Wire]]:
    """Per boundary, the tensors sent in order; ``is_tensor[name]`` says a value is known to be one."""
    layout = []
    for boundary, names in enumerate(sharded.plan.boundaries):
        wires: list[Wire] = []
        for name in names:
            items = None if is_tensor.get(name) else items_read_after(sharded, name, boundary)
            wires += [Wire(name)] if items is None else [Wire(name, i) for i in items]
        layout.append(wires)
    return layout


def _receive_items(graph: fx.Graph, wires: list[Wire]) -> dict[Wire, fx.Node]:
    """Replace each tuple input by one input per item read, in wire order."""
    received: dict[Wire, fx.Node] = {}
    for wire in wires:
        if wire.index is None:
            continue
        whole = node_named(graph, wire.name)
        with graph.inserting_before(whole):
            received[wire] = graph.placeholder(f"{wire.name}_{wire.index}")
        for user in list(whole.users):
            if _is_item_read(user, whole) and user.args[1] == wire.index:
                user.replace_all_uses_with(received[wire])
                graph.erase_node(user)
    return received


def rewire(module: fx.GraphModule, stage: int, layout: list[list[Wire]]) -> None:
    """Make ``stage`` take and return exactly the wires of its boundaries, each contiguous
    (process groups send only contiguous tensors, and a slice such as ``mask[:n, :n]`` is not)."""
    graph = module.graph
    received = _receive_items(graph, layout[stage - 1]) if stage > 0 else {}
    if stage < len(layout):
        output = next(node for node in graph.nodes if node.op == "output")
        with graph.inserting_before(output):
            sent = []
            for wire in layout[stage]:
                value = received.get(wire) or node_named(graph, wire.name)
                if wire.index is not None and wire not in received:
                    value = graph.call_function(operator.getitem, (value, wire.index))
                sent.append(graph.call_method("contiguous", (value,)))
        output.args = (tuple(sent),)
    for wire in layout[stage - 1] if stage > 0 else ():
        whole = node_named(graph, wire.name)
        if wire.index is not None and whole is not None and not whole.users:
            graph.erase_node(whole)
    graph.lint()
    module.recompile()
