"""In-place operations: the order they impose beyond data flow.

``h.add_(1)`` changes ``h`` for every reader that runs after it, and must not change it for the
readers that ran before. A graph's edges say only who reads whose value, so a splitter free to
reorder nodes could move a reader across the write (a silently different value, or a stage
that no longer matches the model). ``order_around_mutations`` adds the missing edges to the DAG:
from every earlier reader of the written tensor (or of a view of it) to the write, and from the
write to every later reader, so each reader sees the version it saw in the model.

Which values share memory, and which nodes write, comes from op-name lists (views, in-place
methods) and from what ``shape-prop`` saw: a node whose value shares memory with its first input
(``nn.Identity`` and dropout in eval mode return the input itself; timm's ResNet writes in place
after one; seen where it ran for real), and one that moved the version counter of any of its
inputs (a module kept whole that writes to its input, first or not).
"""

from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx

from autoshard.costs.facts import node_facts
from autoshard.fx_helpers import writes_in_place

#: Methods and functions whose result may share memory with their first argument.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "squeeze", "unsqueeze", "expand",
    "expand_as", "narrow", "select", "t", "flatten", "unflatten", "chunk", "split", "unbind", "diagonal",
    "as_strided", "detach", "movedim", "swapaxes", "unfold", "contiguous", "to", "type_as", "float",
    "__getitem__", "real", "imag",
})
_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
    torch.flatten, torch.narrow, torch.select, torch.chunk, torch.split, torch.unbind, torch.t,
    torch.movedim, torch.detach, torch.diagonal,
})


def _is_view(node: fx.Node) -> bool:
    facts = node_facts(node)
    if facts is not None and facts.aliases_input:  # shape-prop saw it (nn.Identity, eval-mode dropout)
        return True
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS or getattr(node.target, "is_view", False)
    return False


def _first_input(node: fx.Node) -> fx.Node | None:
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def _writes_first_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    facts, first = node_facts(node), _first_input(node)
    if facts is not None and first is not None and first.name in facts.written_inputs:  # shape-prop saw it
        return True
    return writes_in_place(gm, node)


def memory_root(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The tensor whose memory ``node``'s value may be: through views and in-place writes (which
    return the tensor they wrote), back to the first node that made new memory."""
    while (_is_view(node) or _writes_first_input(gm, node)) and _first_input(node) is not None:
        node = _first_input(node)  # type: ignore[assignment]
    return node


def written_inputs(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The graph values ``node`` writes in place: the first input of an in-place op (by its name, or
    as shape-prop saw it), and any other input shape-prop saw it write (a module kept whole)."""
    facts = node_facts(node)
    seen = facts.written_inputs if facts is not None else ()
    first = _first_input(node) if _writes_first_input(gm, node) else None
    return [n for n in node.all_input_nodes if n is first or n.name in seen]


def written_values(gm: fx.GraphModule) -> set[str]:
    """Names of the values some in-place operation writes to: each written tensor and its aliases."""
    written_roots = {memory_root(gm, w) for n in gm.graph.nodes for w in written_inputs(gm, n)}
    return {n.name for n in gm.graph.nodes if memory_root(gm, n) in written_roots}


def order_around_mutations(gm: fx.GraphModule, dag: nx.DiGraph) -> None:
    """Add to ``dag`` the edges that keep every reader of a written tensor on its side of the write."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    family: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        family.setdefault(memory_root(gm, node), []).append(node)
    for write in nodes:
        if write.name not in dag:
            continue
        members = {m for written in written_inputs(gm, write) for m in family[memory_root(gm, written)]}
        readers = {r for member in members for r in member.users
                   if r is not write and not _is_view(r) and r.name in dag}
        for reader in readers:
            if position[reader] < position[write]:
                dag.add_edge(reader.name, write.name, value=reader.name)
            else:
                dag.add_edge(write.name, reader.name, value=write.name)
