"""Build the weighted DAG the splitter works on from a traced ``torch.fx`` graph.

This is the one module under ``autoshard.graph`` that imports torch; ``autoshard.graph`` itself
does not import it, so the splitter stays usable with networkx alone.

The DAG holds the model inputs (``input=True``) and every compute node. ``get_attr`` nodes are
not DAG nodes: a stage that reads a parameter or buffer gets its own reference to the same
object, so attributes never cross a boundary. Their size is charged to their first reader. The
output node is not a DAG node either: the values it returns are flagged ``output=True``.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

COMPUTE_OPS = ("call_module", "call_function", "call_method")

#: Stand-in for a value's size until shape propagation measures it: every value weighs one.
UNKNOWN_VALUE_BYTES = 1.0


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', repr(target))}".lstrip(".")


def owning_module(node: fx.Node) -> str:
    """The qualified name of the module whose forward created ``node`` ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, nn.Module):
        return [*value.parameters(), *value.buffers()]
    return []


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _weights_read(gm: fx.GraphModule, node: fx.Node, claimed: set[int]) -> tuple[int, int]:
    """Parameter/buffer (count, bytes) that ``node`` is charged for; each tensor is charged once."""
    sources: list[Any] = []
    if node.op == "call_module":
        sources.append(_attribute(gm, str(node.target)))
    sources += [_attribute(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
    count = nbytes = 0
    for tensor in (t for source in sources for t in _tensors_of(source)):
        if id(tensor) in claimed:
            continue
        claimed.add(id(tensor))
        count += tensor.numel()
        nbytes += tensor.numel() * tensor.element_size()
    return count, nbytes


def build_dag(gm: fx.GraphModule) -> nx.DiGraph:
    """One DAG node per input and compute node, in program order; edges carry the value's name."""
    dag = nx.DiGraph()
    claimed: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dag.add_node(node.name, op=node.op, target=str(node.target), module="", params=0,
                         param_bytes=0, bytes=UNKNOWN_VALUE_BYTES, input=True, output=False)
        elif node.op in COMPUTE_OPS:
            count, nbytes = _weights_read(gm, node, claimed)
            dag.add_node(node.name, op=node.op, target=_target_name(node), module=owning_module(node),
                         params=count, param_bytes=nbytes, bytes=UNKNOWN_VALUE_BYTES, input=False, output=False)
        elif node.op == "output":
            for producer in node.all_input_nodes:
                if producer.name in dag:
                    dag.nodes[producer.name]["output"] = True
            continue
        for producer in node.all_input_nodes:
            if producer.name in dag:
                dag.add_edge(producer.name, node.name, value=producer.name)
    return dag
