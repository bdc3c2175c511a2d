"""Turn a graph captured from the call wrapper into the graph of the user's model.

Both front ends capture ``CallSignature.wrapper(model)``, so their graphs name things under the
wrapper (``model.h.0.attn``) and take only the tensor inputs. ``assemble`` gives the graph:

* the example call's full signature (constants included, trailing ones with their example value
  as default), and a first node checking that later calls fit the capture (``InputGuard``);
* the model's own qualified names for every parameter, buffer and module, bound to the model's
  own objects, and module scopes relative to the model;
* any other object the graph reads (a config kept as a constant, the input guard) under an
  ``_autoshard_`` name.

The user's model is only read: the resulting module's root resolves names through it.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping

import torch.fx as fx
from torch import nn
from torch.utils._pytree import GetAttrKey, KeyEntry, MappingKey, SequenceKey, tree_flatten_with_path, tree_leaves

from autoshard.capture.guard import InputGuard, check_inputs
from autoshard.capture.signature import MODEL_ATTR, CallSignature
from autoshard.emit import copy_buffer_persistence
from autoshard.errors import TraceError
from autoshard.fx_helpers import resolve

_PREFIX = MODEL_ATTR + "."
#: The exact types whose ``repr`` fx writes into the code as a default (``np.float64(2.0)``, a float, would not
#: evaluate there, nor an ``IntEnum``)
_LITERAL_TYPES = frozenset({bool, int, float, str, type(None)})


class ModelNames(nn.Module):
    """A read-only view that resolves names through the user's model, then through ``extras``.

    ``fx.GraphModule`` copies each target it needs from its root; resolving through the model
    (instead of registering the model) leaves the model untouched and keeps its objects.
    """

    def __init__(self, model: nn.Module, extras: Mapping[str, Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_autoshard_model", model)
        object.__setattr__(self, "_autoshard_extras", dict(extras))
        object.__setattr__(self, "training", model.training)

    def __getattr__(self, name: str) -> Any:
        extras = object.__getattribute__(self, "_autoshard_extras")
        if name in extras:
            return extras[name]
        return getattr(object.__getattribute__(self, "_autoshard_model"), name)


def _model_scopes(stack: Mapping[str, tuple[str, Any]] | None) -> dict[str, tuple[str, Any]] | None:
    if stack is None:
        return None
    return {path[len(_PREFIX):]: (path[len(_PREFIX):], kind)
            for path, kind in stack.values() if isinstance(path, str) and path.startswith(_PREFIX)}


class _Renamer:
    """Gives each object the graph reads a name under the user's model, or an ``_autoshard_`` one."""

    def __init__(self, model: nn.Module, captured_root: Any, constants: Mapping[str, Any]) -> None:
        self.model = model
        self.captured_root = captured_root
        self.constants = constants
        self.extras: dict[str, Any] = {}
        self.names: dict[str, str] = {}

    def name(self, target: str) -> str:
        if target not in self.names:
            self.names[target] = self._rename(target)
        return self.names[target]

    def _rename(self, target: str) -> str:
        if target in self.constants:
            return self.extra(self.constants[target], target)
        if target == MODEL_ATTR:
            raise TraceError(f"the capture of {type(self.model).__name__} reads the whole model as one "
                             "value (it passes the model itself to a function); it cannot be split")
        obj = resolve(self.captured_root, target)
        if target.startswith(_PREFIX):
            stripped = target[len(_PREFIX):]
            try:
                if resolve(self.model, stripped) is obj:
                    return stripped
            except AttributeError:
                pass
        return self.extra(obj, target)

    def extra(self, obj: Any, hint: str) -> str:
        name = "_autoshard_" + hint.removeprefix("_autoshard_").replace(".", "_").lstrip("_")
        while name in self.extras and self.extras[name] is not obj:
            name += "_"
        self.extras[name] = obj
        return name


def _placeholders(graph: fx.Graph, signature: CallSignature, checked: bool) -> dict[str, fx.Node]:
    """One placeholder per example argument; trailing literal constants default to their value.

    When the inputs are ``checked``, a placeholder is named ``<argument>_unchecked`` (its target,
    the forward's parameter, keeps the argument's name) so the checked value can take the name.
    """
    defaulted: set[str] = set()
    for argument in reversed(signature.arguments):
        if argument.is_graph_input or type(argument.value) not in _LITERAL_TYPES:
            break
        defaulted.add(argument.name)
    nodes = {}
    for argument in signature.arguments:
        default = (argument.value,) if argument.name in defaulted else ()
        name = f"{argument.name}_unchecked" if checked else argument.name
        nodes[argument.name] = graph.create_node("placeholder", argument.name, default, name=name)
    return nodes


