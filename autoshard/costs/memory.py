"""Training memory per stage, for ``cost=memory``, ``max_memory`` budgets and plan reports.

What a stage holds at its peak, in the steady state of its schedule (a backward running while
its other microbatches wait), part by part:

* weight state, once per distinct weight (a shared one once per stage holding it): the weight,
  and for a trainable one its gradient and optimizer state (``memory_model.MemoryModel.weight_parts``);
* per microbatch in flight: the activations autograd saves (measured per node on fake tensors,
  ``costs.saved``, modules and functions kept whole included), the values the stage received
  (kept until their gradients are sent back; torch's ``PipelineStage`` keeps a receive buffer
  per microbatch) and the values it sent that nothing saved (kept until their gradients arrive);
* once, the backward of one microbatch: the gradients of its outputs, then, node by node in
  reverse, the gradients alive and the node's own backward peak, less what the nodes already
  run have freed (``backward_bytes``: the most of that above the microbatches held); where every
  forward of the step runs before the stage's first backward (GPipe; 1F1B on a stage keeping
  every microbatch of the step), that backward instead meets no gradient (``zero_grad`` freed
  them) and makes them, and the next meets them with a microbatch fewer
  (``first_backward_bytes``, ``later_backward_bytes``); in 1F1B's steady state, beside the
  gradients the previous backward sent back, which the schedule still holds (``sent_back_bytes``);
* all step, the receive buffers of the microbatches not in flight (``idle_buffer_bytes``):
  ``PipelineStage`` allocates, for every microbatch of the step, a buffer for the values a stage
  receives and one for the gradients of the values it sends, and keeps them from step to step;
  the first stage is handed the step's whole batch (``schedule.step`` splits it into views), which
  it holds to the step's end as a later stage holds its receive buffers;
  the last stage's loss of every microbatch (a one-element output: the schedule keeps each until
  the step ends, and a CPU ``mse_loss`` returns a view of its whole elementwise buffer).

After the last backward no microbatch is in flight, but the weight state and every receive buffer
are, and the step's last phase adds its own (``step_bytes``): the tied-gradient sum
(``runtime.ties.TiedGradients.sync``: one buffer of every trainable weight that stages on other
ranks also hold, on every rank) or the optimizer step's temporaries (``MemoryModel.step_bytes``),
whichever is more. The stage peaks in that phase where its weights outweigh what its microbatches
keep (activation checkpointing, few microbatches).

Microbatches in flight at stage j of k: ``min(k - j, microbatches)`` under 1F1B, every
microbatch under GPipe, and under interleaved 1F1B what PyTorch's op order keeps (simulated as
``ScheduleInterleaved1F1B`` orders it; see ``interleaved_in_flight``). Measured against
``runtime.measure_stage_memory`` on the examples and a Hugging Face zoo (RESULTS.md, "Memory
accuracy"). A DAG without the probe's facts (a plan file, a graph fake tensors cannot run) falls
back to each node's newly allocated output bytes for its activations and no backward term.

The per-node ``memory`` cost is a node's weight state (each weight charged to one reader,
``costs.ties.weight_payers``) plus its saved activations for one microbatch: additive, what a
splitter balances. The received and sent values and the backward depend on where the cuts are,
so only ``stage_memory`` counts them (``StageMemory.total`` against its ``additive`` part, by which
a split over budget tightens its budgets: ``costs.split_search.placements``).

How training is run (optimizer, schedule, data parallelism) is ``memory_model.MemoryModel``; this
module walks a stage's nodes under it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import AbstractSet, Iterator, Mapping, Sequence

import networkx as nx

from autoshard.costs.memory_model import MemoryModel, Weight, is_parameter
from autoshard.costs.recompute import (
    RecomputedBackward, block_path, checkpoint_regions, checkpointed_kept, recomputed_backward)
from autoshard.costs.ties import weight_payers
from autoshard.errors import InfeasibleSplitError, amount, plural
from autoshard.graph.partition import Cuts, also_run, boundary_values, made_again, stage_between


@dataclass(frozen=True)
class SavedFacts:
    """Per node, in bytes: ``saved``, storages it creates that autograd keeps for backward (its
    output's included when any node saves it); ``saved_output``, the part of ``saved`` that is its
    output; ``grad``, the gradient its output receives (floating tensors that require grad);
    ``backward``, the peak its backward adds to what is alive when it starts; ``releases``, per
    node that made them, the saved storages autograd frees once this node's backward has run (it
    is the first node to save them, so the last to use them). ``views``: for a node that made no
    storage (a view, an item of a tuple, an in-place write), the node whose storage its output
    is ("" for a model input or a weight). ``input_grads``: the inputs its backward gives a
    gradient, each with True when that gradient is the node's own output gradient handed on, no
    new buffer (a view's, each addend's). None for either: not recorded (a plan file from
    before, a backward fake tensors cannot run). ``backward`` starts from a gradient laid out as
    the node's consumers give it (attention's backward copies a transposed one);
    ``backward_when_sent``, where that differs, from one laid out as a new tensor, as the receive
    buffer of a value sent to the next stage is (None: the same). ``forward``: the most its forward
    holds at once above what was alive before it, its output and what it saves included (a
    temporary freed before it returns: a non-contiguous input's copy, an unfused bias add); None:
    not recorded, counted as its output's bytes. ``strided_grads``: the inputs among ``input_grads``
    whose gradient is not contiguous (a sum's, expanded; a transpose's), or, for an input filling
    its storage in another order, not laid out in that order: a stage copies it before sending it.
    ``strided_output``: its output is a tensor with gaps or overlaps in its storage (a slice, an
    expanded tensor), which a stage sends as a contiguous copy (one that fills its storage in
    another order, a transpose, crosses as it is: ``dense_order``). ``when_contiguous``:
    for a node reading such a value, as it is when that value comes contiguous, as the next stage
    receives it: (the change in what it saves of its own, ``forward``, ``backward``,
    ``strided_grads``); None: the same, or not recorded. ``weight_grads``: the trainable weights
    (their names in the DAG) its backward gives a gradient, which may be fewer than it reads: a
    function handed a module (``apply_tf_padding(x, conv)``) holds the module's weights and may
    read only its settings; None: not recorded, every trainable weight it reads counts. ``holds``: the
    other nodes whose storages its output keeps alive besides its own (or ``views``'): a container of
    values several nodes made (a ``ModelOutput`` of the last hidden state and the pooled output).
    ``weights_first``: its backward adds every weight's gradient into theirs before it hands any input
    its own (a Linear on a 3-D input, whose input gradient comes through the reshape's backward).
    ``saves_from``: the nodes whose storages it saves among what it reads, first saver or not
    (``releases`` names only the first): a block's output stays kept when its block is recomputed
    only if a node outside the block saves it; None: not recorded. ``gradients_kept``: what its
    backward's peak adds where its weights have no gradient yet (the step's first backward after
    ``zero_grad``): autograd keeps each one as it is made, where it adds it into the existing one
    and frees it (``backward``). ``gradient_copies``: the bytes of those weight gradients not laid out
    as their weights are (a convolution's from a channels-last input), which autograd then keeps as
    copies in the weights' layout, made once the node's backward has returned, beside the original.
    ``writes``: the inputs it writes into in place (``y.tanh_()``, ``y[:, 0] = 0``): the nodes reading
    them after it read what it wrote, so the gradient they give is the one its backward starts from,
    and what it gives them replaces it. ``backward_alone``: ``backward`` where the gradient it starts
    from is its alone, which autograd frees once the first function of its backward has run (a write
    into a view: ``AsStridedBackward`` makes the base's gradient, then ``CopySlices`` runs); None: the
    same, or not recorded. ``backward_when_handed``: ``backward`` where its gradient is the receive buffer
    of a value sent, handed on unchanged (an addend's), laid out in that value's ``dense_order`` (() for
    contiguous), for each such order where it differs (a Linear copies a permuted one); ``passes_on``: the
    inputs its backward hands the gradient it got itself, laid out as it came (an addend; not a view).
    ``strided_when_sent``: ``strided_grads`` where its gradient is laid out as a new tensor, as the receive
    buffer of a value sent is (its first probe's; consumers that give another layout probe it again): a
    slice of that buffer (a ``cat``'s backward) is strided in any layout; None: not recorded. ``parts``: for
    an output of several storages it made (``sort``'s values and indices), per storage in order, its bytes
    and those of them some node saves (() for one storage, or not recorded); ``part``: for a node whose output
    lives in some of them only (an item: ``views`` names their maker), their indices (None: all, or its own).
    Each such storage lives until the last reader of a value in it has run, not until the last reader of any."""

    saved: int
    saved_output: int
    grad: int
    backward: int
    releases: tuple[tuple[str, int], ...] = ()
    views: str | None = None
    input_grads: tuple[tuple[str, bool], ...] | None = None
    backward_when_sent: int | None = None
    forward: int | None = None
    strided_grads: tuple[str, ...] = ()
    strided_output: bool = False
    when_contiguous: tuple[int, int, int, tuple[str, ...]] | None = None
    dense_order: tuple[int, ...] | None = None
    weight_grads: tuple[str, ...] | None = None
    holds: tuple[str, ...] = ()
    weights_first: bool = False
    saves_from: tuple[str, ...] | None = None
    gradients_kept: int = 0
    gradient_copies: int = 0
    writes: tuple[str, ...] = ()
    backward_alone: int | None = None
    backward_when_handed: tuple[tuple[tuple[int, ...], int], ...] = ()
    passes_on: tuple[str, ...] = ()
    strided_when_sent: tuple[str, ...] | None = None
    parts: tuple[tuple[int, int], ...] = ()
    part: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StageMemory:
    """One stage's training memory, split into what it is made of (bytes).

    ``state_bytes`` = weights + gradients + optimizer state (``weight_bytes``, ``gradient_bytes``
    and the rest); per microbatch in flight ``activation_bytes`` (saved for backward),
    ``received_bytes`` and ``sent_bytes``; ``backward_bytes`` is the most one backward adds
    (output gradients, ``output_grad_bytes``, included), ``forward_bytes`` the most one forward
    holds above what it keeps (temporaries, values not yet read, and the receive buffer of the
    gradient the next backward starts from): the stage peaks in the larger."""

    stage: int
    state_bytes: float
    activation_bytes: float
    in_flight: int
    received_bytes: float = 0.0
    sent_bytes: float = 0.0
    output_grad_bytes: float = 0.0
    backward_bytes: float = 0.0
    forward_bytes: float = 0.0
    weight_bytes: float = 0.0
    gradient_bytes: float = 0.0
    gathered_bytes: float = 0.0
    """The part of ``weight_bytes`` and ``gradient_bytes`` that data parallelism holds unsharded
    during a step (0 for pipelining alone)."""
    reduce_bytes: float = 0.0
    """What the gradient reduction after the last backward adds to ``state_bytes``, when no
    microbatch is in flight any more (``MemoryModel.reduce_bytes``)."""
    buffer_bytes: float = 0.0
    """The receive buffers the runtime keeps all step, one per microbatch of the step: received
    values (on the first stage, the batch it is handed) and gradients of the values sent (not on
    the last)."""
    idle_buffer_bytes: float = 0.0
    """The part of ``buffer_bytes`` that the microbatches in flight and the one backward, which
    use their buffers, do not count already; and on the last stage the losses of the microbatches
    not in flight (the schedule frees them as the step ends, so ``buffer_bytes`` has none)."""
    step_bytes: float = 0.0
    """What the tied-gradient sum or the optimizer step adds to ``state_bytes`` after the last
    backward, whichever is more (with data parallelism's unsharded copies freed by then)."""
    first_backward_bytes: float | None = None
    """When the stage's first backward of a step meets no gradient (``MemoryModel.makes_gradients``):
    what that backward adds, the weights' gradients it makes included. None: the gradients exist at
    every backward."""
    later_backward_bytes: float | None = None
    """When every forward of the step runs before the stage's first backward
    (``MemoryModel.forwards_first``), the most a later backward adds to the microbatches held: its own
    peak, less what the backwards before it freed for good (a microbatch's activations and what it
    sent, each), plus the gradients they sent back, which torch's schedules hold
    (``MemoryModel.sends_held``): a change to what is held, so below 0 where the backwards before freed
    more than a later one takes. None: one microbatch, no later backward."""
    sent_back_bytes: float = 0.0
    """In 1F1B's steady state (``MemoryModel.refills``), the new buffers of the gradients the previous
    backward sent back, which torch's schedule holds through the next forward and backward."""
    warmup_send_bytes: float = 0.0
    """In 1F1B's steady state, the storages of what the stage sent for one microbatch it has
    back-propagated, which torch's schedule still holds (``MemoryModel.holds_warmup_send``)."""

    @property
    def optimizer_bytes(self) -> float:
        return self.state_bytes - self.weight_bytes - self.gradient_bytes

    @property
    def per_microbatch(self) -> float:
        return self.activation_bytes + self.received_bytes + self.sent_bytes

    @property
    def additive(self) -> float:
        """What per-node costs add up to: weight state and saved activations in flight."""
        return self.state_bytes + self.activation_bytes * self.in_flight

    @property
    def total(self) -> float:
        """Weight state plus the larger of the steady state (its microbatches, one backward or one
        forward, and the idle receive buffers) and what follows the last backward (every receive
        buffer, and the gradient reduction, the tied-gradient sum or the optimizer step)."""
        held = self.per_microbatch * self.in_flight + self.idle_buffer_bytes
        if self.first_backward_bytes is not None:
            steady = held + max(self.forward_bytes, self.first_backward_bytes) - self.gradient_bytes
        else:
            steady = (held + max(self.backward_bytes, self.forward_bytes) + self.sent_back_bytes
                      + self.warmup_send_bytes)
        if self.later_backward_bytes is not None:
            steady = max(steady, held + self.later_backward_bytes)
        return self.state_bytes + max(steady, max(self.reduce_bytes, self.step_bytes) + self.buffer_bytes)

    def parts(self) -> str:
        """The parts in words, for errors and reports."""
        gathered = f" (unsharded during the step: {self.gathered_bytes:,.0f})" if self.gathered_bytes else ""
        return (f"weights {self.weight_bytes:,.0f}, gradients {self.gradient_bytes:,.0f}, optimizer "
                f"{self.optimizer_bytes:,.0f}{gathered}; per microbatch activations {self.activation_bytes:,.0f}, "
                f"received "
                f"{self.received_bytes:,.0f}, sent {self.sent_bytes:,.0f}, x {self.in_flight} in flight; "
                f"one backward {self.backward_bytes:,.0f}"
                + (f" (the first, making the gradients: {self.first_backward_bytes:,.0f})"
                   if self.first_backward_bytes is not None else "")
                + (f", one forward {self.forward_bytes:,.0f}" if self.forward_bytes > self.backward_bytes else "")
                + (f"; receive buffers of the other microbatches {self.idle_buffer_bytes:,.0f}"
                   if self.idle_buffer_bytes else "")
                + (f"; gradients the previous backward sent back {self.sent_back_bytes:,.0f}"
                   if self.sent_back_bytes else "")
                + (f"; what it sent for a microbatch done {self.warmup_send_bytes:,.0f}"
                   if self.warmup_send_bytes else "")
                + (f"; or the gradient reduction {self.reduce_bytes:,.0f}" if self.reduce_bytes else "")
                + (f"; or the tie sum / optimizer step {self.step_bytes:,.0f}" if self.step_bytes else ""))


def _training(dag: nx.DiGraph, node: str) -> SavedFacts | None:
    """What ``costs.saved`` probed of ``node``, or None."""
    return dag.nodes[node].get("training")


def _aliases(dag: nx.DiGraph, value: str) -> list[str]:
    """``value`` and the values whose storage it is in, in turn (``SavedFacts.views``): what
    ``y.mul_(s).tanh_()`` writes into is ``mul_``'s result, which is ``y``."""
    chain = [value]
    while chain[-1] in dag and (f := _training(dag, chain[-1])) is not None and f.views and f.views not in chain:
        chain.append(f.views)
    return chain


def kept_bytes(dag: nx.DiGraph, node: str) -> float:
    """Bytes of ``node``'s making that autograd keeps for backward, per microbatch (model inputs:
    none, they count as received); without the probe's facts, the bytes its output allocated."""
    data = dag.nodes[node]
    if data.get("input"):
        return 0.0
    facts = data.get("training")
    return float(facts.saved) if facts is not None else float(data.get("allocated") or 0)


def kept_per_node(dag: nx.DiGraph, model: MemoryModel = MemoryModel()) -> dict[str, float]:
    """Per node, ``kept_bytes`` as ``model`` runs it, the additive part a split balances: in the
    compute dtype under mixed precision; none for a node of a block recomputed under activation
    checkpointing (what enters and leaves its block depends on the cuts: ``stage_memory`` counts it)."""
    scale = model.activation_scale(list(dag.graph.get("weights", {}).values()))
    recomputed = model.activation_checkpointing
    return {node: 0.0 if recomputed and _in_block(dag, node) else kept_bytes(dag, node) * scale
            for node in dag.nodes}


def _in_block(dag: nx.DiGraph, node: str) -> bool:
    return bool(checkpoint_regions(dag, [node]))


def node_state_bytes(
    dag: nx.DiGraph, model: MemoryModel = MemoryModel(), apart: AbstractSet[str] = frozenset(),
    assignment: Mapping[str, int] | None = None, gradients: bool = True,
) -> dict[str, float]:
    """Per node: weight, gradient (unless ``gradients`` is False) and optimizer state of the weights
    charged to it, a weight viewing a storage with others its share of it at most (``storage_shares``:
    so that these sum to no more than a stage holds, as a floor must).

    Which reader of a shared weight is charged follows ``costs.ties.weight_payers``.
    """
    # given a gradient by the whole model's backward: a stage's may give more (a zero one for what it sends)
    infos = _as_trained(dag.graph["weights"], trained_weights(dag, list(dag.nodes), (), unprobed_as_read=True))
    shares = model.storage_shares(infos.values())

    def held(info: Weight) -> float:
        weight, gradient, optimizer = model.weight_parts(info)
        return min(weight, shares.get(id(info), weight)) + optimizer + (gradient if gradients else 0.0)
    return {node: sum(held(infos[w]) for w in paid) for node, paid in weight_payers(dag, apart, assignment).items()}


def node_memory(
    dag: nx.DiGraph, model: MemoryModel = MemoryModel(), apart: AbstractSet[str] = frozenset(),
    assignment: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Per node: the state of the weights charged to it, plus its saved activations for one microbatch."""
    state = node_state_bytes(dag, model, apart, assignment)
    kept = kept_per_node(dag, model)
    return {node: state[node] + kept[node] for node in dag.nodes}


@dataclass(frozen=True)
class StageFloor:
    """What a stage holds at least, in parts summed per node and per cut, so that a search over many
    splits judges whole (``stage_memory``) only the stages whose floor fits. ``held``: per node, the
    weights and optimizer state charged to it (a weight's first reader; none to a read of its shape
    only); ``gradients``: their gradients. ``kept``: per node, saved bytes per microbatch in flight, less
    what a stage may not keep (a saved output it sends a copy of, ``_saved_only_later``; a copy of a
    strided value it receives, ``_as_received``). Per stage j, ``received[j]``: per value, what it adds when
    a cut brings it into stage j (once per microbatch in flight on the first stage, the model inputs; once
    per receive buffer on the others); ``sent[j]``: its gradient when a cut takes it out (one backward's
    and, but on the last stage, the buffers'). A stage holds at least the sum of all these parts, the
    gradients only where ``steady_gradients[j]`` (a stage whose forwards all run first may peak before its
    first backward has made them); and, as the step ends, its weight state, gradients included, and its
    receive buffers (``received[j]``, and ``sent[j]`` but on the last stage)."""

    held: Mapping[str, float]
    kept: Mapping[str, float]
    received: Sequence[Mapping[str, float]]
    sent: Sequence[Mapping[str, float]]
    gradients: Mapping[str, float] = dataclasses.field(default_factory=dict)
    steady_gradients: Sequence[bool] = ()


def stage_floor(dag: nx.DiGraph, num_stages: int, model: MemoryModel = MemoryModel()) -> StageFloor:
    """The ``StageFloor`` of ``dag`` split into ``num_stages`` under ``model``."""
    k, scale = num_stages, model.activation_scale(list(dag.graph.get("weights", {}).values()))
    weighted = "weights" in dag.graph
    state = node_state_bytes(dag, model, gradients=False) if weighted else dict.fromkeys(dag.nodes, 0.0)
    whole = node_state_bytes(dag, model) if weighted else state
    held = {v: 0.0 if dag.nodes[v].get("tensor") is False else state[v] for v in dag.nodes}
    gradients = {v: 0.0 if dag.nodes[v].get("tensor") is False else whole[v] - state[v] for v in dag.nodes}
    owners = {u for v in dag.nodes if _strided_output(dag, v) for u in _possible_owners(dag, v)}
    kept = kept_per_node(dag, model)
    for owner in owners:
        facts = _training(dag, owner)
        kept[owner] = max(0.0, kept[owner] - (facts.saved_output * scale if facts is not None else 0.0))
    for v in dag.nodes:  # reading a strided value a cut brings contiguous, a node may save less (``_as_received``)
        facts = _training(dag, v)
        if facts is not None and facts.when_contiguous is not None and facts.when_contiguous[0] < 0:
            kept[v] = max(0.0, kept[v] + facts.when_contiguous[0] * scale)
    buffered = model.step_microbatches(k)
    into = [model.in_flight(0, k), *[buffered] * (k - 1)]
    out_of = [*[buffered] * (k - 1), 1]
    return StageFloor(held, kept, [{v: _scaled(dag, v, scale) * n for v in dag.nodes} for n in into],
                      [{v: _grad(dag, v) * scale * n for v in dag.nodes} for n in out_of], gradients,
                      [not model.makes_gradients(j, k) for j in range(k)])


def _possible_owners(dag: nx.DiGraph, node: str) -> set[str]:
    """Every node ``_owner`` may name for ``node`` under some assignment: itself, the maker its facts
    name, or a node up a chain of inputs that made no storage."""
    found, todo = {node}, [node]
    while todo:
        v = todo.pop()
        if dag.nodes[v].get("input") or dag.nodes[v].get("allocated"):
            continue
        facts = _training(dag, v)
        if facts is not None and facts.views is not None:
            ahead = [facts.views] if facts.views in dag else []  # a maker the graph lacks: the node itself
        else:
            ahead = list(dag.predecessors(v))
        for u in ahead:
            if u not in found:
                found.add(u)
                todo.append(u)
    return found


def _nodes_by_stage(assignment: Mapping[str, int], k: int) -> list[list[str]]:
    """Each stage's nodes in the assignment's order (a split's is the program order the stages run)."""
    stages: list[list[str]] = [[] for _ in range(k)]
    for node, stage in assignment.items():
        stages[stage].append(node)
    return stages


def _grad(dag: nx.DiGraph, node: str) -> float:
    facts = _training(dag, node)
    return float(facts.grad) if facts is not None else 0.0


def _owner(dag: nx.DiGraph, node: str, stage: Mapping[str, int]) -> str:
    """The node of the same stage whose storage ``node``'s value is: itself when it made one; for
    a view, an item or a value passed through, the maker the probe saw (``SavedFacts.views``),
    else (facts without it) the widest input of the same stage, followed to a node that allocated.
    A storage made in another stage or by no node (an input, a weight) leaves ``node`` itself, and so does a
    value of no bytes: a shape carrier, a new tensor of none, keeps no storage of the tensor it carries the shape
    of (a plan file does not say which: it is not ``made_from`` there)."""
    while not dag.nodes[node].get("input") and not dag.nodes[node].get("allocated") \
            and dag.nodes[node].get("bytes", 1):
        facts = _training(dag, node)
        if facts is not None and facts.views is not None:
            return facts.views if stage.get(facts.views) == stage[node] else node
        inputs = [u for u in dag.predecessors(node) if stage.get(u) == stage[node]]
        if not inputs:
            break
        node = max(inputs, key=lambda u: (float(dag.nodes[u].get("bytes") or 0), u))
    return node


def _owners(dag: nx.DiGraph, node: str, stage: Mapping[str, int]) -> set[str]:
    """The nodes of the same stage whose storages ``node``'s value keeps alive: its ``_owner`` and,
    for a container of values other nodes made, each of them (``SavedFacts.holds``)."""
    facts = _training(dag, node)
    held = facts.holds if facts is not None else ()
    return {_owner(dag, node, stage), *(maker for maker in held if stage.get(maker) == stage[node])}


def _parts(dag: nx.DiGraph, node: str) -> tuple[tuple[float, float], ...]:
    """Per storage ``node``'s output made, its bytes and those of them some node saves: as the probe saw
    several (``SavedFacts.parts``), else one, all its output allocated."""
    data, facts = dag.nodes[node], _training(dag, node)
    if facts is not None and facts.parts:
        return facts.parts
    return (float(data.get("allocated") or 0), facts.saved_output if facts is not None else 0),


def _made(dag: nx.DiGraph, node: str) -> set[tuple[str, int]]:
    """The storages ``node``'s output made, each as ``_storages`` names it."""
    return {(node, index) for index in range(len(_parts(dag, node)))}


def _storages(dag: nx.DiGraph, value: str, stage: Mapping[str, int]) -> set[tuple[str, int]]:
    """The storages of the same stage that ``value`` keeps alive (those of its ``_owners``), each as the node
    that made it and its index among the storages of that node's output (``_parts``): an item of a tuple an op
    made of new tensors (``sort``'s values and indices) keeps its own alone (``SavedFacts.part``)."""
    facts = _training(dag, value)
    part, maker = (None, None) if facts is None else (facts.part, facts.views)
    found: set[tuple[str, int]] = set()
    for owner in _owners(dag, value, stage):
        found.update(s for s in _made(dag, owner) if part is None or owner != maker or s[1] in part)
    return found


def _sent_unsaved(dag: nx.DiGraph, sent: Sequence[str], stage: Mapping[str, int],
                  recomputed: AbstractSet[str] = frozenset()) -> float:
    """Bytes the stage keeps only because it sends them: the storages of its sent values that
    nothing saved (a sent view counts the storage it views, once; what a recomputed node saves
    is not kept)."""
    return sum(_unsaved(dag, storage, recomputed) for storage in {s for v in sent for s in _storages(dag, v, stage)})


def _unsaved(dag: nx.DiGraph, storage: tuple[str, int], recomputed: AbstractSet[str] = frozenset()) -> float:
    """Bytes of ``storage`` (``_storages``) that no node saves (none for a model input; all of one a
    recomputed node made)."""
    node, index = storage
    if dag.nodes[node].get("input"):
        return 0.0
    nbytes, saved = _parts(dag, node)[index]
    return max(0.0, float(nbytes) - (0 if node in recomputed else saved))


def _gradients_to(dag: nx.DiGraph, node: str) -> list[tuple[str, bool]]:
    """The inputs ``node``'s backward gives a gradient, each with whether it hands its own on: as
    the probe saw them (``SavedFacts.input_grads``), else every input with a gradient, the widest
    handed on by a node that allocated nothing (a view, an item, a value passed through)."""
    facts = _training(dag, node)
    if facts is not None and facts.input_grads is not None:
        return [(u, handed) for u, handed in facts.input_grads if u in dag and _grad(dag, u) > 0]
    inputs = [u for u in dag.predecessors(node) if _grad(dag, u) > 0]
    if dag.nodes[node].get("allocated") or not inputs:
        return [(u, False) for u in inputs]
    widest = max(inputs, key=lambda u: (float(dag.nodes[u].get("bytes") or 0), u))
    return [(u, u == widest) for u in inputs]


def _trainable_weights(dag: nx.DiGraph, node: str) -> dict[str, float]:
    """The trainable weights ``node``'s backward gives a gradient, with their bytes: those it reads
    that the probe saw get one (``SavedFacts.weight_grads``; all of them where not recorded)."""
    infos = dag.graph.get("weights", {})
    facts = _training(dag, node)
    given = None if facts is None else facts.weight_grads
    return {w: float(infos[w].nbytes) for w in dag.nodes[node].get("weights", ())
            if w in infos and infos[w].trainable and (given is None or w in given)}


def trained_weights(dag: nx.DiGraph, nodes: Sequence[str], sent: Sequence[str],
                    unprobed_as_read: bool = False) -> set[str] | None:
    """The weights that ``nodes`` (a stage, in program order) give a gradient in a backward from the values
    they send (``sent``: what a pipeline sends a gradient back for, a zero one where nothing read it) and
    the model's outputs: walking back from those through the inputs each node's backward gives a gradient,
    those of the reached nodes that the probe saw get one (``_trainable_weights``). A weight read under
    ``torch.no_grad`` or only by a node no gradient reaches (its result dropped, or detached in this stage)
    gets none, nor ``torch.optim`` state (a frozen teacher's stage was charged both: 1.2x-1.7x). A node
    writing in place is reached where what it wrote into is (as ``_backward_peak`` walks). None where a
    node was not probed (every weight counts), unless ``unprobed_as_read``: then such a node is reached as one
    writing nothing in place, and gives every input and weight a gradient (a floor's walk: a set no larger than
    any stage's own walk gives, so that a stage of probed nodes is not charged more than it holds)."""
    reached = {v for v in sent if _grad(dag, v) > 0}
    trained: set[str] = set()
    for node in reversed(nodes):
        data, facts = dag.nodes[node], _training(dag, node)
        if data.get("input"):
            continue
        if facts is None and not unprobed_as_read:
            return None
        writes = facts.writes if facts is not None else ()
        wrote_reached = any(v in reached for u in writes for v in _aliases(dag, u))
        if node in reached or (data.get("output") and (facts is None or facts.grad)) or wrote_reached:
            reached.update(u for u, _ in _gradients_to(dag, node))
            trained.update(_trainable_weights(dag, node))
    return trained


def _as_trained(infos: Mapping[str, Weight], trained: AbstractSet[str] | None) -> Mapping[str, Weight]:
    """``infos`` as a stage (or the model) trains them: a trainable weight ``trained`` leaves out marked not
    trainable, one object a name, so that what looks weights up by identity (storage shares, the model's
    order) finds it; ``infos`` itself where ``trained`` is None."""
    if trained is None:
        return infos
    return {w: info if w in trained or not info.trainable else dataclasses.replace(info, trainable=False)
            for w, info in infos.items()}


def _forward_peak(dag: nx.DiGraph, nodes: Sequence[str], stage: Mapping[str, int], stays: AbstractSet[tuple[str, int]],
                  recomputed: AbstractSet[str] = frozenset(), copied: Sequence[str] = (),
                  unsaved: Sequence[str] = ()) -> float:
    """The most one microbatch's forward holds at once above what it keeps when it ends (what is
    saved; ``stays``: the storages of the values sent and those a checkpoint keeps as they cross
    a region's boundary, as ``_storages`` names them; and the contiguous copies of those sent, ``copied``).
    ``unsaved``: values made again in later stages that other stages' nodes save, not these: alive to the end.
    Walking its nodes in order: each node's own forward peak (``SavedFacts.forward``; without it, its
    output's bytes) on top of what is alive when it starts. A storage nothing saves lives from its maker
    until its last reader here has run (a wide pairwise sum nothing saves, reduced by the next node), or,
    for a value copied to be sent, until the copies made at the end; each storage of a tuple an op made on
    its own (``sort``'s values die with their readers, whatever reads the indices later)."""
    inside = set(nodes)
    last_read: dict[tuple[str, int], int] = {}  # storage -> position of its last reader here
    for i, node in enumerate(nodes):
        for storage in _storages(dag, node, stage):
            last_read.setdefault(storage, i)
        for u in dag.predecessors(node):
            if u in inside:
                last_read.update(dict.fromkeys(_storages(dag, u, stage), i))
    position = {node: i for i, node in enumerate(nodes)}
    for node in nodes:  # a value made again has no edges to its readers (``route_around``): alive until the last
        read = [position[r] for r in dag.nodes[node].get("readers") or () if r in position]
        for storage in _storages(dag, node, stage) if read else ():
            last_read[storage] = max(last_read.get(storage, 0), *read)
    for value in copied:
        last_read.update(dict.fromkeys(_storages(dag, value, stage), len(nodes)))
    freed_at: dict[int, list[tuple[str, int]]] = {}
    for storage, i in last_read.items():
        if storage[0] in inside and storage not in stays:
            freed_at.setdefault(i, []).append(storage)
    alive = peak = 0.0
    for i, node in enumerate(nodes):
        data, facts = dag.nodes[node], _training(dag, node)
        if not data.get("input"):
            own = facts.forward if facts is not None and facts.forward is not None else data.get("allocated")
            peak = max(peak, alive + float(own or 0))
            alive += (0.0 if node in recomputed else kept_bytes(dag, node)) + sum(
                _unsaved(dag, storage, recomputed) for storage in _made(dag, node))
        alive -= sum(_unsaved(dag, storage, recomputed) for storage in freed_at.get(i, ()))
    copies = sum(float(dag.nodes[value]["bytes"]) for value in copied)
    peak = max(peak, alive + copies)
    alive += copies - sum(_unsaved(dag, storage, recomputed) for storage in freed_at.get(len(nodes), ()))
    alive -= sum(_saved_only_later(dag, owner, inside) for owner in {_owner(dag, v, stage) for v in copied})
    alive -= sum(kept_bytes(dag, v) for v in unsaved)
    return max(0.0, peak - alive)


def _saved_only_later(dag: nx.DiGraph, owner: str, inside: AbstractSet[str]) -> float:
    """The bytes of ``owner``'s output that only nodes outside ``inside`` save: a stage that sends a
    contiguous copy of a view of it (``SavedFacts.strided_output``) keeps it no longer than its forward."""
    facts = _training(dag, owner)
    if facts is None or any(maker == owner for n in inside if (saver := _training(dag, n)) is not None
                            for maker, _ in saver.releases):
        return 0.0
    return float(facts.saved_output)


def _crossed_permuted(dag: nx.DiGraph, value: str) -> bool:
    facts = _training(dag, value)
    return facts is not None and facts.dense_order is not None


def _strided_output(dag: nx.DiGraph, node: str) -> bool:
    facts = _training(dag, node)
    return facts is not None and facts.strided_output


def _as_received(dag: nx.DiGraph, nodes: Sequence[str], received: AbstractSet[str]) -> nx.DiGraph:
    """``dag`` with the facts of ``nodes`` that read a value of ``received`` laid out otherwise than
    contiguous, or write into one in place (an autograd view where it is made, a Linear's on a 3-D
    input, but none as received), taken as they are when it comes as the stage receives it, a new
    contiguous tensor (``SavedFacts.when_contiguous``): where any changes, a view of ``dag`` holding the
    changed nodes' data (networkx's ``generic_graph_view``, its edges shared: copying the whole graph took
    a fifth of a judgment of the exact search), else ``dag`` itself."""
    strided = {v for v in received if _strided_output(dag, v)}
    changed: dict[str, SavedFacts] = {}
    for node in nodes:
        facts = _training(dag, node)
        if facts is None or facts.when_contiguous is None or not (
                strided.intersection(dag.predecessors(node)) or received.intersection(facts.writes)):
            continue
        own, forward, backward, strided_grads = facts.when_contiguous
        releases = dict(facts.releases)
        releases[node] = releases.get(node, 0) + own
        changed[node] = dataclasses.replace(
            facts, saved=facts.saved + own, forward=forward, backward=backward, backward_when_sent=None,
            backward_alone=None, strided_grads=strided_grads, strided_when_sent=strided_grads,
            releases=tuple((m, b) for m, b in releases.items() if b > 0))
    if not changed:
        return dag
    view = nx.graphviews.generic_graph_view(dag)
    view._node = {**dict(dag.nodes(data=True)), **{v: {**dag.nodes[v], "training": f} for v, f in changed.items()}}
    return view


def _backward_peak(dag: nx.DiGraph, nodes: Sequence[str], sent: AbstractSet[str], through: Sequence[str],
                   stays: AbstractSet[str], output_grads: float, recomputed: RecomputedBackward,
                   fresh_output_grads: bool = False, making_gradients: bool = False) -> tuple[float, float]:
    """The most one microbatch's backward adds to what the stage holds, and the new buffers of the
    gradients it sends back: walking its nodes in reverse, the output gradients, the gradients
    alive and the node's own backward peak, less the saved storages the nodes already run have
    released.

    A value's gradient is a buffer that lives until no value holds it any more. A backward that
    hands its gradient on (a view's, an item's, an addition's to each addend: ``_gradients_to``)
    makes none: its inputs hold the one it got. A value sent (made here, ``sent``, or passed
    ``through``) holds the gradient received, counted in ``output_grads``, and its maker's backward
    starts from that buffer's layout (``SavedFacts.backward_when_sent``), as does a node it is handed
    to unchanged (an addend: ``SavedFacts.backward_when_handed``). Autograd adds a
    further gradient into a buffer only a value's own; into one it holds with others, or the one
    received, it cannot, so the sum is a new buffer. A value the stage received keeps its
    gradient to the end, to send it back: after every node (the stage reads what it receives
    first, through ``runtime.wire.contiguous_grad``, and autograd runs that last, once the other
    nodes have let go of the buffers they shared with it), autograd takes the buffer it holds
    when nothing else holds it and it is contiguous (``SavedFacts.strided_grads``), else copies
    it; the received gradient itself, handed back through views (a stage that only passes a value
    on: an item, a view, a transpose sent permuted, whose receive buffer is laid out as it is), it
    takes as it is, but copies it where handed back itself (an addition's: the receive buffer still
    holds it). The storages of the values sent (``stays``: their makers, ``_owners``) outlive the
    microbatch's backward. Under checkpointing (``recomputed``) a region's forward runs again as its
    backward starts, adding what its own nodes save, which their releases free again; a storage
    entering or leaving a region is freed when its last holder is done
    (``costs.recompute.RecomputedBackward``). A weight read by several nodes here gets its gradient
    in parts, which autograd holds until the last. ``making_gradients``: the weights have no gradient
    yet (the step's first backward after ``zero_grad``), so autograd keeps each one's first as it is,
    to the step's end, where it would add it into the existing one and free it. The peak is checked
    before each node and once after the last, when the last copies have been made.
    ``fresh_output_grads``: the output gradients are new each backward (the last stage's come from
    the loss), not receive buffers the runtime keeps."""
    inside = set(nodes)
    buffer: dict[str, str | None] = dict.fromkeys([*sent, *through])  # value -> its gradient's (None: received)
    holders: dict[str, int] = {}  # buffer (named by the value it was made for) -> values holding it
    # the items taken here out of a container received, at any depth: the wire receives each tensor as one
    # of its own, whose gradient is sent back as it is (the containers get none), so each item stands for
    # one received; an item that is itself a container (an LSTM's ``(h, c)``) hands nothing on
    received_items: set[str] = set()
    inner: set[str] = set()
    for node in nodes:
        facts = _training(dag, node)
        if facts is not None and any(u in inner or (u not in inside and _is_container(dag, u))
                                     for u in facts.passes_on):
            # (one sent on whole gets the gradients of its items from the next stage, copied as an item's)
            (inner if _is_container(dag, node) and node not in buffer else received_items).add(node)
    # the values received that nodes here give a gradient (or the items standing for them), in the order first read
    read = list(dict.fromkeys(value for node in nodes if node not in inner for value in (
        [node] if node in received_items else [u for u, _ in _gradients_to(dag, node) if u not in inside])))
    readers: dict[str, int] = {}  # trainable weight -> nodes here whose backward has still to give it a part
    for node in nodes:
        for w in _trainable_weights(dag, node):
            readers[w] = readers.get(w, 0) + 1
    parts: set[str] = set()  # the weights whose parts autograd holds
    strided: set[str] = set()  # the values whose gradient is a non-contiguous one, handed to them alone
    viewed: set[str] = set()  # the values whose gradient is a view of the one received (a view's backward made it)
    alive = freed = peak = 0.0

    def hold(value: str, held: str | None) -> None:
        nonlocal alive
        buffer[value] = held
        if held is not None:
            alive += _grad(dag, held) if held == value else 0.0
            holders[held] = holders.get(held, 0) + 1

    def release(held: str | None) -> None:
        nonlocal alive
        if held is not None:
            holders[held] -= 1
            alive -= 0.0 if holders[held] else _grad(dag, held)

    def shared(value: str) -> bool:
        """Whether ``value``'s gradient is the one received or a buffer other values hold too."""
        held = buffer[value]
        return held is None or (held != value and holders[held] > 1)

    # of a maker whose output stays (sent), the other storages it saved (its own temporaries) are freed
    temporaries = {maker: float(f.saved - f.saved_output) for maker in stays if maker in inside
                   and (f := _training(dag, maker)) is not None}

    def releasing(node: str, facts: SavedFacts) -> Iterator[tuple[str, float, bool]]:
        """The saved storages of this stage ``node``'s backward frees, by maker, with their bytes and whether
        they are temporaries of a maker whose output stays."""
        for maker, nbytes in facts.releases:
            if maker not in inside or recomputed.held_elsewhere(node, maker):
                continue
            if maker in stays and not recomputed.is_copy(node, maker):
                # only its own backward frees its temporaries: another node's release of it is of the storage sent
                yield maker, min(float(nbytes), temporaries.get(maker, 0.0)) if maker == node else 0.0, True
            else:
                yield maker, float(nbytes), False
    sent_views = {f.views for v in sent if (f := _training(dag, v)) is not None and f.views and not f.strided_output}
    # the values whose gradient is a receive buffer, handed on unchanged: the order that buffer is laid out in
    handed_order = {v: (f.dense_order or ()) if (f := _training(dag, v)) is not None else () for v in sent}
    # the sent values whose gradient is a sum autograd made by adding another into the receive buffer: the sum
    # takes the layout of its first operand, the buffer's (``handed_order``), and is handed on as that buffer is
    summed_received: set[str] = set()

    def as_received(value: str | None) -> bool:
        """Whether ``value``'s gradient is laid out as a sent value's receive buffer: that buffer, or a sum into it."""
        return value is not None and (buffer.get(value, "") is None or buffer.get(value) in summed_received)
    # the nodes whose value is a container of tensors (a ``ModelOutput``), not a tensor
    containers = {n for n in nodes if _is_container(dag, n)}
    # those an op makes whole (``chunk``, ``split``, an LSTM's outputs), whose backward takes the gradients of
    # all its items at once, each as autograd holds it: not a sum into one buffer of the tuple's size
    made_whole = {n for n in containers if (f := _training(dag, n)) is not None and not f.passes_on}
    items: dict[str, list[str | None]] = {}  # such a tuple -> the gradients its items handed it
    for node in reversed(nodes):
        freed -= recomputed.recomputed_at.get(node, 0.0)
        facts = _training(dag, node)
        if facts is None or node in inner:
            freed += recomputed.released_after.get(node, 0.0)
            continue
        # a write in place that nothing reads: its readers, routed to the value it wrote into (or one in the
        # same storage), gave that value the gradient its backward starts from, which what it gives replaces
        replaced = {u: next((v for v in _aliases(dag, u) if v in buffer), u) for u in facts.writes
                    if node not in buffer}
        if node not in buffer and not any(v in buffer for v in replaced.values()):
            continue  # no gradient reached its output, nor the value it wrote into: autograd runs none of its backward
        given = [] if node in received_items else [(replaced.get(u, u), handed)
                                                   for u, handed in _gradients_to(dag, node)]
        # a value sent, or one whose gradient is the received buffer handed back through a view of its own
        # storage that was sent whole (a transpose crossing permuted): its backward starts from a gradient
        # laid out as a new tensor
        from_buffer = node in sent or (node in buffer and buffer[node] is None and node in sent_views)
        own = facts.backward_when_sent if from_buffer and facts.backward_when_sent is not None else facts.backward
        if not from_buffer and node in handed_order and as_received(node):  # a receive buffer, as the value sent
            own = dict(facts.backward_when_handed).get(handed_order[node], own)
        # the gradient it starts from, where no other value holds it, autograd frees once its first function has run
        incoming = buffer[node] if node in buffer else next((buffer[v] for v in replaced.values() if v in buffer), None)
        if facts.backward_alone is not None and not from_buffer and incoming is not None and holders[incoming] == 1:
            own = facts.backward_alone
        own += facts.gradients_kept if making_gradients else 0
        peak = max(peak, output_grads + alive + own - freed)
        # adding a gradient into one that exists may take a new buffer for the sum, while the gradients
        # the backward made (of its inputs and weights) still live
        summed = max((_grad(dag, u) for u, _ in given if u in buffer and u not in replaced.values()
                      and u not in made_whole), default=0.0)  # (an item's gradient is held, not summed)
        if summed:  # by then autograd has dropped the gradient the node got, where nothing else holds it
            weights = _trainable_weights(dag, node)
            # a backward that gives its weights their gradients first: autograd has added those read by no
            # other node still to run here into theirs, and freed the parts it held of them
            added = {w for w in weights if facts.weights_first and readers[w] == 1 and not making_gradients}
            made = sum(_grad(dag, u) for u, handed in given if not handed) + sum(
                nbytes for w, nbytes in weights.items() if w not in added)
            got = buffer.get(node)  # its own, or one handed to it that the others holding it have let go of
            dropped = _grad(dag, got) if got is not None and holders.get(got) == 1 else 0.0
            dropped += sum(weights[w] for w in added & parts)
            # autograd adds a gradient the backward made once the node has returned and released what it saved
            # (a storage that stays, sent, counted as held to then); one it hands on, before: a node in place,
            # its readers routed around it, makes a new one
            released = sum(nbytes for _, nbytes, _ in releasing(node, facts))
            handed = max((_grad(dag, u) for u, hands in given if hands and u in buffer), default=0.0)
            # what it made, as it returns beside all it saved and once it has released that, but no more than its
            # probed peak (``own``): a node of several functions (a module kept whole) has freed most of what it
            # saved by then, and, but where its weights have no gradient yet, added those it made early into theirs
            returned, after = min(made - dropped, float(own)), min(made - dropped - released, float(own))
            peak = max(peak, output_grads + alive - freed + max(returned + handed, after + summed))
        # what this stage made and kept for this backward alone (what ``stays`` was sent)
        for maker, nbytes, temporary in releasing(node, facts):
            if temporary:
                temporaries[maker] = temporaries.get(maker, 0.0) - nbytes
            freed += nbytes
        freed += recomputed.released_after.get(node, 0.0)
        mine = None if node in received_items else buffer.pop(node, None)  # (an item received keeps its own)
        # a value sent permuted gets its gradient in a buffer laid out as it is, which a view hands back in
        # its input's layout, where the probe's gradient, laid out as a new tensor, came back strided
        permuted_buffer = node in sent and _crossed_permuted(dag, node)
        for u, handed in given:
            if u in made_whole and handed and u in facts.passes_on:  # an item of a tuple an op made here
                items.setdefault(u, []).append(mine)  # held as it is until that op's backward takes them all
                if mine is not None:
                    holders[mine] += 1
                buffer.setdefault(u, None)  # (no buffer of its own)
                continue
            if u not in buffer:
                hold(u, mine if handed else u)
                if handed and (mine is None or mine in summed_received) and node in handed_order \
                        and u in facts.passes_on:
                    handed_order[u] = handed_order[node]
                # (through a view: a new tensor viewing the buffer; not a container's, which hands each item the
                # gradient itself, as an addition does)
                itself = node in containers and u in facts.passes_on
                if handed and mine is None and (facts.views is not None or node in viewed) and not itself:
                    viewed.add(u)
                if node in sent and mine is None and facts.strided_when_sent is not None:
                    # its gradient is the receive buffer, laid out as the first probe's (a new tensor): a view of a
                    # permuted one hands a transpose's input its layout, but a slice of it (a cat's) is strided still
                    if u in facts.strided_when_sent:
                        strided.add(u)
                elif u in facts.strided_grads and not (handed and permuted_buffer):
                    strided.add(u)
            elif shared(u) or u in strided:  # the sum is a new buffer
                if buffer[u] is None and u in handed_order:
                    summed_received.add(u)
                release(buffer[u])
                hold(u, u)
                strided.discard(u)
        release(mine)
        for item in items.pop(node, ()):  # its backward has taken its items' gradients
            release(item)
        # a weight read by several nodes here: autograd holds the parts given so far, adding each new
        # one into a new buffer, and the last sum into the weight's gradient (a Linear applied twice)
        for w, nbytes in _trainable_weights(dag, node).items():
            readers[w] -= 1
            if w in parts:
                peak = max(peak, output_grads + alive + 2 * nbytes - freed)  # held, the new part, their sum
                if not readers[w]:
                    parts.discard(w)
                    alive -= 0.0 if making_gradients else nbytes  # the sum is the gradient kept
            elif readers[w]:
                parts.add(w)
                alive += nbytes
            elif making_gradients:  # its one part is its gradient, kept
                alive += nbytes
        if making_gradients and facts.gradient_copies:
            # autograd keeps a copy of each one not laid out as its weight is, made beside it once the node's
            # backward has returned (its releases done, the gradient it got dropped), then frees it
            peak = max(peak, output_grads + alive + facts.gradient_copies - freed)
    for u in (u for u in read if u in buffer):  # (a value whose readers here no gradient reaches gets none)
        # its read (``contiguous_grad``) ran first, so its backward runs after every other node's, which have
        # let go of the buffers they shared with it by then: autograd copies it into the one sent back if
        # another value received still holds that buffer or it is strided, unless it crossed permuted: then it
        # comes through the permutes' views, which autograd takes whole if laid out in that order
        # the gradient received, handed back through a view: taken as it is; handed back itself (by an
        # addition), the receive buffer still holds it, so autograd copies it
        received_back = buffer[u] is None and u in viewed
        if (shared(u) and not received_back and not _crossed_permuted(dag, u)) or u in strided:
            peak = max(peak, output_grads + alive + _grad(dag, u) - freed)  # beside the one it copies
            release(buffer[u])
            hold(u, u)
    for value in through:
        # no node here reads it: copied after every other (its read ran first), as autograd cannot take
        # the buffer received; one that crossed permuted reaches it through the permutes' views, and
        # autograd takes a view whole (``runtime.wire``)
        if value not in read and not _crossed_permuted(dag, value):
            hold(value, value)
    # not a receive buffer: the last stage's output gradients come new each backward (the loss's), so one handed
    # back as it is (a value passed on) is sent back in a buffer of its own too
    sent_back = {u if buffer[u] is None else buffer[u] for u in [*read, *through]
                 if u in buffer and (buffer[u] is not None or fresh_output_grads)}
    # with the copies of the last gradients received
    return max(peak, output_grads + alive - freed), sum(_grad(dag, b) for b in sent_back)


def _is_container(dag: nx.DiGraph, value: str) -> bool:
    """Whether ``value`` is a container of tensors (a tuple, a ``ModelOutput``), not a tensor."""
    meta = dag.nodes[value].get("value_meta")
    return meta is not None and getattr(meta, "shape", None) is None


def _scaled(dag: nx.DiGraph, value: str, scale: float) -> float:
    """Bytes of ``value`` under mixed precision: a floating tensor takes the compute dtype."""
    data = dag.nodes[value]
    dtype = str(getattr(data.get("value_meta"), "dtype", ""))
    return float(data["bytes"]) * (scale if "float" in dtype else 1.0)


def _is_loss(dag: nx.DiGraph, outputs: Sequence[str]) -> bool:
    """Whether the model's output is one tensor of one element: a loss, which
    ``torch.distributed.pipelining`` keeps for every microbatch until the step ends."""
    shape = getattr(dag.nodes[outputs[0]].get("value_meta"), "shape", None) if len(outputs) == 1 else None
    return shape is not None and all(size == 1 for size in shape)


def _in_model_order(infos: Mapping[str, Weight], held: Sequence[Weight]) -> list[Weight]:
    """``held`` in the order of ``infos`` (the model's ``named_parameters``), the order the stage's optimizer
    steps them: a looping step holds the one before beside the one it steps (ViT's position embeddings before
    its patch projection; in program order the projection came first: 2,176 bytes short)."""
    position = {id(info): i for i, info in enumerate(infos.values())}
    return sorted(held, key=lambda info: position.get(id(info), len(position)))


def _units(infos: Mapping[str, Weight], names: Sequence[str]) -> list[list[Weight]]:
    """A stage's weights grouped as FSDP shards them: one unit per block, one for the rest."""
    units: dict[str | None, list[Weight]] = {}
    for name in names:
        parts = name.split(".")
        block = block_path(".".join(parts[:i]) for i in range(1, len(parts)))
        units.setdefault(block, []).append(infos[name])
    return list(units.values())


@dataclass(frozen=True)
class _Surroundings:
    """What one stage's count reads of the rest of its split: the values crossing its cuts in program order
    (``into`` it, none into the first stage; ``outgoing``, the model's ``outputs`` out of the last), the weights
    charged to each of its nodes (``payers``: ``costs.ties.weight_payers``, once per stage), the weights other
    stages hold too (``tied``), its part of the tied-gradient sum (``tie_sum``: ``tie_sum_bytes``) and the nodes it
    computes again though a partition places them in another stage (``also``: ``graph.partition.also_run``)."""

    into: Sequence[str]
    outgoing: Sequence[str]
    outputs: Sequence[str]
    payers: Mapping[str, Sequence[str]]
    tie_sum: float
    tied: AbstractSet[str]
    also: Sequence[str] = ()


def stage_memory(
    dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int, model: MemoryModel = MemoryModel(),
    stages: AbstractSet[int] | None = None,
) -> list[StageMemory]:
    """The training memory of every stage of ``assignment`` (of ``stages`` only, when given), shared weights
    once per stage. (The exact search judges one stage of a contiguous split at a time: ``ContiguousStages``.)"""
    k = num_stages
    payers = weight_payers(dag, assignment=assignment)
    crossing = boundary_values(dag, assignment, k)
    outputs = _outputs(dag)
    tie_sum, tied = _ties(dag, payers, assignment, k, model)
    scale = model.activation_scale(list(dag.graph.get("weights", {}).values()))
    also = also_run(dag, assignment)
    return [_stage_memory(dag, assignment, k, model, scale, j, nodes, _Surroundings(
                crossing[j - 1] if j else [], crossing[j] if j < k - 1 else outputs, outputs, payers, tie_sum[j], tied,
                _run_by(also, j)))
            for j, nodes in enumerate(_nodes_by_stage(assignment, k)) if stages is None or j in stages]


class ContiguousStages:
    """``stage_memory`` of one stage at a time of the splits of ``rest`` into contiguous stages (the model
    ``inputs`` in the first), as the exact search judges them (``costs.split_search.program_order``): the same
    count, from the stage's own nodes, the values crossing its two cuts (``graph.partition.Cuts``: each cut's
    found once) and the readers of shared weights (``shared_payers``), where ``stage_memory`` walks the whole
    graph for each."""

    def __init__(self, dag: nx.DiGraph, inputs: Sequence[str], rest: Sequence[str], num_stages: int,
                 model: MemoryModel = MemoryModel()) -> None:
        self.dag, self.inputs, self.rest, self.k, self.model = dag, inputs, rest, num_stages, model
        self.cuts = Cuts(dag, inputs, rest)
        self.outputs = _outputs(dag)
        self.shared = shared_payers(dag)
        self.index = {v: i for i, v in enumerate(dag.nodes)}  # the order ``weight_payers`` charges in
        self.scale = model.activation_scale(list(dag.graph.get("weights", {}).values()))
        self.again = made_again(dag)

    def stage(self, j: int, a: int, b: int) -> StageMemory:
        """Stage j's memory when it runs ``rest[a:b]`` (``graph.partition.stage_between``)."""
        assignment = stage_between(self.inputs, self.rest, j, a, b)
        nodes = [*self.inputs, *self.rest[:b]] if j == 0 else list(self.rest[a:b])
        payers = weight_payers(self.dag, assignment=assignment, nodes=sorted(nodes, key=self.index.__getitem__))
        tie_sum, tied = _ties(self.dag, self.shared, assignment, self.k, self.model)
        also = also_run(self.dag, assignment, self.again)
        return _stage_memory(self.dag, assignment, self.k, self.model, self.scale, j, nodes, _Surroundings(
            self.cuts.crossing(a) if j else [], self.cuts.crossing(b) if j < self.k - 1 else self.outputs,
            self.outputs, payers, tie_sum[j], tied, _run_by(also, j)))


def _run_by(also: Mapping[str, AbstractSet[int]], j: int) -> list[str]:
    """The nodes of ``also`` (``also_run``'s) that stage j computes again."""
    return [v for v, running in also.items() if j in running]


def _outputs(dag: nx.DiGraph) -> list[str]:
    return [v for v, output in dag.nodes(data="output") if output]


def _ties(dag: nx.DiGraph, payers: Mapping[str, Sequence[str]], assignment: Mapping[str, int], k: int,
          model: MemoryModel) -> tuple[list[float], set[str]]:
    """Per stage, its part of the tied-gradient sum (``tie_sum_bytes``), and the weights several stages hold:
    their holders found from ``payers`` (``weight_payers``'s, or ``shared_payers``)."""
    holders = weight_holders(payers, assignment)
    return tie_sum_bytes(dag.graph.get("weights", {}), holders, k, model), {w for w, s in holders.items() if len(s) > 1}


def _stage_memory(dag: nx.DiGraph, assignment: Mapping[str, int], k: int, model: MemoryModel, scale: float,
                  j: int, nodes: Sequence[str], around: _Surroundings) -> StageMemory:
    """The training memory of stage j of ``assignment``, which runs ``nodes`` (in order), in ``around``."""
    infos = dag.graph.get("weights", {})
    if j == 0:
        received = sum(_scaled(dag, v, scale) for v in nodes if dag.nodes[v].get("input"))
    else:
        received = sum(_scaled(dag, v, scale) for v in around.into)
    stage_dag = _as_received(dag, nodes, set(around.into)) if j else dag
    outgoing = around.outgoing
    trained = trained_weights(stage_dag, nodes, outgoing)
    names = [w for node in nodes for w in around.payers[node]]
    paid = set(names)
    # ``TiedGradients.sync`` writes the summed gradient into every holder of a weight several stages
    # hold, whether this stage's backward gave it one or not (read under torch.no_grad here): it has one
    stage_infos = _as_trained({w: info for w, info in infos.items() if w in paid},
                              None if trained is None else trained | around.tied)
    held = [stage_infos[w] for w in names]
    parts = [model.weight_parts(info) for info in held]
    weights, grads, optimizer = (sum(p[i] for p in parts) for i in range(3))
    weights += model.storage_bytes(held)
    made_here = [v for v in outgoing if assignment[v] == j]
    output_grads = sum(_grad(stage_dag, v) for v in outgoing)
    through = [v for v in outgoing if assignment[v] < j]  # passed on as received
    regions = checkpoint_regions(stage_dag, nodes) if model.activation_checkpointing else []
    recomputed = {n for run in regions for n in run}
    # sent as contiguous copies (the last stage's outputs are handed back as they are, views keeping their bases)
    copied = [v for v in made_here if j < k - 1 and _strided_output(stage_dag, v)]
    dense = [v for v in made_here if v not in copied]
    sent = (_sent_unsaved(stage_dag, dense, assignment, recomputed)
            + sum(float(stage_dag.nodes[v]["bytes"]) for v in copied)) * scale
    sent_storages = {owner for v in dense for owner in _owners(stage_dag, v, assignment)}
    sent_parts = {storage for v in dense for storage in _storages(stage_dag, v, assignment)}
    recompute = recomputed_backward(
        stage_dag, nodes, regions, lambda n: kept_bytes(stage_dag, n),
        lambda n: None if (f := _training(stage_dag, n)) is None else f.releases,
        functools.partial(_owners, stage_dag, stage=assignment), sent_storages)
    kept = checkpointed_kept(nodes, recompute, lambda n: kept_bytes(stage_dag, n))
    kept -= sum(_saved_only_later(stage_dag, owner, set(nodes))
                for owner in {_owner(stage_dag, v, assignment) for v in copied})
    # a mask made again in each stage reading it is kept where a reader of the stage saves it, wherever it is
    # placed; in the stage placing it, unsaved, it lives through the forward alone (``_forward_peak``)
    unsaved = [v for v in nodes if v not in recomputed and stage_dag.nodes[v].get("readers")
               and kept_bytes(stage_dag, v) and not _saved_in(stage_dag, v, nodes)]
    kept += sum(kept_bytes(stage_dag, v) for v in around.also if _saved_in(stage_dag, v, nodes))
    kept -= sum(kept_bytes(stage_dag, v) for v in unsaved)
    walk = functools.partial(_backward_peak, stage_dag, nodes, set(made_here), through, sent_storages,
                             output_grads, recompute, j == k - 1)
    backward, sent_back = (nbytes * scale for nbytes in walk())
    backward += sum(model.fresh_gradient_bytes(info) for info in held)
    # what crosses a region's boundary is kept, not freed after its last reader
    stays = sent_parts.union(*(_made(stage_dag, owner) for owner in recompute.boundary))
    forward = _forward_peak(stage_dag, nodes, assignment, stays, recomputed, copied, unsaved) * scale
    in_flight, buffered = model.in_flight(j, k), model.step_microbatches(k)
    received_buffer = received  # the first stage's: the step's whole batch, which it is handed
    gradient_buffer = output_grads * scale if j < k - 1 else 0.0  # the last's come from the loss
    losses = sent if j == k - 1 and _is_loss(dag, around.outputs) else 0.0  # freed as the step ends
    idle = (received_buffer + losses) * (buffered - in_flight) + gradient_buffer * (buffered - 1)
    first_backward = later = None
    if model.makes_gradients(j, k):
        first_backward = walk(making_gradients=True)[0] * scale
    if model.forwards_first(j, k) and in_flight > 1:
        # each backward frees its microbatch's activations and what it sent (the last stage's loss the
        # schedule keeps), and sends back the gradients of what it received, which the schedule holds:
        # the most at the second backward, or, where it holds more than it frees, at the last it holds
        growth = sent_back - (kept * scale + sent - losses)
        later = backward + growth * (model.sends_held(j, k) if growth > 0 else 1)
    warmup_send = 0.0
    if model.holds_warmup_send(j, k):
        warmup_send = (sum(_parts(stage_dag, o)[index][0] for o, index in sent_parts
                           if not stage_dag.nodes[o].get("input"))
                       + sum(float(stage_dag.nodes[v]["bytes"]) for v in copied)) * scale
    return StageMemory(
        j, weights + grads + optimizer, kept * scale, in_flight,
        buffer_bytes=(received_buffer + gradient_buffer) * buffered,
        idle_buffer_bytes=idle,
        received_bytes=received, sent_bytes=sent, output_grad_bytes=output_grads * scale,
        backward_bytes=backward,
        forward_bytes=forward + gradient_buffer,  # the buffer the next backward starts from exists already
        weight_bytes=weights, gradient_bytes=grads,
        gathered_bytes=sum(sum(model.gathered_parts(info)) for info in held),
        reduce_bytes=model.reduce_bytes(_units(stage_infos, names)),
        step_bytes=max(0.0, model.reduced_bytes(held)
                       + max(around.tie_sum, model.step_bytes(_in_model_order(stage_infos, held)))),
        first_backward_bytes=first_backward, later_backward_bytes=later,
        sent_back_bytes=sent_back if model.refills(j, k) else 0.0, warmup_send_bytes=warmup_send)


def _saved_in(dag: nx.DiGraph, value: str, nodes: Sequence[str]) -> bool:
    """Whether a node of ``nodes`` saves ``value``'s storage for backward (``SavedFacts.saves_from``); facts
    without it (a plan file from before) may: so counted."""
    facts = [f for n in nodes if (f := _training(dag, n)) is not None]
    return any(f.saves_from is None or value in f.saves_from for f in facts)


def shared_payers(dag: nx.DiGraph) -> dict[str, tuple[str, ...]]:
    """The nodes that may be charged for a weight several of them read (``costs.ties.weight_payers``: not a
    read of its shape alone), each with those weights, in the DAG's order: ``weight_holders`` finds every
    stage holding such a weight from these alone (a weight one node reads is held by one stage)."""
    readers: dict[str, int] = {}
    for node, names in dag.nodes(data="weights", default=()):
        if dag.nodes[node].get("tensor") is not False:
            for w in set(names):
                readers[w] = readers.get(w, 0) + 1
    return {node: shared for node, names in dag.nodes(data="weights", default=())
            if dag.nodes[node].get("tensor") is not False and (shared := tuple(w for w in names if readers[w] > 1))}


def weight_holders(payers: Mapping[str, Sequence[str]], assignment: Mapping[str, int]) -> dict[str, set[int]]:
    """Each weight's stages (``payers`` charges it once per stage holding it)."""
    holders: dict[str, set[int]] = {}
    for node, paid in payers.items():
        for w in paid:
            holders.setdefault(w, set()).add(assignment[node])
    return holders


def tie_sum_bytes(infos: Mapping[str, Weight], holders: Mapping[str, AbstractSet[int]], num_stages: int,
                  model: MemoryModel) -> list[float]:
    """Per stage, the buffer ``TiedGradients.sync`` sums tied gradients in, counted on each rank's
    first stage: one flat buffer of every trainable weight held on two ranks or more (every rank
    makes it, holder or not, for one all-reduce), and the largest held by several stages of one
    rank alone (summed one at a time); a rank's part of each under FSDP. ``holders``: each weight's
    stages (``weight_holders``)."""
    ranks = num_stages // model.stages_per_rank
    across, one_rank = 0.0, [0.0] * ranks
    for w, stages in holders.items():
        if len(stages) < 2 or not infos[w].trainable:
            continue
        part = infos[w].nbytes / (model.shards if is_parameter(infos[w]) else 1)
        on = {s % ranks for s in stages}
        if len(on) > 1:
            across += part
        else:
            rank = on.pop()
            one_rank[rank] = max(one_rank[rank], part)
    return [across + one_rank[j] if j < ranks else 0.0 for j in range(num_stages)]


def memory_shortfall(stages: Sequence[StageMemory], max_memory: Sequence[float]) -> str | None:
    """What the stage furthest over its budget needs and lacks, and which others are over (a budget
    raised by the first one's shortfall alone left the others over), or None when every stage fits."""
    over = [(stage.total - budget, stage, budget) for stage, budget in zip(stages, max_memory) if stage.total > budget]
    if not over:
        return None
    short, stage, budget = max(over, key=lambda o: (o[0], -o[1].stage))
    others = [f"stage {s.stage} by {lack:,.0f}" for lack, s, _ in over if s is not stage]
    return (f"stage {stage.stage} needs {stage.total:,.0f} bytes ({stage.parts()}) "
            f"but max_memory[{stage.stage}] is {amount(budget)}: {plural(short, 'byte')} short"
            f"{' (also over: ' + ', '.join(others) + ')' if others else ''}; "
            f"raise the budget, add stages or lower the batch")


def check_memory_budgets(stages: Sequence[StageMemory], max_memory: Sequence[float]) -> None:
    """Raise ``InfeasibleSplitError`` naming the first stage whose memory exceeds its budget."""
    short = memory_shortfall(stages, max_memory)
    if short is not None:
        raise InfeasibleSplitError(short)
