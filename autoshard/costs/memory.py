"""Training memory per stage, for ``cost=memory`` and ``max_memory`` budgets.

The model: a stage holds, for every distinct weight it reads (a shared one once),
* the weight itself (its bytes),
* for a trainable parameter, its gradient (same bytes) and the optimizer state
  (``optimizer_bytes_per_param`` per element; 8 for Adam's two fp32 moments),
plus the activations kept for backward, approximated by the new memory every node of the stage
allocates for its output (a view or a pass-through allocates none), times the number of
microbatches in flight at that stage. Under the 1F1B schedule
stage j of k holds k - j microbatches (stage 0 the most), capped by ``microbatches`` if set.

The weight terms are exact; the activation term is an estimate that errs both ways. It counts
outputs autograd frees (an ``add`` feeding a ``Linear``). It misses the tensors a stage receives
(kept per microbatch in flight until their gradients are sent back; torch's ``PipelineStage``
allocates a receive buffer for every microbatch of a step) and whatever one node saves inside
itself: a leaf or wrapped module, ``F.multi_head_attention_forward`` (attention probabilities,
dropout masks), a loss's log-probabilities. Against the storages autograd really saves, it was
0.7x to 3x off on transformers (3x under for ``TransformerLM`` training on 128 tokens), and far
under for a stage that receives a wide tensor and reduces it; the README says so next to
``max_memory``. Counting the received values needs the boundary (not a per-node sum), and the
saved internals a run with gradients: neither is done yet.

The per-node ``memory`` cost charges each weight's state to one reader (``costs.ties.weight_payers``)
and adds the node's activations for one microbatch; ``stage_memory`` gives the exact per-stage
figure. A split that must fit ``max_memory`` gets the two parts apart (``node_state_bytes``, held
once per stage, and ``kept_bytes``, held per microbatch in flight) so it can check that figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Mapping, Protocol, Sequence

import networkx as nx

from autoshard.costs.ties import weight_payers
from autoshard.errors import InfeasibleSplitError, InvalidArgumentError


class Weight(Protocol):
    """What the model needs of a weight (``lowering.from_fx.WeightInfo`` has it)."""

    numel: int
    nbytes: int
    trainable: bool


@dataclass(frozen=True)
class MemoryModel:
    """Bytes of optimizer state per trainable element, and a cap on microbatches in flight."""

    optimizer_bytes_per_param: float = 8.0
    microbatches: int | None = None

    def __post_init__(self) -> None:
        bytes_ = self.optimizer_bytes_per_param
        if isinstance(bytes_, bool) or not isinstance(bytes_, (int, float)) or not 0 <= bytes_ < float("inf"):
            raise InvalidArgumentError(
                f"optimizer_bytes_per_param must be a number >= 0 (8 for Adam's two fp32 moments, "
                f"4 for SGD with momentum, 0 for plain SGD), got {bytes_!r}")
        count = self.microbatches
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise InvalidArgumentError(f"microbatches must be a whole number >= 1 or None (no cap), got {count!r}")

    def in_flight_rule(self, stage: str = "j") -> str:
        """``in_flight`` in words, for reports and plan files: ``k - j`` or ``min(k - j, cap)``."""
        return f"k - {stage}" if self.microbatches is None else f"min(k - {stage}, {self.microbatches})"

    def describe(self) -> str:
        """What the model assumes, in words, for reports."""
        return (f"weights + gradients + optimizer state ({self.optimizer_bytes_per_param:g} B per parameter) "
                f"+ kept activations x microbatches in flight (stage j of k: {self.in_flight_rule()}, 1F1B)")

    def to_dict(self) -> dict[str, float | int | None]:
        return {"optimizer_bytes_per_param": self.optimizer_bytes_per_param, "microbatches": self.microbatches}

    def in_flight(self, stage: int, num_stages: int) -> int:
        """Microbatches whose activations stage ``stage`` keeps at once under 1F1B."""
        count = num_stages - stage
        return count if self.microbatches is None else min(count, self.microbatches)

    def all_in_flight(self, num_stages: int) -> tuple[int, ...]:
        """``in_flight`` of every stage, stage 0 first."""
        return tuple(self.in_flight(j, num_stages) for j in range(num_stages))

    def state_bytes(self, info: Weight) -> float:
        """Weight + gradient + optimizer state of one weight."""
        extra = info.nbytes + info.numel * self.optimizer_bytes_per_param if info.trainable else 0.0
        return float(info.nbytes + extra)


@dataclass(frozen=True)
class StageMemory:
    """One stage's training memory, split into what it is made of."""

    stage: int
    state_bytes: float
    activation_bytes: float
    in_flight: int

    @property
    def total(self) -> float:
        return self.state_bytes + self.activation_bytes * self.in_flight


def kept_bytes(dag: nx.DiGraph, node: str) -> float:
    """Bytes ``node`` allocates for its output, kept for backward (model inputs are not)."""
    data = dag.nodes[node]
    return 0.0 if data.get("input") else float(data["allocated"])


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
    """Per node: the state of the weights charged to it, plus its activations for one microbatch."""
    state = node_state_bytes(dag, model, apart, assignment)
    return {node: state[node] + kept_bytes(dag, node) for node in dag.nodes}


def stage_memory(
    dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int, model: MemoryModel = MemoryModel(),
) -> list[StageMemory]:
    """The training memory of every stage of ``assignment``, shared weights once per stage."""
    state = node_state_bytes(dag, model, assignment=assignment)
    states, activations = [0.0] * num_stages, [0.0] * num_stages
    for node, stage in assignment.items():
        states[stage] += state[node]
        activations[stage] += kept_bytes(dag, node)
    return [StageMemory(j, states[j], activations[j], model.in_flight(j, num_stages)) for j in range(num_stages)]


def memory_shortfall(stages: Sequence[StageMemory], max_memory: Sequence[float]) -> str | None:
    """What the first stage over its budget needs and lacks, or None when every stage fits."""
    for stage, budget in zip(stages, max_memory):
        if stage.total > budget:
            return (f"stage {stage.stage} needs {stage.total:,.0f} bytes (weights, gradients and optimizer state "
                    f"{stage.state_bytes:,.0f}; activations {stage.activation_bytes:,.0f} x {stage.in_flight} "
                    f"microbatches in flight) but max_memory[{stage.stage}] is {budget:,.0f}: "
                    f"{stage.total - budget:,.0f} bytes short; raise the budget, add stages or lower the batch")
    return None


def check_memory_budgets(stages: Sequence[StageMemory], max_memory: Sequence[float]) -> None:
    """Raise ``InfeasibleSplitError`` naming the first stage whose memory exceeds its budget."""
    short = memory_shortfall(stages, max_memory)
    if short is not None:
        raise InfeasibleSplitError(short)
