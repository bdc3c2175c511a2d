"""Let what a stage reads of a tensor's shape cross a boundary without the tensor.

Values that are not tensors never cross a boundary (pipeline runtimes send tensors): the stage that
reads ``x.size(-1)`` recomputes it from ``x``, so ``x`` itself crossed to it. GPT-2 reads its
embedding's width right after the embedding and uses it to reshape the last layer's output, so
the embedding's whole output crossed every boundary for one integer (46% of the bytes a 12-layer
GPT-2 sent at k = 4).

``carry_shapes`` gives each tensor read for its metadata alone somewhere (``metadata_read``: shape,
dtype, device) a carrier, ``shape_carrier(x)``: a tensor of shape ``(0, *x.shape)`` with ``x``'s
dtype and device, which holds no bytes, and routes those reads through ``CarriedShape(carrier)``,
which answers them as ``x`` would. The carrier is an ordinary tensor of the graph: the DAG weighs
it (0 bytes), the splitter lets it cross instead of ``x``, the memory model and the plan file see a
value of 0 bytes, and verification compares it with the model's. It is ``made_from`` ``x`` in the DAG:
a partition puts it in ``x``'s stage, and it crosses only the boundaries past the last stage holding
``x``, whose emitted code makes it there, where it is sent on; a stage that holds ``x`` reads ``x``
straight, so stage code is the model's where nothing crosses.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
import torch.fx as fx

from autoshard.costs.facts import NodeFacts, record_facts
from autoshard.costs.values import TensorMeta, describe_value
from autoshard.fx_helpers import metadata_read
from autoshard.lowering.inplace import memory_root, written_inputs


def shape_carrier(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of no elements and no bytes that has ``tensor``'s shape (after its first
    dimension), dtype and device: what crosses a boundary for a reader of those alone."""
    return tensor.new_empty((0, *tensor.shape))