def assemble(
    captured: fx.Graph,
    captured_root: Any,
    model: nn.Module,
    signature: CallSignature,
    input_of: Callable[[fx.Node], tuple[str, int | None]],
    guard: InputGuard | None,
    constants: Mapping[str, Any] | None = None,
) -> fx.GraphModule:
    """Rebuild ``captured`` (taken from ``signature.wrapper(model)``) as a graph of ``model``.

    ``input_of(placeholder)`` says which example argument a captured placeholder stands for, and
    which of its pytree leaves (None: the whole value). ``constants`` are objects the captured
    graph reads by ``get_attr`` that live outside ``captured_root``.
    """
    graph = fx.Graph()
    renamer = _Renamer(model, captured_root, constants or {})
    arguments = _placeholders(graph, signature, checked=guard is not None)
    inputs = {name: arguments[name] for name in (a.name for a in signature.graph_inputs)}
    if guard is not None:
        guard_attr = graph.create_node("get_attr", renamer.extra(guard, "input_guard"))
        checked = graph.call_function(check_inputs, (guard_attr, *arguments.values()))
        inputs = {name: graph.create_node("call_function", operator.getitem, (checked, i), name=name)
                  for i, name in enumerate(guard.returns)}
    leaves: dict[str, fx.Node] = {}
    # a container's leaves read by their paths where the guard holds the call to the example's layout
    paths = {a.name: [path for path, _ in tree_flatten_with_path(a.value)[0]] for a in signature.graph_inputs} \
        if guard is not None else {}
    reads: dict[tuple[str, tuple[KeyEntry, ...]], fx.Node] = {}
    env: dict[fx.Node, fx.Node] = {}
    for node in captured.nodes:
        if node.op == "placeholder":
            name, leaf = input_of(node)
            if leaf is None:
                env[node] = inputs[name]
                continue
            if name in paths and all(type(entry) in _ENTRY_READS for entry in paths[name][leaf]):
                env[node] = _leaf_read(graph, inputs[name], name, paths[name][leaf], reads)
                continue
            if name not in leaves:
                leaves[name] = graph.call_function(tree_leaves, (inputs[name],))
            env[node] = graph.call_function(operator.getitem, (leaves[name], leaf))
            continue
        if node.op == "get_attr" and not node.users:  # an exporter's leftover read of a weight
            continue
        if node.op in ("get_attr", "call_module"):
            target = renamer.name(str(node.target))
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            copied = graph.create_node(node.op, target, args, kwargs, name=target.replace(".", "_"))
            copied.meta = dict(node.meta)
        else:
            copied = graph.node_copy(node, env.__getitem__)
        if "nn_module_stack" in node.meta:
            copied.meta["nn_module_stack"] = _model_scopes(node.meta["nn_module_stack"])
        env[node] = copied
    graph.lint()
    return model_graph_module(model, graph, renamer.extras)


#: How a graph reads a container's item by each kind of pytree path entry.
_ENTRY_READS: dict[type, tuple[Callable[..., Any], str]] = {
    MappingKey: (operator.getitem, "key"), SequenceKey: (operator.getitem, "idx"), GetAttrKey: (getattr, "name")}


def _leaf_read(graph: fx.Graph, container: fx.Node, name: str, path: tuple[KeyEntry, ...],
               reads: dict[tuple[str, tuple[KeyEntry, ...]], fx.Node]) -> fx.Node:
    """The node reading the leaf at ``path`` in argument ``name`` (``container``), item by item, each prefix
    read once (``reads``): a first stage's code as fx writes it (``inputs['x']``), where
    ``tree_leaves(inputs)[0]`` flattened the whole argument with pytree on every call (1.5 us for a dict of
    two tensors). The input guard holds the call's containers to the example's, so the paths are its leaves'."""
    node = container
    for depth, entry in enumerate(path):
        key = (name, path[:depth + 1])
        if key not in reads:
            how, field = _ENTRY_READS[type(entry)]
            reads[key] = graph.call_function(how, (node, getattr(entry, field)))
        node = reads[key]
    return node


def model_graph_module(model: nn.Module, graph: fx.Graph, extras: Mapping[str, Any]) -> fx.GraphModule:
    """``graph`` over ``model``'s own objects, under the model's names (plus ``extras``).

    ``fx.GraphModule`` registers every buffer it copies as persistent; the model's non-persistent
    buffers (a rotary ``inv_freq``) must stay out of ``state_dict`` here and in every stage.
    """
    gm = fx.GraphModule(ModelNames(model, extras), graph, class_name=type(model).__name__)
    copy_buffer_persistence(model, gm)
    return gm


def leaves_of(signature: CallSignature) -> list[tuple[str, int | None]]:
    """``(argument, leaf)`` for each flattened graph-input leaf, in the order exporters take them;
    ``leaf`` is None for an argument that is a single tensor."""
    found: list[tuple[str, int | None]] = []
    for argument in signature.graph_inputs:
        leaves = tree_leaves(argument.value)
        if len(leaves) == 1 and leaves[0] is argument.value:
            found.append((argument.name, None))
        else:
            found += [(argument.name, i) for i in range(len(leaves))]
    return found
