"""The built-in cost models, as functions of the DAG: per-node costs and per-stage totals.

* ``params``: bytes of the parameters and buffers a node reads; per stage, every distinct
  weight the stage holds counts once (a shared weight counts in each stage that holds it).
  Per node, a shared weight is charged to the readers ``costs.ties.weight_payers`` picks: its
  first reader unless told otherwise (``WEIGHT_CHARGED`` models take ``apart`` and
  ``assignment`` for that).
* ``flops``: FLOPs per node, counted by ``torch.utils.flop_counter`` in ``shape-prop``.
* ``activations``: bytes of the tensors each node outputs.
* ``memory``: training memory (see ``autoshard.costs.memory``): per node, weight state and saved
  activations; per stage, ``stage_memory``'s whole model.
* ``time``: measured seconds per node (the ``profile`` pass).
* ``nodes``: one per compute node.

A model whose measurements are missing raises an error that names the pass to add.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import AbstractSet, Callable, Collection, Mapping, Protocol

import networkx as nx

from autoshard.costs.memory import kept_per_node, node_memory, node_state_bytes, stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.ties import weight_payers
from autoshard.errors import InvalidArgumentError

DagCostModel = Callable[[nx.DiGraph], dict[str, float]]


class WeightChargedModel(Protocol):
    """A DAG cost model that charges weights: who pays for a shared one is a parameter."""

    def __call__(self, dag: nx.DiGraph, apart: AbstractSet[str] = ...,
                 assignment: Mapping[str, int] | None = ...) -> dict[str, float]: ...


_NEEDS = {"value_meta": "shape-prop", "seconds": "profile"}
"""Measured DAG attribute -> the pass that measures it."""

_READS = {"flops": "value_meta", "activations": "value_meta", "memory": "value_meta", "time": "seconds"}
"""Cost model -> the measured attribute it reads (the others read what build-dag records)."""


def require_measured(dag: nx.DiGraph, attribute: str, cost: str) -> None:
    """Raise unless every compute node has ``attribute`` (set by ``shape-prop`` or ``profile``)."""
    missing = [n for n, d in dag.nodes(data=True) if not d.get("input") and d.get(attribute) is None]
    if missing:
        step = _NEEDS[attribute]
        raise InvalidArgumentError(
            f"cost model {cost!r} needs what the '{step}' pass measures, but node {missing[0]!r} has no "
            f"{attribute}: add '{step}' after the capture ('capture', 'trace' or 'export') and before "
            f"'build-dag' (it needs example inputs; "
            f"shard_model adds it when given example inputs{' and cost=time' if step == 'profile' else ''})")


def measured(dag: nx.DiGraph, name: str) -> bool:
    """Whether the measurements cost model ``name`` reads are on the DAG."""
    attribute = _READS.get(name)
    return attribute is None or all(d.get("input") or d.get(attribute) is not None for _, d in dag.nodes(data=True))


def param_costs(
    dag: nx.DiGraph, apart: AbstractSet[str] = frozenset(), assignment: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Bytes of the weights charged to each node (``costs.ties.weight_payers``)."""
    if "weights" not in dag.graph:  # a DAG built by hand: charge each node what it was charged
        return {node: float(data["param_bytes"]) for node, data in dag.nodes(data=True)}
    infos = dag.graph["weights"]
    return {node: float(sum(infos[w].nbytes for w in paid))
            for node, paid in weight_payers(dag, apart, assignment).items()}


def node_count_costs(dag: nx.DiGraph) -> dict[str, float]:
    return {node: 0.0 if data.get("input") else 1.0 for node, data in dag.nodes(data=True)}


def flop_costs(dag: nx.DiGraph) -> dict[str, float]:
    require_measured(dag, _READS["flops"], "flops")
    return {node: float(data["flops"] or 0) for node, data in dag.nodes(data=True)}


def activation_costs(dag: nx.DiGraph) -> dict[str, float]:
    require_measured(dag, _READS["activations"], "activations")
    return {node: 0.0 if data.get("input") else float(data["bytes"]) for node, data in dag.nodes(data=True)}


def memory_costs(
    dag: nx.DiGraph, apart: AbstractSet[str] = frozenset(), assignment: Mapping[str, int] | None = None,
    model: MemoryModel = MemoryModel(),
) -> dict[str, float]:
    """Training state of the weights charged to each node plus its activations for one microbatch."""
    require_measured(dag, _READS["memory"], "memory")
    return node_memory(dag, model, apart=apart, assignment=assignment)


def memory_parts(
    dag: nx.DiGraph, apart: AbstractSet[str] = frozenset(), model: MemoryModel = MemoryModel(),
) -> tuple[dict[str, float], dict[str, float]]:
    """The additive parts of ``memory`` per node: weight state held once per stage (weights charged
    as ``costs.ties.weight_payers`` says) and the bytes autograd saves, kept per microbatch in
    flight. The rest of a stage's memory (received and sent values, one backward) depends on the
    cuts: ``costs.memory.stage_memory`` counts it (a stage's ``total`` beyond its ``additive`` part)."""
    require_measured(dag, _READS["memory"], "memory")
    return node_state_bytes(dag, model, apart), kept_per_node(dag, model)


def time_costs(dag: nx.DiGraph) -> dict[str, float]:
    require_measured(dag, _READS["time"], "time")
    return {node: float(data["seconds"] or 0.0) for node, data in dag.nodes(data=True)}


DAG_COST_MODELS: dict[str, DagCostModel] = {
    "params": param_costs,
    "nodes": node_count_costs,
    "flops": flop_costs,
    "activations": activation_costs,
    "memory": memory_costs,
    "time": time_costs,
}


WEIGHT_CHARGED: dict[str, WeightChargedModel] = {"params": param_costs, "memory": memory_costs}
"""The built-in models whose per-node costs depend on which readers pay for a shared weight."""


def summed_per_stage(per_node: Mapping[str, float], assignment: Mapping[str, int], num_stages: int,
                     also: Mapping[str, Collection[int]] = MappingProxyType({})) -> list[float]:
    """Per-node costs added up per stage, a node also in each stage of ``also`` that runs it too
    (``graph.partition.also_run``: a size, a mask each reader's stage computes again). A split counts each
    node once, where its partition places it; a stage's time (``plan_report``) counts it where it runs."""
    totals = [0.0] * num_stages
    for node, stage in assignment.items():
        for running in (stage, *also.get(node, ())):
            totals[running] += float(per_node[node])
    return totals


def held_weight_bytes(dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int) -> list[float]:
    """Bytes of the distinct parameters and buffers each stage holds (a shared one once per stage)."""
    return summed_per_stage(param_costs(dag, assignment=assignment), assignment, num_stages)


def stage_totals(
    dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int, costs: Mapping[str, float] | str,
    memory: MemoryModel = MemoryModel(),
) -> list[float]:
    """Per-stage cost of ``assignment``: ``params`` and ``memory`` count shared weights once per
    stage (and ``memory`` multiplies activations by the microbatches in flight); anything else,
    including explicit per-node ``costs``, is summed."""
    if costs == "params":
        return held_weight_bytes(dag, assignment, num_stages)
    if costs == "memory":
        require_measured(dag, _READS["memory"], "memory")
        return [s.total for s in stage_memory(dag, assignment, num_stages, memory)]
    per_node = DAG_COST_MODELS[costs](dag) if isinstance(costs, str) else costs
    return summed_per_stage(per_node, assignment, num_stages)
