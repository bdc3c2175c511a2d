"""Turn a partition of the traced graph into k ``GraphModule`` stages that chain.

Stage 0 takes the model's own inputs (same names, same defaults). Every stage but the last
returns a tuple of the values live across its boundary, in program order; the next stage takes
exactly that tuple. A value needed several stages later is carried through the stages between.
The last stage returns exactly what the model returns. Stages are built over the traced root,
so they hold the original Parameter and buffer objects under their original qualified names,
and a buffer that is not persistent in the model is not persistent in its stage either, so a
stage's ``state_dict`` keys are the model's keys restricted to that stage.

Values that are not tensors (``x.size(0)``, a dtype, a bool from a mask check) never cross a
boundary, because pipeline runtimes send only tensors: once ``shape-prop`` (or torch.export's
record of the value) has shown that a node yields no tensor, every stage that needs its value
recomputes it (and its non-tensor inputs) from the tensors it has. The DAG built by
``lowering.from_fx`` routes those tensors to the stage.

A stage that reads only the shape of a parameter or buffer (``self.pos.weight.shape[0]`` in a
mask's computation) reads it as a constant (``fold_shape_reads``): it holds the weights it
computes with, and none it does not, so a branch that reads a weight's shape in another stage
than the one computing with it still keeps every weight in its stage.

The capture freezes what the model asked of its inputs: ``torch.arange(n, device=x.device)``
becomes ``device=cpu``. Each stage reads that device from its own inputs again at run time
(``stage_device``), so a stage moved to another device by hand (``sharded.to("cuda")``, one stage
per GPU) computes where its inputs are, as the model's code did.
"""

from __future__ import annotations

import inspect
import operator
from typing import AbstractSet, Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from autoshard.capture.guard import FixedDtypes, autocast_now, check_autocast, refuse_mode_switch
from autoshard.capture.held_state import HeldState, checked_modules, registry_key
from autoshard.costs.execution import COMPUTE_OPS
from autoshard.errors import OTHER_CAPTURE, CallRefusedError, InvalidArgumentError
from autoshard.fx_helpers import resolve, shape_read
from autoshard.isolation import PLAIN_VALUES
from autoshard.lowering.from_fx import holds_tensor
from autoshard.lowering.shape_carriers import carried_tensor, made_anywhere, shape_carrier


def recomputed_in_consumers(node: fx.Node) -> bool:
    """A compute node known to yield no tensor and read by other nodes: each reader's stage recomputes it.

    A node nobody reads (``torch._assert``) runs in the stage its partition places it in, for its side effect.
    """
    return node.op in COMPUTE_OPS and holds_tensor(node) is False and bool(node.users)


def copy_buffer_persistence(source: nn.Module, target: nn.Module) -> None:
    """Mark each buffer of ``target`` non-persistent when the buffer at the same path in ``source`` is.

    ``fx.GraphModule`` registers every buffer it copies as persistent, which would add keys (a
    rotary ``inv_freq``) to ``state_dict`` that the model does not have. Modules shared with
    ``source`` are left alone: they already are the source's modules.
    """
    for path, module in target.named_modules():
        try:
            original = source.get_submodule(path)
        except AttributeError:
            continue
        if original is module:
            continue
        for name in module._buffers:
            if name in original._non_persistent_buffers_set:
                module._non_persistent_buffers_set.add(name)


def stage_device(default: torch.device, *inputs: Any) -> torch.device:
    """The device of a stage's first tensor input; ``default`` (the captured one) if it has none.
    Read on every call: an input that is a tensor itself (nearly always the first) answers without
    flattening the rest, which a stage receiving a dozen boundary values paid ~10 us for."""
    for value in inputs:
        found = _first_tensor(value)
        if found is not None:
            return found.device
    return default


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor among ``value``'s pytree leaves: a dict, list or tuple walked here up to it (pytree
    flattened the whole of a first argument that is a batch dict on every call, 1.5 us for two tensors and
    more with each entry), other containers by pytree."""
    if isinstance(value, torch.Tensor):
        return value
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        for item in value.values() if kind is dict else value:
            found = _first_tensor(item)
            if found is not None:
                return found
        return None
    if kind in PLAIN_VALUES:
        return None
    return next((leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)), None)


def follow_input_device(graph: fx.Graph) -> None:
    """Replace each ``torch.device`` constant in ``graph`` by a ``stage_device`` read of its inputs."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    body = [node for node in graph.nodes if node.op not in ("placeholder", "output")]
    if not placeholders or not body:
        return
    reads: dict[torch.device, fx.Node] = {}

    def read(value: object) -> object:
        if not isinstance(value, torch.device):
            return value
        if value not in reads:
            with graph.inserting_before(body[0]):
                reads[value] = graph.call_function(stage_device, (value, *placeholders))
        return reads[value]

    for node in body:
        if node.target is not stage_device:  # once per graph: a read already made is kept as it is
            node.args = fx.node.map_aggregate(node.args, read)
            node.kwargs = fx.node.map_aggregate(node.kwargs, read)


