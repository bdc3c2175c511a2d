"""Training memory per stage, for ``cost=memory``, ``max_memory`` budgets and plan reports.

What a stage holds at its peak, in the steady state of its schedule (a backward running while
its other microbatches wait), part by part:

* weight state, once per distinct weight (a shared one once per stage holding it): the weight;
  for a trainable one its gradient (the weight's dtype) and the optimizer state
  (``optimizer_bytes_per_param`` per element: Adam and AdamW 8, two fp32 moments; SGD with
  momentum 4; SGD and none 0), plus an fp32 master copy of a weight narrower than fp32 when
  ``master_weights`` (mixed precision);
* per microbatch in flight: the activations autograd saves (measured per node on fake tensors,
  ``costs.saved``, modules and functions kept whole included), the values the stage received
  (kept until their gradients are sent back; torch's ``PipelineStage`` keeps a receive buffer
  per microbatch) and the values it sent that nothing saved (kept until their gradients arrive);
* once, the backward of one microbatch: the gradients of its outputs, then, node by node in
  reverse, the gradients alive and the node's own backward peak, less what the nodes already
  run have freed (``backward_bytes``: the most of that above the microbatches held).

Microbatches in flight at stage j of k: ``min(k - j, microbatches)`` under 1F1B, every
microbatch under GPipe, and under interleaved 1F1B what PyTorch's op order keeps (simulated as
``ScheduleInterleaved1F1B`` orders it; see ``interleaved_in_flight``). Measured against
``runtime.measure_stage_memory`` on the examples and a Hugging Face zoo (RESULTS.md, "Memory
accuracy"). A DAG without the probe's facts (a plan file, a graph fake tensors cannot run) falls
back to each node's newly allocated output bytes for its activations and no backward term.

The per-node ``memory`` cost is a node's weight state (each weight charged to one reader,
``costs.ties.weight_payers``) plus its saved activations for one microbatch: additive, what a
splitter balances. The received and sent values and the backward depend on where the cuts are,
so only ``stage_memory`` counts them; ``memory_excess`` says by how much a stage's total exceeds
its additive part, for a split that must tighten its budgets by it.

Extending: data parallelism (ZeRO sharding of gradients and optimizer state over ranks) divides
terms of ``MemoryModel.weight_parts``; activation recomputation changes ``kept_bytes`` (a
recomputed block keeps its inputs, not what it saves) and adds its recompute to the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Mapping, Protocol, Sequence

import networkx as nx

from autoshard.costs.ties import weight_payers
from autoshard.errors import InfeasibleSplitError, InvalidArgumentError
from autoshard.graph.partition import boundary_values

OPTIMIZER_BYTES: dict[str, float] = {"adam": 8.0, "adamw": 8.0, "sgd-momentum": 4.0, "sgd": 0.0, "none": 0.0}
"""fp32 optimizer state bytes per trainable element, by optimizer name."""

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
"""The schedules whose microbatches in flight the model knows."""

_FP32 = 4


class Weight(Protocol):
    """What the model needs of a weight (``lowering.from_fx.WeightInfo`` has it)."""

    numel: int
    nbytes: int
    trainable: bool


def _choice(value: object, name: str, known: Sequence[str]) -> str:
    if not isinstance(value, str) or value.lower() not in known:
        raise InvalidArgumentError(f"unknown {name} {value!r}; known: {', '.join(known)}")
    return value.lower()


def _count(value: object, name: str, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        alternative = " or None" if allow_none else ""
        raise InvalidArgumentError(f"{name} must be a whole number >= 1{alternative}, got {value!r}")


@dataclass(frozen=True)
class SavedFacts:
    """Per node, in bytes: ``saved``, storages it creates that autograd keeps for backward (its
    output's included when any node saves it); ``saved_output``, the part of ``saved`` that is its
    output; ``grad``, the gradient its output receives (floating tensors that require grad);
    ``backward``, the peak its backward adds to what is alive when it starts; ``releases``, per
    node that made them, the saved storages autograd frees once this node's backward has run (it
    is the first node to save them, so the last to use them)."""

    saved: int
    saved_output: int
    grad: int
    backward: int
    releases: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class MemoryModel:
    """How training is run, as far as memory goes.

    ``optimizer`` names the optimizer (``OPTIMIZER_BYTES``); ``optimizer_bytes_per_param``, when
    given, overrides its state bytes per trainable element. ``microbatches`` is the step's count
    (None: as many as the schedule keeps at most, ``k - j`` under 1F1B). ``schedule`` is one of
    ``SCHEDULES``; ``stages_per_rank`` is how many stages each process runs under interleaved
    1F1B (k must divide by it). ``master_weights`` counts an fp32 copy of each trainable weight
    narrower than fp32 (bf16 or fp16 weights, the optimizer stepping in fp32).
    """

    optimizer_bytes_per_param: float | None = None
    microbatches: int | None = None
    optimizer: str = "adam"
    schedule: str = "1f1b"
    stages_per_rank: int = 2
    master_weights: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", _choice(self.optimizer, "optimizer", tuple(OPTIMIZER_BYTES)))
        object.__setattr__(self, "schedule", _choice(self.schedule, "schedule", SCHEDULES))
        bytes_ = self.optimizer_bytes_per_param
        if bytes_ is None:
            object.__setattr__(self, "optimizer_bytes_per_param", OPTIMIZER_BYTES[self.optimizer])
        elif isinstance(bytes_, bool) or not isinstance(bytes_, (int, float)) or not 0 <= bytes_ < float("inf"):
            raise InvalidArgumentError(
                f"optimizer_bytes_per_param must be a number >= 0 (8 for Adam's two fp32 moments, "
                f"4 for SGD with momentum, 0 for plain SGD), got {bytes_!r}")
        _count(self.microbatches, "microbatches")
        _count(self.stages_per_rank, "stages_per_rank", allow_none=False)
        if not isinstance(self.master_weights, bool):
            raise InvalidArgumentError(f"master_weights must be True or False, got {self.master_weights!r}")

    def in_flight_rule(self, stage: str = "j") -> str:
        """``in_flight`` in words, for reports and plan files: ``k - j`` or ``min(k - j, cap)``."""
        if self.schedule == "gpipe":
            return "every microbatch" if self.microbatches is None else f"{self.microbatches}"
        if self.schedule == "interleaved-1f1b":
            return f"as ScheduleInterleaved1F1B orders {self.stages_per_rank} stages per rank"
        return f"k - {stage}" if self.microbatches is None else f"min(k - {stage}, {self.microbatches})"

    def describe(self) -> str:
        """What the model assumes, in words, for reports."""
        master = ", fp32 master weights" if self.master_weights else ""
        return (f"weights + gradients + {self.optimizer} state ({self.optimizer_bytes_per_param:g} B per parameter"
                f"{master}) + kept activations x microbatches in flight (saved for backward, received and sent "
                f"values; stage j of k: {self.in_flight_rule()}, {self.schedule}) + one backward")

    def to_dict(self) -> dict[str, float | int | str | bool | None]:
        return {"optimizer_bytes_per_param": self.optimizer_bytes_per_param, "microbatches": self.microbatches,
                "optimizer": self.optimizer, "schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
                "master_weights": self.master_weights}

    def in_flight(self, stage: int, num_stages: int) -> int:
        """Microbatches whose activations stage ``stage`` keeps at once under the schedule."""
        if self.schedule == "gpipe":
            return num_stages if self.microbatches is None else self.microbatches
        if self.schedule == "interleaved-1f1b":
            return interleaved_in_flight(num_stages, self.stages_per_rank, self.microbatches)[stage]
        count = num_stages - stage
        return count if self.microbatches is None else min(count, self.microbatches)

    def all_in_flight(self, num_stages: int) -> tuple[int, ...]:
        """``in_flight`` of every stage, stage 0 first."""
        return tuple(self.in_flight(j, num_stages) for j in range(num_stages))

    def weight_parts(self, info: Weight) -> tuple[float, float, float]:
        """(weight, gradient, optimizer state with any master copy) bytes of one weight."""
        if not info.trainable:
            return float(info.nbytes), 0.0, 0.0
        master = info.numel * _FP32 if self.master_weights and info.nbytes < info.numel * _FP32 else 0
        return float(info.nbytes), float(info.nbytes), float(info.numel * self.optimizer_bytes_per_param + master)

    def state_bytes(self, info: Weight) -> float:
        """Weight + gradient + optimizer state of one weight."""
        return sum(self.weight_parts(info))


def interleaved_in_flight(num_stages: int, stages_per_rank: int, microbatches: int | None) -> tuple[int, ...]:
    """Per stage, the most microbatches it has run forward and not yet backward under PyTorch's
    ``ScheduleInterleaved1F1B`` (stage s on rank s mod ranks). Its op order is re-derived here
    (warm-up forwards, then one forward and one backward per step, then the cool-down backwards,
    ``microbatches_per_round`` at a time per local stage), not imported, so the model stays
    torch-free; ``tests/test_costs_memory_model.py`` checks it against torch's own order."""
    if num_stages % stages_per_rank:
        raise InvalidArgumentError(
            f"interleaved 1F1B runs {stages_per_rank} stages per rank, so the number of stages must divide by it; "
            f"got {num_stages} stages: pick stages_per_rank dividing {num_stages}")
    ranks, local = num_stages // stages_per_rank, stages_per_rank
    count = ranks if microbatches is None else microbatches
    rounds = max(1, count // ranks)
    if count % rounds:
        raise InvalidArgumentError(
            f"interleaved 1F1B needs the microbatches to divide into rounds of {ranks} (the ranks); "
            f"{count} microbatches make {rounds} rounds with some left over: pick a multiple of {rounds}")
    per_round = count // rounds
    held = [0] * num_stages
    for rank in range(ranks):
        warmup = min((local - 1) * per_round + 2 * (ranks - 1 - rank), count * local)
        total = count * local
        alive = [0] * local
        for op in range(total):
            alive[(op // per_round) % local] += 1
            for i, n in enumerate(alive):
                held[i * ranks + rank] = max(held[i * ranks + rank], n)
            if op >= warmup:
                alive[local - 1 - ((op - warmup) // per_round) % local] -= 1
    return tuple(held)


@dataclass(frozen=True)
class StageMemory:
    """One stage's training memory, split into what it is made of (bytes).

    ``state_bytes`` = weights + gradients + optimizer state (``weight_bytes``, ``gradient_bytes``
    and the rest); per microbatch in flight ``activation_bytes`` (saved for backward),
    ``received_bytes`` and ``sent_bytes``; ``backward_bytes`` is the most one backward adds
    (output gradients, ``output_grad_bytes``, included)."""

    stage: int
    state_bytes: float
    activation_bytes: float
    in_flight: int
    received_bytes: float = 0.0
    sent_bytes: float = 0.0
    output_grad_bytes: float = 0.0
    backward_bytes: float = 0.0
    weight_bytes: float = 0.0
    gradient_bytes: float = 0.0

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
        return self.state_bytes + self.per_microbatch * self.in_flight + self.backward_bytes

    def parts(self) -> str:
        """The parts in words, for errors and reports."""
        return (f"weights {self.weight_bytes:,.0f}, gradients {self.gradient_bytes:,.0f}, optimizer "
                f"{self.optimizer_bytes:,.0f}; per microbatch activations {self.activation_bytes:,.0f}, received "
                f"{self.received_bytes:,.0f}, sent {self.sent_bytes:,.0f}, x {self.in_flight} in flight; "
                f"one backward {self.backward_bytes:,.0f}")


def _training(dag: nx.DiGraph, node: str) -> SavedFacts | None:
    """What ``costs.saved`` probed of ``node``, or None."""
    return dag.nodes[node].get("training")


def kept_bytes(dag: nx.DiGraph, node: str) -> float:
    """Bytes of ``node``'s making that autograd keeps for backward, per microbatch (model inputs:
    none, they count as received); without the probe's facts, the bytes its output allocated."""
    data = dag.nodes[node]
    if data.get("input"):
        return 0.0
    facts = data.get("training")
    return float(facts.saved) if facts is not None else float(data.get("allocated") or 0)


def node_state_bytes(
    dag: nx.DiGraph, model: MemoryModel = MemoryModel(), apart: AbstractSet[str] = frozenset(),
    assignment: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Per node: weight, gradient and optimizer state of the weights charged to it.

    Which reader of a shared weight is charged follows ``costs.ties.weight_payers``.
    """
    infos = dag.graph["weights"]
    return {node: sum(model.state_bytes(infos[w]) for w in paid)
            for node, paid in weight_payers(dag, apart, assignment).items()}


def node_memory(
    dag: nx.DiGraph, model: MemoryModel = MemoryModel(), apart: AbstractSet[str] = frozenset(),
    assignment: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Per node: the state of the weights charged to it, plus its saved activations for one microbatch."""
    state = node_state_bytes(dag, model, apart, assignment)
    return {node: state[node] + kept_bytes(dag, node) for node in dag.nodes}


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
    """The node of the same stage whose storage ``node``'s value is, following views and values
    passed through (they allocate nothing) to the widest input of the same stage."""
    while not dag.nodes[node].get("input") and not dag.nodes[node].get("allocated"):
        inputs = [u for u in dag.predecessors(node) if stage.get(u) == stage[node]]
        if not inputs:
            break
        node = max(inputs, key=lambda u: (float(dag.nodes[u].get("bytes") or 0), u))
    return node


def _sent_unsaved(dag: nx.DiGraph, sent: Sequence[str], stage: Mapping[str, int]) -> float:
    """Bytes the stage keeps only because it sends them: the storages of its sent values that
    nothing saved (a sent view counts the storage it views, once)."""
    total = 0.0
    for owner in {_owner(dag, v, stage) for v in sent}:
        data = dag.nodes[owner]
        if not data.get("input"):
            facts = data.get("training")
            total += max(0.0, float(data.get("allocated") or 0) - (facts.saved_output if facts is not None else 0))
    return total


def _backward_peak(dag: nx.DiGraph, nodes: Sequence[str], sent: AbstractSet[str], output_grads: float) -> float:
    """The most one microbatch's backward adds to what the stage holds: walking its nodes in
    reverse, the output gradients, the gradients alive and the node's own backward peak, less the
    saved storages the nodes already run have released.

    A gradient buffer lives from the backward that makes it to the backward of the value's maker.
    A node that allocates nothing (a view, an item of a tuple, a value passed through) hands its
    gradient on as it is, so its input's gradient is the same buffer; the outputs' gradients are
    the buffers received, counted in ``output_grads``."""
    inside = set(nodes)
    counted: dict[str, float] = {}  # value -> bytes of its gradient counted in ``alive``
    known = set(sent)  # values whose gradient buffer exists (received, or made by a backward run)
    alive = freed = peak = 0.0
    for node in reversed(nodes):
        facts = _training(dag, node)
        if facts is None:
            continue
        peak = max(peak, output_grads + alive + facts.backward - freed)
        # what this stage made and kept for this backward alone (a sent value stays: it was sent)
        freed += sum(nbytes for maker, nbytes in facts.releases if maker in inside and maker not in sent)
        mine = counted.pop(node, 0.0)
        inputs = [u for u in dag.predecessors(node) if _grad(dag, u) > 0]
        if not dag.nodes[node].get("allocated") and inputs:
            widest = max(inputs, key=lambda u: (float(dag.nodes[u].get("bytes") or 0), u))
            counted[widest] = counted.get(widest, 0.0) + mine
            known.add(widest)
            continue
        alive -= mine
        for u in inputs:
            if u not in known:
                known.add(u)
                counted[u] = _grad(dag, u)
                alive += counted[u]
    return max(peak, output_grads)


def stage_memory(
    dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int, model: MemoryModel = MemoryModel(),
) -> list[StageMemory]:
    """The training memory of every stage of ``assignment``, shared weights once per stage."""
    k = num_stages
    infos = dag.graph.get("weights", {})
    payers = weight_payers(dag, assignment=assignment)
    crossing = boundary_values(dag, assignment, k)
    out = []
    for j, nodes in enumerate(_nodes_by_stage(assignment, k)):
        parts = [model.weight_parts(infos[w]) for node in nodes for w in payers[node]]
        weights, grads, optimizer = (sum(p[i] for p in parts) for i in range(3))
        if j == 0:
            received = sum(float(dag.nodes[v]["bytes"]) for v in nodes if dag.nodes[v].get("input"))
        else:
            received = sum(float(dag.nodes[v]["bytes"]) for v in crossing[j - 1])
        outputs = [v for v in dag.nodes if v in assignment and dag.nodes[v].get("output")]
        outgoing = crossing[j] if j < k - 1 else outputs
        made_here = [v for v in outgoing if assignment[v] == j]
        output_grads = sum(_grad(dag, v) for v in outgoing)
        # a value passed straight through gets its gradient as a copy of the one received
        passed = sum(_grad(dag, v) for v in outgoing if assignment[v] < j)
        out.append(StageMemory(
            j, weights + grads + optimizer, sum(kept_bytes(dag, v) for v in nodes), model.in_flight(j, k),
            received_bytes=received, sent_bytes=_sent_unsaved(dag, made_here, assignment) if made_here else 0.0,
            output_grad_bytes=output_grads,
            backward_bytes=_backward_peak(dag, nodes, set(made_here), output_grads + passed),
            weight_bytes=weights, gradient_bytes=grads))
    return out


def memory_excess(dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int,
                  model: MemoryModel = MemoryModel()) -> list[float]:
    """Per stage, what ``stage_memory`` counts beyond the additive per-node parts (received and
    sent values in flight, one backward): a split that checks budgets on the additive parts and
    finds a stage over its budget can tighten that budget by this and split again."""
    return [s.total - s.additive for s in stage_memory(dag, assignment, num_stages, model)]


def memory_shortfall(stages: Sequence[StageMemory], max_memory: Sequence[float]) -> str | None:
    """What the first stage over its budget needs and lacks, or None when every stage fits."""
    for stage, budget in zip(stages, max_memory):
        if stage.total > budget:
            return (f"stage {stage.stage} needs {stage.total:,.0f} bytes ({stage.parts()}) "
                    f"but max_memory[{stage.stage}] is {budget:,.0f}: "
                    f"{stage.total - budget:,.0f} bytes short; raise the budget, add stages or lower the batch")
    return None


def check_memory_budgets(stages: Sequence[StageMemory], max_memory: Sequence[float]) -> None:
    """Raise ``InfeasibleSplitError`` naming the first stage whose memory exceeds its budget."""
    short = memory_shortfall(stages, max_memory)
    if short is not None:
        raise InfeasibleSplitError(short)
