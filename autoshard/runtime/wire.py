"""What crosses each stage boundary on the wire: tensors, never tuples of them.

``torch.distributed.pipelining`` sends a flat tuple of tensors. A boundary value that is a tuple
(a module returning several tensors, ``torch.split``, the capture's input guard) cannot be sent
as such; but when every later stage only takes items out of it (``value[i]``), those items can
be: the sending stage takes them out, and the receiving stage gets one input per item where it
had the tuple. A tuple or list of tensors that a later stage uses whole (an LSTM's ``(h, c)``
handed to the next LSTM, ``torch.cat(chunks)``) crosses as all its items, and the receiving
stage builds it again from them. Any other value crosses as itself (``boundaries`` checks it is
a tensor).

Process groups send only contiguous tensors. A value that fills its storage in another order (a
transpose, a channels-last map) crosses as ``value.permute(order)``, contiguous as it is, and the
receiving stage permutes it back (``Wire.order``): no copy, and both stages hold it as the model
did. Any other value (a slice) crosses as a contiguous copy.

Gradients go back the same way, and PyTorch sends them as autograd made them: the gradient of a
received value that the stage reads through a transpose is not contiguous, and gloo refuses it.
Each stage therefore reads its received values through ``contiguous_grad``. A stage that sends a
view of a weight (a transpose of an expert's weight, read by the next stage) gives it a gradient of
its own (``own_gradient``): autograd would keep the receive buffer, reused every step, as the weight's.

A schedule running several stages on one rank hands the keyword arguments of ``step`` to every
one of them; they are the model's inputs, which only the first stage takes (later stages receive
what they need across the boundaries). So every later stage accepts and ignores keywords, and
names its parameters by position, so that a received ``labels`` is not also given as a keyword.

The last stage returns to ``loss_fn`` rather than sending, but PyTorch holds it to the same rule:
a tensor or a flat tuple of tensors. A model returning a structure (a Hugging Face ``ModelOutput``,
a dict, nested tuples) has its last stage return the tensors in it, in order, which for a
``ModelOutput`` is what ``return_dict=False`` returns: ``(loss, logits)`` given labels, else the
logits alone (one tensor is returned as itself, never as a one-item tuple).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch._functorch.utils import unwrap_if_dead
from torch.utils._pytree import SUPPORTED_NODES, _get_node_type, tree_leaves

from autoshard.costs.layouts import order_undone
from autoshard.costs.values import StructureMeta, TensorMeta, ValueMeta
from autoshard.sharded import ShardedModel


@dataclass(frozen=True)
class Wire:
    """One tensor sent across a boundary: the value ``name`` itself, or its item ``index``.
    ``rebuilt`` ("tuple", "list") when a later stage uses the value whole: every item is sent and
    the receiving stage builds the container again."""

    name: str
    index: int | None = None
    rebuilt: str | None = None
    order: tuple[int, ...] | None = None
    """For a tensor that fills its storage in another order than contiguous (a transpose, a
    channels-last map): the order of its dimensions in storage. It crosses as ``permute(order)``,
    contiguous without a copy, and the receiver permutes it back, so both hold it as the model did."""

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


def value_meta(sharded: ShardedModel, name: str) -> ValueMeta | None:
    """What shape propagation recorded of value ``name`` (None without it, or for a value of the
    stages' own making)."""
    dag = sharded.plan.dag
    return dag.nodes[name].get("value_meta") if name in dag else None


def _flat_tensor_sequence(sharded: ShardedModel, name: str) -> StructureMeta | None:
    """The value's structure when it is a tuple or list of tensors only (shapes were propagated)."""
    meta = value_meta(sharded, name)
    if isinstance(meta, StructureMeta) and meta.kind in ("tuple", "list") and meta.items and \
            all(isinstance(item, TensorMeta) for item in meta.items):
        return meta
    return None


def _wires_of(sharded: ShardedModel, name: str, boundary: int, is_tensor: bool) -> list[Wire]:
    """What crosses for ``name``: itself, the items later stages read, or all its items to rebuild."""
    if is_tensor:
        facts = sharded.plan.dag.nodes[name].get("training") if name in sharded.plan.dag else None
        return [Wire(name, order=getattr(facts, "dense_order", None))]
    items = items_read_after(sharded, name, boundary)
    if items is not None:
        return [Wire(name, i) for i in items]
    sequence = _flat_tensor_sequence(sharded, name)
    if sequence is None:
        return [Wire(name)]  # crosses as itself: ``boundaries`` refuses it unless it is a tensor
    return [Wire(name, i, sequence.kind) for i in range(len(sequence.items))]


def wire_layout(sharded: ShardedModel, is_tensor: dict[str, bool]) -> list[list[Wire]]:
    """Per boundary, the tensors sent in order; ``is_tensor[name]`` says a value is known to be one."""
    return [[wire for name in names for wire in _wires_of(sharded, name, boundary, bool(is_tensor.get(name)))]
            for boundary, names in enumerate(sharded.plan.boundaries)]


def _receive_items(graph: fx.Graph, wires: list[Wire]) -> dict[Wire, fx.Node]:
    """Replace each tuple input by one input per item sent, in wire order; a container used whole
    is built again from its items, after the inputs."""
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
    rebuilt = dict.fromkeys(wire.name for wire in wires if wire.rebuilt)
    last_input = [node for node in graph.nodes if node.op == "placeholder"][-1] if rebuilt else None
    for name in rebuilt:
        whole = node_named(graph, name)
        if whole is None or all(user.op == "output" for user in whole.users):  # passed on only
            continue
        items = [received[wire] for wire in wires if wire.name == name]
        kind = next(wire.rebuilt for wire in wires if wire.name == name)
        with graph.inserting_after(last_input):
            container = graph.call_function(tuple if kind == "tuple" else list, (items,))
        whole.replace_all_uses_with(container)
    return received


def _identity_whose_gradient_is(made_by: Callable[[torch.Tensor], torch.Tensor],
                                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The identity, whose backward hands the gradient on as ``made_by`` makes it, as a function of the
    value. Its forward returns a detached alias rather than a view: autograd forbids writing in place
    to a view a custom Function returned, and stages do (``nn.ReLU(inplace=True)`` right after a cut).
    One ``Function`` class each: an argument naming what to make, kept on the ``ctx``, made a call 1.5x as long."""

    class GradientMadeBy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
            return value.detach()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return made_by(grad)

    # ``apply`` without ``Function.apply``'s Python wrapper (the C++ ``apply`` it ends in), for calls outside
    # functorch transforms: a third of the forward's cost (36k -> 27k instructions)
    apply = super(torch.autograd.Function, GradientMadeBy).apply

    def identity(value: torch.Tensor) -> torch.Tensor:
        if _functorch_transforms_active():  # what ``Function.apply`` does there
            return GradientMadeBy.apply(value)
        return apply(unwrap_if_dead(value))  # as ``Function.apply`` hands it on
    return identity


_functorch_transforms_active = torch._C._are_functorch_transforms_active
_with_contiguous_gradient = _identity_whose_gradient_is(torch.Tensor.contiguous)
_with_copied_gradient = _identity_whose_gradient_is(torch.Tensor.clone)


def contiguous_grad(value: torch.Tensor) -> torch.Tensor:
    """``value``, with a contiguous gradient if it needs one (the gradient sent to the previous stage)."""
    return _with_contiguous_gradient(value) if value.requires_grad else value


def own_gradient(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a stage sends it: where it views a weight (a transpose of one), with a gradient of
    its own. Its gradient is the receive buffer ``PipelineStage`` keeps for every step, which
    autograd, handed it through the views, would keep as the weight's ``.grad`` where laid out as the
    weight is: the next step's gradient received into it then overwrote an accumulated one
    (``zero_grad(set_to_none=False)``, or two steps before the optimizer's)."""
    base = value._base
    if base is None or not base.is_leaf or not value.requires_grad:
        return value
    return _with_copied_gradient(value)


_with_gradient_as_it_is = _identity_whose_gradient_is(lambda grad: grad)


def own_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a stage sends it under a schedule that splits the backward (zero bubble): a tensor of
    its own, ``own_gradient``'s or an alias. PyTorch's backward of the inputs ``detach_()``-es every
    output it sent, which raises for a view (GPT-2's heads merged by ``view``); an alias is detached
    instead of the stage's own value."""
    sent = own_gradient(value)
    return _with_gradient_as_it_is(sent) if sent is value and (value.requires_grad or value._is_view()) else sent


def send_own_tensors(module: fx.GraphModule) -> None:
    """Send every output of a stage ``rewire`` made through ``own_tensor`` rather than ``own_gradient``."""
    for node in module.graph.nodes:
        if node.target is own_gradient and all(user.op == "output" for user in node.users):
            node.target = own_tensor
    module.recompile()


def _read_received_through_contiguous_grad(graph: fx.Graph, orders: Mapping[str, tuple[int, ...]]) -> None:
    """Each received value read through ``contiguous_grad``, and permuted back where it crossed
    permuted (``Wire.order``)."""
    for placeholder in [node for node in graph.nodes if node.op == "placeholder" and node.users]:
        with graph.inserting_after(placeholder):
            read = graph.call_function(contiguous_grad, (placeholder,))
        value = read
        if placeholder.name in orders:
            with graph.inserting_after(read):
                value = graph.call_method("permute", (read, *order_undone(orders[placeholder.name])))
        placeholder.replace_all_uses_with(value, delete_user_cb=lambda user: user is not read)


def _ignore_keywords(graph: fx.Graph) -> None:
    """Parameters ``received_0, received_1, ..., **ignored_keywords``; the values keep their names."""
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    for position, node in enumerate(inputs):
        node.target = f"received_{position}"
    with graph.inserting_after(inputs[-1]) if inputs else graph.inserting_before(None):
        graph.placeholder("**ignored_keywords")


class OutputTensors:
    """The model's output as a last stage returns it: the flat tuple of its leaves (``None``
    fields dropped), or the only leaf itself. PyTorch calls ``loss_fn`` with a one-item tuple
    unwrapped when it infers shapes but as it is in a step; one tensor is the same in both.

    It notes where the output's ``loss`` (a dict entry, a ``ModelOutput`` field, an attribute)
    lands in that tuple, for ``model_loss``: a dict may hold it after its predictions."""

    __name__ = "output_tensors"

    def __init__(self) -> None:
        self.loss_index: int | None = None

    def __call__(self, value: Any) -> Any:
        leaves = _tensor_leaves(value)
        loss = value.get("loss") if isinstance(value, Mapping) else getattr(value, "loss", None)
        self.loss_index = None if loss is None else next((i for i, leaf in enumerate(leaves) if leaf is loss), None)
        for i, leaf in enumerate(leaves):
            if leaf.is_leaf and leaf.requires_grad:  # a weight the model returns: returned as a view of it,
                leaves[i] = leaf.view_as(leaf)  # which PyTorch's last stage does not ``detach_()`` after its backward
        return leaves[0] if len(leaves) == 1 else tuple(leaves)


def _tensor_leaves(value: Any) -> list[Any]:
    """``value``'s leaves but ``None``: read in one step where it is a tensor or a container whose
    items are all tensors (a tuple, a ``ModelOutput``: what a last stage returns on every
    microbatch), else by ``tree_leaves``, which costs twice as much for two tensors."""
    if type(value) is torch.Tensor:
        return [value]
    node = SUPPORTED_NODES.get(_get_node_type(value))
    if node is not None:
        items = node.flatten_fn(value)[0]
        for item in items:
            if type(item) is not torch.Tensor:
                break
        else:  # a plain loop: a generator for all() costs as much as the rest
            return list(items)
    return [leaf for leaf in tree_leaves(value) if leaf is not None]


def loss_reader(module: fx.GraphModule) -> OutputTensors | None:
    """The ``OutputTensors`` of a last stage made by ``rewire`` (None for any other stage)."""
    return next((node.target for node in module.graph.nodes if isinstance(node.target, OutputTensors)), None)


def rewire(module: fx.GraphModule, stage: int, layout: list[list[Wire]]) -> None:
    """Make ``stage`` take and return exactly the wires of its boundaries: each sent contiguous
    (process groups send only contiguous tensors, and a slice such as ``mask[:n, :n]`` is not) and
    through ``own_gradient``, each received with a contiguous gradient; keywords ignored after the
    first stage; the last stage returns ``OutputTensors`` of the model's output."""
    graph = module.graph
    received = _receive_items(graph, layout[stage - 1]) if stage > 0 else {}
    output = next(node for node in graph.nodes if node.op == "output")
    if stage == len(layout):
        with graph.inserting_before(output):
            output.args = (graph.call_function(OutputTensors(), output.args),)
    else:
        with graph.inserting_before(output):
            values = []
            for wire in layout[stage]:
                value = received.get(wire) or node_named(graph, wire.name)
                if wire.index is not None and wire not in received:
                    value = graph.call_function(operator.getitem, (value, wire.index))
                if wire.order is not None:
                    value = graph.call_method("permute", (value, *wire.order))
                values.append(graph.call_function(own_gradient, (graph.call_method("contiguous", (value,)),)))
        output.args = (tuple(values),)
    for wire in layout[stage - 1] if stage > 0 else ():
        whole = node_named(graph, wire.name)
        if wire.index is not None and whole is not None and not whole.users:
            graph.erase_node(whole)
    if stage > 0:
        _read_received_through_contiguous_grad(graph, {w.name: w.order for w in layout[stage - 1] if w.order})
        _ignore_keywords(graph)
    graph.lint()
    module.recompile()