def _stage_graph(
    source: fx.Graph,
    stage: int,
    num_stages: int,
    assignment: Mapping[str, int],
    incoming: Sequence[str],
    outgoing: Sequence[str],
    remade: AbstractSet[str] = frozenset(),
) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {node.name: node for node in source.nodes}

    def lookup(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        if (tensor := carried_tensor(node)) in env:  # a tensor the stage holds: read straight
            env[node] = env[tensor]  # type: ignore[index]
        elif node.op == "get_attr" or made_again(node) or made_here(node):
            env[node] = graph.node_copy(node, lookup)  # each stage holds its own reference / copy
        return env[node]

    def made_again(node: fx.Node) -> bool:  # in each stage reading it: a size, a mask (``lowering.remade``)
        return recomputed_in_consumers(node) or node.name in remade

    def made_here(node: fx.Node) -> bool:  # a carrier to send on, of a tensor the stage holds
        return node.target is shape_carrier and made_anywhere(node) and node.args[0] in env

    if stage == 0:
        for node in source.nodes:
            if node.op == "placeholder":
                env[node] = graph.node_copy(node)
    else:
        for name in incoming:
            env[by_name[name]] = graph.placeholder(name)
    for node in source.nodes:
        if node.target is shape_carrier and made_anywhere(node):
            continue  # made where it is sent on, from the tensor it carries (``lookup``)
        if assignment.get(node.name) == stage and node.op != "placeholder" and not made_again(node):
            env[node] = graph.node_copy(node, lookup)
    if stage == num_stages - 1:
        graph.node_copy(next(n for n in source.nodes if n.op == "output"), lookup)
    else:
        graph.output(tuple(lookup(by_name[name]) for name in outgoing))
    follow_input_device(graph)
    graph.lint()
    return graph


def fold_shape_reads(graph: fx.Graph, root: nn.Module) -> None:
    """Replace each read of a parameter's or buffer's shape (``shape_read``) by the constant it
    reads, where ``graph`` reads that tensor for nothing else, and drop the read of the tensor: the
    stage does not hold a weight whose values it never uses. The shape is the weight's for as long
    as it is that object (another one assigned is refused by the rebinding watch)."""
    for attr in [node for node in graph.nodes if node.op == "get_attr"]:
        readers = list(attr.users)
        if not readers or not all(shape_read(reader) for reader in readers):
            continue
        tensor = resolve(root, str(attr.target))
        if not isinstance(tensor, torch.Tensor):
            continue
        for reader in readers:
            value = getattr(tensor, reader.args[1]) if reader.op == "call_function" else \
                getattr(tensor, str(reader.target))(*reader.args[1:], **reader.kwargs)
            with graph.inserting_before(reader):  # a node, so that a torch.Size stays one in the code
                constant = graph.call_function(type(value), ((*value,) if isinstance(value, torch.Size) else value,))
            constant.meta = dict(reader.meta)
            reader.replace_all_uses_with(constant)
            graph.erase_node(reader)
        graph.erase_node(attr)


def _state_guard(stage: fx.GraphModule) -> None:
    """A first check in the stage: it and each module it calls are in the mode the model was
    captured in (a graph fixed what the model's code read from ``self.training``, and
    ``model.eval()`` switches the modules, not the stage), and the parameters it reads, directly or
    inside those modules, have the dtypes they had (``HeldState``); then that it is called under the
    ``torch.autocast`` state it was captured in (``check_autocast``). Code, not a hook, so every copy
    a runtime makes keeps it."""
    graph = stage.graph
    nodes = list(graph.nodes)
    leaves = tuple(dict.fromkeys(str(n.target) for n in nodes if n.op == "call_module"))
    weights = tuple(dict.fromkeys(str(n.target) for n in nodes
                                  if n.op == "get_attr" and isinstance(resolve(stage, n.target), nn.Parameter)))
    setattr(stage, HELD_STATE, HeldState(stage, leaves, weights))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before():
        state = graph.create_node("get_attr", HELD_STATE)  # not a tensor or module: get_attr() would warn
    with graph.inserting_after(state):
        training = graph.create_node("get_attr", "training")
    with graph.inserting_after(training):
        checked = graph.call_function(checked_modules, (state, training))
    with graph.inserting_after(checked):  # the autocast state it was captured in (shard_model's caller's)
        graph.call_function(check_autocast, (autocast_now(),))
    graph.set_codegen(HeldModulesCodeGen(weights))
    stage.recompile()


class HeldModulesCodeGen(fx.graph.CodeGen):
    """A stage's code calls each module as its first check returned it (``checked_modules``), not
    as fx's code finds it again: ``self.blocks.0.attn`` goes through ``nn.Module.__getattr__`` at
    each step of the path (about a microsecond each on a small CPU, more than the check). The graph
    is left as it is: passes, copies and readers still see its ``call_module`` nodes."""

    def __init__(self, weights: tuple[str, ...] = ()) -> None:
        super().__init__()
        #: the parameters the stage reads itself (get_attr), read from the registries the check returns
        self.weights = frozenset(weights)

    def _gen_python_code(self, nodes: Any, root_module: str, namespace: Any, **options: Any) -> Any:
        lowered = _calls_from_check(nodes, getattr(self, "weights", frozenset()))
        if lowered is None:
            return super()._gen_python_code(nodes, root_module, namespace, **options)
        code = lowered.python_code(root_module, **options)
        if code._lineno_map:  # line -> node of the stage's own graph, which Dynamo reads its nodes' meta by
            original = {id(node): i for i, node in enumerate(nodes)}
            source = lowered.autoshard_source  # type: ignore[attr-defined]
            code._lineno_map = {line: (None if at is None or source[at] is None else original.get(id(source[at])))
                                for line, at in code._lineno_map.items()}
        # ``m(...)``, which fx's nodes cannot spell: torch.compile traces a bound method called so, not
        # through its ``__call__`` (what the check returns may be a module's ``forward``)
        held = [n.name for n in lowered.nodes if n.op == "call_function" and n.target is operator.getitem
                and n.name.startswith("self_")]
        for name in held:
            code.src = code.src.replace(f" {name}.__call__(", f" {name}(")
        return code


def _calls_from_check(nodes: Sequence[fx.Node], weights: frozenset[str] = frozenset()) -> fx.Graph | None:
    """A copy of the graph that calls the stage's check straight (``state.check(training)``) and
    whose ``call_module`` nodes call what it returned (``m = checked["path"]``, then ``m(...)``:
    the module, whose hooks run, or its forward where its call would only run that)."""
    lowered = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    checked: fx.Node | None = None
    held: dict[str, fx.Node] = {}
    for node in nodes:
        if node.op == "call_module" and checked is not None:
            path = str(node.target)
            if path not in held:
                held[path] = lowered.create_node("call_function", operator.getitem, (checked, path),
                                                 name=f"self_{path}")
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = lowered.create_node("call_method", "__call__", (held[path], *args), kwargs,
                                            name=node.name, type_expr=node.type)
            env[node].meta = node.meta
        elif node.op == "get_attr" and checked is not None and str(node.target) in weights:
            owner, _, name = str(node.target).rpartition(".")
            key = registry_key(owner)
            if key not in held:
                held[key] = lowered.create_node("call_function", operator.getitem, (checked, key),
                                                name=f"params_{owner.replace('.', '_')}")
            env[node] = lowered.create_node("call_function", operator.getitem, (held[key], name), name=node.name)
            env[node].meta = node.meta
        elif node.op == "call_function" and node.target is checked_modules:
            # ``state.check(training)`` itself: the check's own code, without a call in between
            args = fx.node.map_arg(node.args, env.__getitem__)
            checked = env[node] = lowered.create_node("call_method", "check", args, name=node.name)
        else:
            env[node] = lowered.node_copy(node, env.__getitem__)
    if checked is None:
        return None
    made_for = {id(new): old for old, new in env.items()}
    lowered.autoshard_source = [made_for.get(id(new)) for new in lowered.nodes]
    return lowered


#: The stage attribute holding its ``HeldState``.
HELD_STATE = "_autoshard_held_state"


#: Operator objects a torch.export graph calls, which pickle refuses.
_OPERATORS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)

