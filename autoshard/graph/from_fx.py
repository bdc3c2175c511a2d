"""Build the weighted DAG the splitter works on from a traced ``torch.fx`` graph.

This is the one module under ``autoshard.graph`` that imports torch; ``autoshard.graph`` itself
does not import it, so the splitter stays usable with networkx alone.

The DAG holds the model inputs (``input=True``) and every compute node. Node attributes:
``op``, ``target``, ``module`` (innermost owning module path, '' for the root), ``scopes``
(``(path, class name)`` of every enclosing module, outermost first), ``weights`` (canonical
names of the parameters and buffers the node reads; tied weights share one name), ``params``
and ``param_bytes`` (what the node is charged for), ``bytes`` (its output's size), ``input``
and ``output``. Edges carry ``value``, the producer's name. ``get_attr`` nodes are
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


def module_scopes(gm: fx.GraphModule, node: fx.Node) -> tuple[tuple[str, str], ...]:
    """``(path, class name)`` of every module ``node`` runs inside, outermost first.

    A ``call_module`` node runs inside its own module too, so ``no_split`` rules by path or class
    see leaves and traced-through modules alike.
    """
    stack = node.meta.get("nn_module_stack") or {}
    scopes = [(str(path), _class_name(kind)) for path, kind in stack.values()]
    if node.op == "call_module" and (not scopes or scopes[-1][0] != node.target):
        scopes.append((str(node.target), type(_attribute(gm, str(node.target))).__name__))
    return tuple(scopes)


def _class_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]


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


def canonical_tensor_names(gm: fx.GraphModule) -> dict[int, str]:
    """One name per parameter/buffer object: its first qualified name (tied weights share it)."""
    names: dict[int, str] = {}
    for name, tensor in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def _tensors_read(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    sources: list[Any] = []
    if node.op == "call_module":
        sources.append(_attribute(gm, str(node.target)))
    sources += [_attribute(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
    unique = {id(t): t for source in sources for t in _tensors_of(source)}
    return list(unique.values())


def _charge(tensors: list[torch.Tensor], claimed: set[int]) -> tuple[int, int]:
    """Parameter/buffer (count, bytes) not yet charged to an earlier node; each tensor is charged once."""
    count = nbytes = 0
    for tensor in tensors:
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
    names = canonical_tensor_names(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dag.add_node(node.name, op=node.op, target=str(node.target), module="", scopes=(), weights=(),
                         params=0, param_bytes=0, bytes=UNKNOWN_VALUE_BYTES, input=True, output=False)
        elif node.op in COMPUTE_OPS:
            tensors = _tensors_read(gm, node)
            count, nbytes = _charge(tensors, claimed)
            scopes = module_scopes(gm, node)
            dag.add_node(node.name, op=node.op, target=_target_name(node), module=scopes[-1][0] if scopes else "",
                         scopes=scopes, weights=tuple(names[id(t)] for t in tensors),
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