class CarriedShape:
    """A tensor's metadata, read off its carrier: answers what ``metadata_read`` reads as the tensor would."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, carrier: torch.Tensor) -> None:
        self.shape = carrier.shape[1:]
        self.dtype = carrier.dtype
        self.device = carrier.device

    def __repr__(self) -> str:  # (no device: the facts the planner records say none)
        return f"CarriedShape({tuple(self.shape)}, {self.dtype})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    ndimension = dim
    nelement = numel


#: Marks a carrier made before a write in place to its tensor (``x.t_()`` may change its shape).
_BEFORE_A_WRITE = "autoshard_carrier_before_a_write"


def made_anywhere(carrier: fx.Node) -> bool:
    """Whether any stage holding the carrier's tensor may make the carrier (where it sends it on) or read
    the tensor instead: not for one made before a write in place to it, which may change its shape, so
    that it is made where it stands in the program and its readers read it alone."""
    return not carrier.meta.get(_BEFORE_A_WRITE, False)


def carried_tensor(node: fx.Node) -> fx.Node | None:
    """The tensor a stage holding it reads instead of ``node`` (a ``CarriedShape`` of a carrier
    ``made_anywhere``); None for any other node."""
    if node.op == "call_function" and node.target is CarriedShape:
        carrier = node.args[0]
        assert isinstance(carrier, fx.Node) and isinstance(carrier.args[0], fx.Node)
        return carrier.args[0] if made_anywhere(carrier) else None
    return None


def carry_shapes(gm: fx.GraphModule, facts: dict[str, NodeFacts]) -> None:
    """Route every metadata read of a tensor the graph computes or takes through a carrier (above), and
    drop those nothing uses; ``facts`` (``shape-prop``'s, which say what is a tensor) gains the nodes
    added, also recorded on them, and loses those dropped. A weight's shape is read as a constant
    instead (emit's ``fold_shape_reads``).

    The carrier is made right after its tensor (after the last input, for an input), in its module,
    so that a split in program order may cut between them, and ``no_split`` or ``pin`` on the module
    reading the shape does not pull it there; a tensor written in place gets one carrier per stretch of
    reads between writes, made after the write before them (``x.t_()`` changes the shape), and one
    whose memory is written under another name gets none (its reads are recomputed from it, as before)."""
    graph = gm.graph
    position = {node: index for index, node in enumerate(graph.nodes)}
    last_input = max((node for node in position if node.op == "placeholder"), key=position.__getitem__, default=None)
    written_in: dict[fx.Node, set[fx.Node]] = {}  # memory root -> the values written in place that share it
    writers: dict[fx.Node, list[fx.Node]] = {}  # value -> the nodes writing it in place, in program order
    added: dict[str, NodeFacts] = {}  # the carriers' facts, recorded on them at the end (one walk of the graph)
    for node in position:
        for value in written_inputs(gm, node):
            written_in.setdefault(memory_root(gm, value), set()).add(value)
            writers.setdefault(value, []).append(node)
    for tensor in list(position):
        value = facts[tensor.name].value if tensor.name in facts else None
        if tensor.op == "get_attr" or not isinstance(value, TensorMeta):
            continue
        if written_in.get(memory_root(gm, tensor), set()) - {tensor}:  # written under another name, which may
            continue  # be the tensor itself (``h.contiguous()``): no telling when its shape changed
        reads = sorted((user for user in tensor.users if metadata_read(user) and user.args[0] is tensor),
                       key=position.__getitem__)
        for unread in [read for read in reads if not read.users]:  # (the model's code kept a shape it never used)
            graph.erase_node(unread)  # nothing else to keep it for: a read of metadata changes nothing
            reads.remove(unread)
            del facts[unread.name]
        writes = writers.get(tensor, [])
        stretches: dict[fx.Node, list[fx.Node]] = {}
        for read in reads:
            since = [write for write in writes if position[write] < position[read]]
            start = since[-1] if since else last_input if tensor.op == "placeholder" else tensor
            stretches.setdefault(start, []).append(read)
        for after, stretch in stretches.items():
            written = facts[after.name].value if after in writes and after.name in facts else None
            shape = written if isinstance(written, TensorMeta) else value  # (a write that returns it: its new shape)
            added.update(_carry(graph, facts, tensor, shape, after, stretch,
                                before_a_write=bool(writes) and after is not writes[-1]))
    record_facts(graph, added)
    facts.update(added)


def _carry(graph: fx.Graph, facts: Mapping[str, NodeFacts], tensor: fx.Node, value: TensorMeta, after: fx.Node,
           reads: list[fx.Node], before_a_write: bool) -> dict[str, NodeFacts]:
    """Route ``reads`` of ``tensor`` (as ``value`` describes it) through a carrier made right after ``after``;
    the facts of the nodes added, by name."""
    read_facts = facts.get(reads[0].name)
    if read_facts is None:
        return {}
    with graph.inserting_after(after):
        carrier = graph.create_node("call_function", shape_carrier, (tensor,), name=f"{tensor.name}_shape")
    with graph.inserting_before(reads[0]):  # where the reads are, in their module
        carried = graph.create_node("call_function", CarriedShape, (carrier,))
    # in the tensor's module, not the reader's, whose no_split or pin would pull it (and the tensor) there
    for node, scope in ((carrier, tensor), (carried, reads[0])):
        node.meta.update({key: meta for key, meta in scope.meta.items() if key == "nn_module_stack"})
    carrier.meta[_BEFORE_A_WRITE] = before_a_write
    for read in reads:
        read.args = (carried, *read.args[1:])
    meta = torch.empty((0, *value.shape), dtype=getattr(torch, value.dtype), device="meta")
    # a metadata read's facts but its value: no flops, nothing allocated or saved, as for a carrier
    return {carrier.name: dataclasses.replace(read_facts, value=TensorMeta((0, *value.shape), value.dtype, 0)),
            carried.name: dataclasses.replace(read_facts, value=describe_value(CarriedShape(meta)))}