#: Where a stage keeps the mode it was captured in.
CAPTURED_MODE = "autoshard_captured_training"


class StageModule(FixedDtypes, fx.GraphModule):
    """One stage: a ``GraphModule`` that pickles its graph as it is. fx's own pickling keeps only
    the generated code and traces it again on loading, which runs autoshard's checks (inputs,
    mode, grad mode) on proxies: they either fail there or drop out of the graph, leaving a
    loaded stage that silently serves what the original refuses."""

    def train(self, mode: bool = True) -> "StageModule":
        """Refuse a switch to the other mode before switching anything (``refuse_mode_switch``).
        The captured mode is kept in ``meta``, which copies keep."""
        refuse_mode_switch(self.meta.get(CAPTURED_MODE, self.training), mode)
        return super().train(mode)

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        """A call its ``forward`` cannot bind (an argument the example left at its default, ``labels=``)
        is refused naming what the stage takes and what serves the call, not with Python's bare
        ``forward() got an unexpected keyword argument``: stages run in turn meet it."""
        try:
            return super()._call_impl(*args, **kwargs)
        except TypeError as exc:
            signature = inspect.signature(self.forward)
            try:
                signature.bind(*args, **kwargs)
            except TypeError as refusal:
                raise CallRefusedError(
                    f"this stage takes ({', '.join(signature.parameters)}) and refuses these arguments ({refusal}): "
                    "the first stage takes the arguments the plan's example passed, each later one the values the "
                    f"stage before it returns{OTHER_CAPTURE}") from exc
            raise

    def __reduce__(self) -> tuple[Any, ...]:
        operators = [n.target for n in self.graph.nodes if isinstance(n.target, _OPERATORS)]
        if operators:
            raise InvalidArgumentError(
                f"this stage calls PyTorch operators directly ({operators[0]}; torch.export captured the model), "
                "which Python cannot pickle; build the stages in each process (shard_model, or load_plan with a "
                "plan file written by `autoshard split TARGET --stages K --out plan.json`), or copy them with "
                "copy.deepcopy")
        declared = next(t for t in type(self).__mro__ if "<locals>" not in t.__qualname__)  # not its own class
        # The state goes apart from the constructor: the graph refers back to its stage, which must
        # exist (empty) before the graph is loaded.
        return _empty_stage, (declared, type(self).__name__), dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        graph = state.pop("_graph")
        self.__dict__.update(state)
        self.graph = graph  # owned by this stage, whose forward is generated from it again


