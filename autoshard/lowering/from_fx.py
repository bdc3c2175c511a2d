"""Build the weighted DAG the splitter works on from a traced ``torch.fx`` graph.

It lives in ``autoshard.lowering`` (with the in-place and randomness analyses it adds edges
from), not in ``autoshard.graph``, which imports no torch, so the splitter stays usable with
networkx alone.

The DAG holds the model inputs (``input=True``) and every compute node. Node attributes:
``op``, ``target``, ``module`` (innermost owning module path, '' for the root), ``scopes``
(``(path, class name)`` of every enclosing module, outermost first), ``weights`` (canonical
names of the parameters and buffers the node reads; tied weights share one name), ``params``
and ``param_bytes`` (what the node is charged for), ``input`` and ``output``, and what
``shape-prop`` and ``profile`` measured (None until they run): ``value_meta`` (the output's
structure, see ``autoshard.costs.values``), ``allocated`` (bytes of new memory its output holds:
0 for a view), ``flops`` and ``seconds`` (with ``timed_backward``: whether they include the
backward). ``bytes`` is the tensor
bytes of the output (1 per value while shapes are unknown); ``tensor`` says whether it holds any
tensor (None when neither shape-prop nor the capture recorded the value: it is treated as one).
Edges carry ``value``, the producer's name; in-place writes add edges that keep every reader of
the written tensor on its side of the write (``autoshard.lowering.inplace``), and random draws on
parallel branches add edges that keep them in the model's order (``autoshard.lowering.randomness``).
The graph attribute ``weights`` maps each canonical
name to a ``WeightInfo`` (every alias, size, trainable or not).

``get_attr`` nodes are not DAG nodes: a stage that reads a parameter or buffer gets its own
reference to the same object, so attributes never cross a boundary. Their size is charged to
their first reader. A read of a weight's shape alone (``w.shape[0]``, ``w.size(1)``) reads no
weight: emit makes it a constant in a stage that does not hold the weight (``fold_shape_reads``).
The output node is not a DAG node either: the values it returns are flagged ``output=True``.

A value known to hold no tensor (``x.size(0)``, a bool) never crosses a boundary: emit recomputes it in
each stage that reads it, and so it does a mask computed from the model's inputs alone, or a rotary table
from them and a buffer (``lowering.remade``). So in the DAG its readers depend directly on the tensors
(or model inputs) it is computed from, and it has no edges of its own; ``readers`` names the nodes that
read it, with the first of which a partition places it (see ``route_around``; each stage that makes it
pays for it: ``graph.partition.also_run``). A read of a tensor's shape alone is computed from a zero-byte
carrier of it (``shape_carriers``), ``made_from`` that tensor: it crosses only past the stages holding
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Mapping

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from autoshard.costs.execution import COMPUTE_OPS
from autoshard.costs.facts import node_facts, node_seconds, node_timed_backward
from autoshard.costs.values import ConstantMeta, TensorMeta
from autoshard.fx_helpers import canonical_tensor_names, resolve, shape_read, target_name
from autoshard.lowering.inplace import order_around_mutations
from autoshard.lowering.randomness import order_random_draws
from autoshard.lowering.remade import remakeable
from autoshard.lowering.shape_carriers import made_anywhere, shape_carrier

#: Stand-in for a value's size until shape propagation measures it: every value weighs one.
UNKNOWN_VALUE_BYTES = 1.0


def module_scopes(gm: fx.GraphModule, node: fx.Node) -> tuple[tuple[str, str], ...]:
    """``(path, class name)`` of every module ``node`` runs inside, outermost first.

    A ``call_module`` node runs inside its own module too, so ``no_split`` rules by path or class
    see leaves and traced-through modules alike.
    """
    stack = node.meta.get("nn_module_stack") or {}
    scopes = [(str(path), _class_name(kind)) for path, kind in stack.values()]
    if node.op == "call_module" and (not scopes or scopes[-1][0] != node.target):
        scopes.append((str(node.target), type(resolve(gm, str(node.target))).__name__))
    return tuple(scopes)


def _class_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, nn.Module):
        return [*value.parameters(), *value.buffers()]
    return []


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


@dataclass(frozen=True)
class WeightInfo:
    """One parameter or buffer object, under every name it has (tied weights have several)."""

    names: tuple[str, ...]
    numel: int
    nbytes: int
    kind: str  # "parameter" or "buffer"
    trainable: bool
    device: str = "cpu"  # the device type it was on when planned: how torch.optim steps it by default
    # where it views a storage not its own alone (a slice of a larger table, parameters viewing one flat
    # buffer): that storage's name (its first weight's) and bytes, which a stage holding any view holds
    storage: str | None = None
    storage_bytes: int = 0


def weight_infos(gm: fx.GraphModule, model: nn.Module | None = None) -> dict[str, WeightInfo]:
    """Canonical name -> ``WeightInfo`` for every parameter and buffer object of ``gm``.

    The names are ``gm``'s, then any more that ``model`` (the traced model) gives the same object:
    T5 ties its embeddings to ``shared``, which its forward never calls, and Hugging Face saves the
    tied weight under that name only.
    """
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in _named_tensors(gm):
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    for name, tensor in _named_tensors(model) if model is not None else ():
        if id(tensor) in aliases and name not in aliases[id(tensor)]:
            aliases[id(tensor)].append(name)
    storages = _shared_storages({names[0]: tensors[key] for key, names in aliases.items()})
    return {
        names[0]: WeightInfo(
            tuple(names), tensors[key].numel(), tensors[key].numel() * tensors[key].element_size(),
            "parameter" if isinstance(tensors[key], nn.Parameter) else "buffer",
            isinstance(tensors[key], nn.Parameter) and tensors[key].requires_grad, tensors[key].device.type,
            *storages.get(names[0], (None, 0)))
        for key, names in aliases.items()
    }


def _shared_storages(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, int]]:
    """Weight name -> (storage name, storage bytes) for the weights whose storage is not theirs alone:
    larger or smaller than their own bytes, or viewed by another weight too. A storage is named
    after its first weight."""
    groups: dict[StorageWeakRef, list[str]] = {}
    for name, tensor in tensors.items():
        try:
            groups.setdefault(StorageWeakRef(tensor.untyped_storage()), []).append(name)
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: its own bytes
            continue
    shared = {}
    for names in groups.values():
        nbytes = tensors[names[0]].untyped_storage().nbytes()
        own = tensors[names[0]].numel() * tensors[names[0]].element_size()
        if len(names) > 1 or nbytes != own:
            shared.update((name, (names[0], nbytes)) for name in names)
    return shared


def _tensors_read(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    sources: list[Any] = []
    if node.op == "call_module":
        sources.append(resolve(gm, str(node.target)))
    if not shape_read(node):  # a weight's shape alone: no reason to hold the weight
        sources += [resolve(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
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


def _measured(node: fx.Node) -> dict[str, Any]:
    """The attributes that come from ``shape-prop`` and ``profile`` (unknown: None, one byte)."""
    facts = node_facts(node)
    return {
        "value_meta": facts.value if facts else None,
        "bytes": facts.value.nbytes if facts else UNKNOWN_VALUE_BYTES,
        "tensor": holds_tensor(node),
        "flops": facts.flops if facts else None,
        "allocated": facts.allocated if facts else None,
        "training": facts.training if facts else None,
        "seconds": node_seconds(node),
        "timed_backward": node_timed_backward(node),
    }


def _made_from(node: fx.Node) -> dict[str, str]:
    """``made_from``: the tensor of a carrier any stage holding that tensor makes (``shape_carriers``)."""
    return {"made_from": node.args[0].name} if node.target is shape_carrier and made_anywhere(node) else {}


def holds_tensor(node: fx.Node) -> bool | None:
    """Whether ``node``'s value holds a tensor: from shape-prop, else from what the capture
    recorded (torch.export's ``val``); None when neither knows (fx alone), treated as a tensor."""
    facts = node_facts(node)
    if facts is not None:
        return facts.value.has_tensor
    if "val" not in node.meta:
        return None
    return any(isinstance(v, torch.Tensor) for v in tree_leaves(node.meta["val"]))


def route_around(dag: nx.DiGraph, remakeable: AbstractSet[str] = frozenset()) -> None:
    """Make the readers of each value their stages compute again depend on what it is computed from.

    Such a value is one known to hold no tensor, or a tensor of ``remakeable`` (``remade.remakeable``)
    computed from the model's inputs and buffers alone (``_reads_constants``), of more bytes than what
    it is computed from and at no FLOPs (no product: a mask, positions; a model output excepted). Walking
    in program order, each such node's in-edges already come from tensors or inputs (its ancestors made
    again were routed first); its out-edges move onto those sources, which then cross to the readers'
    stages, where emit recomputes the value. One that is read keeps no in-edges either: the stage a split
    gives it runs nothing of it, and a partition places it with the first of its ``readers``, the nodes it
    had edges to (``Partition.from_assignment``). A non-tensor model output makes its sources outputs
    instead. A carrier of a tensor made again is made with it. A tensor that may carry a model input's
    gradient (``_graded``) is sent: made again, its gradient would be added up in another order.
    """
    from_inputs: set[str] = set()  # computed from the model's inputs, sizes, buffers and constants alone
    graded = _graded(dag)
    for node in list(dag.nodes):
        data = dag.nodes[node]
        sources = list(dag.predecessors(node))
        carried = data.get("made_from")
        if data["input"] or carried is not None or (
                _reads_constants(dag, node, remakeable) and all(source in from_inputs for source in sources)):
            from_inputs.add(node)
        if carried is not None and dag.nodes[carried].get("readers"):  # a size of a tensor made again: made with it
            data["made_from"] = None
        elif data["input"] or (data["tensor"] is not False
                               and (node in graded or not _remade(dag, node, sources, remakeable, from_inputs))):
            continue
        data["readers"] = tuple(dag.successors(node))
        for reader in data["readers"]:
            dag.remove_edge(node, reader)
            dag.add_edges_from((source, reader, {"value": source}) for source in sources)
        if data["readers"]:  # the stage a split gives it runs nothing of it: nothing need cross to it there
            dag.remove_edges_from([(source, node) for source in sources])
        if data["output"]:
            data["output"] = False
            for source in sources:
                dag.nodes[source]["output"] = True


def _graded(dag: nx.DiGraph) -> set[str]:
    """The values that may carry a model input's gradient: floating values computed from a floating input (not
    through a shape carrier, a size or a comparison), on the edges before ``route_around`` moves any."""
    graded: set[str] = set()
    for node, data in dag.nodes(data=True):
        meta = data.get("value_meta")
        dtype = getattr(torch, meta.dtype) if isinstance(meta, TensorMeta) else None
        floating = dtype.is_floating_point or dtype.is_complex if dtype is not None else (
            not isinstance(meta, ConstantMeta))
        if floating and data.get("made_from") is None and (
                data["input"] or any(source in graded for source in dag.predecessors(node))):
            graded.add(node)
    return graded


def _reads_constants(dag: nx.DiGraph, node: str, remakeable: AbstractSet[str]) -> bool:
    """Whether ``node`` reads no weight, or only buffers through a torch operation whose memory and inputs nothing
    writes (``remakeable``: it sees the aliases a module kept whole would hide): a rotary embedding's inverse
    frequencies. What it computes carries no gradient and stays the same within a call; it is sent (a stage
    making it again would need the buffer) and what reads it may be made again from it."""
    infos = dag.graph["weights"]
    return not dag.nodes[node]["weights"] or (
        node in remakeable and all(infos[name].kind == "buffer" for name in dag.nodes[node]["weights"]))


def _remade(dag: nx.DiGraph, node: str, sources: list[str], remakeable: AbstractSet[str],
            from_inputs: AbstractSet[str]) -> bool:
    """Whether a tensor ``node`` is made again in each stage reading it rather than sent (``route_around``)."""
    data = dag.nodes[node]
    return (node in remakeable and node in from_inputs and not data["weights"] and data["tensor"]
            and not data["output"] and data["flops"] == 0
            and float(data["bytes"]) > sum(float(dag.nodes[source]["bytes"]) for source in sources))


def build_dag(gm: fx.GraphModule, model: nn.Module | None = None) -> nx.DiGraph:
    """One DAG node per input and compute node, in program order; edges carry the value's name.
    ``model``, the model ``gm`` was traced from, adds the names it alone gives a weight."""
    dag = nx.DiGraph(weights=weight_infos(gm, model))
    claimed: set[int] = set()
    names = canonical_tensor_names(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dag.add_node(node.name, op=node.op, target=str(node.target), module="", scopes=(), weights=(),
                         params=0, param_bytes=0, input=True, output=False, **_measured(node))
        elif node.op in COMPUTE_OPS:
            tensors = _tensors_read(gm, node)
            count, nbytes = _charge(tensors, claimed)
            scopes = module_scopes(gm, node)
            dag.add_node(node.name, op=node.op, target=target_name(node), module=scopes[-1][0] if scopes else "",
                         scopes=scopes, weights=tuple(names[id(t)] for t in tensors),
                         params=count, param_bytes=nbytes, input=False, output=False, **_measured(node),
                         **_made_from(node))
        elif node.op == "output":
            for producer in node.all_input_nodes:
                if producer.name in dag:
                    dag.nodes[producer.name]["output"] = True
            continue
        for producer in node.all_input_nodes:
            if producer.name in dag:
                dag.add_edge(producer.name, node.name, value=producer.name)
    order_around_mutations(gm, dag)
    route_around(dag, remakeable(gm))
    order_random_draws(gm, dag)
    if model is not None:
        leaves = {str(node.target) for node in gm.graph.nodes if node.op == "call_module"}
        dag.graph["module_stand_ins"] = module_stand_ins(dag, model, leaves)
        dag.graph["root_class"] = type(model).__name__  # lets no-split name the whole model by its class
    return dag


def module_stand_ins(dag: nx.DiGraph, model: nn.Module, leaves: set[str]) -> dict[str, tuple[str, str]]:
    """Module paths of ``model`` that no node runs under, by the path that stands in for them:
    ``(path, "alias")`` for another name of a module that runs (T5's ``shared`` runs as
    ``encoder.embed_tokens``; a ModuleList's other name), ``(leaf, "inside")`` for a module inside
    one of ``leaves``, the modules kept whole, and ``("", "unused")`` for a module the forward never
    runs. A container whose children run (a ModuleList is iterated, not called) needs none. Lets
    split constraints name any module the user sees in the model, or say why they cannot."""
    scoped = {path for _, scopes in dag.nodes(data="scopes", default=()) for path, _ in scopes}
    running = {".".join(path.split(".")[:i]) for path in scoped for i in range(1, path.count(".") + 2)}
    named = list(model.named_modules(remove_duplicate=False))
    first_name: dict[int, str] = {}
    for path, module in named:
        if path in running:
            first_name.setdefault(id(module), path)
    stand_ins: dict[str, tuple[str, str]] = {}
    for path, module in named:
        if not path or path in running:
            continue
        if id(module) in first_name:
            stand_ins[path] = (first_name[id(module)], "alias")
            continue
        parts = path.split(".")
        holder = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in running), None)
        stand_ins[path] = (holder, "inside") if holder in leaves else ("", "unused")
    return stand_ins