def _empty_stage(cls: type[StageModule], name: str) -> StageModule:
    stage = cls.__new__(cls)  # GraphModule gives every instance a class of its own for its code
    type(stage).__name__ = name
    return stage


def emit_stages(
    gm: fx.GraphModule,
    assignment: Mapping[str, int],
    boundaries: Sequence[Sequence[str]],
    training: bool = False,
    remade: AbstractSet[str] = frozenset(),
) -> list[fx.GraphModule]:
    """Build the stage modules; ``boundaries[j]`` lists the values crossing from stage j to j+1.
    ``training`` is the model's mode at capture; each stage starts in it and refuses the other. Each stage
    reading a tensor of ``remade`` computes it again (``lowering.remade``)."""
    num_stages = len(boundaries) + 1
    stages = []
    for stage in range(num_stages):
        incoming = boundaries[stage - 1] if stage > 0 else ()
        outgoing = boundaries[stage] if stage < num_stages - 1 else ()
        graph = _stage_graph(gm.graph, stage, num_stages, assignment, incoming, outgoing, remade)
        fold_shape_reads(graph, gm)
        module = StageModule(gm, graph, class_name=f"Stage{stage}")
        module.training = training  # its own flag only: its submodules are the model's
        module.meta[CAPTURED_MODE] = training
        _state_guard(module)
        copy_buffer_persistence(gm, module)
        stages.append(module)
    return stages
