"""The built-in cost models, as functions of the DAG: per-node costs and per-stage totals.

* ``params``: bytes of the parameters and buffers a node reads, each charged to its first
  reader; per stage, every distinct weight the stage holds counts once (a shared weight counts
  in each stage that holds it).
* ``flops``: FLOPs per node, counted by ``torch.utils.flop_counter`` in ``shape-prop``.
* ``activations``: bytes of the tensors each node outputs.
* ``memory``: training memory (see ``autoshard.costs.memory``).
* ``time``: measured seconds per node (the ``profile`` pass).
* ``nodes``: one per compute node.

A model whose measurements are missing raises an error that names the pass to add.
"""

from __future__ import annotations

from typing import Callable, Mapping

import networkx as nx

from autoshard.costs.memory import MemoryModel, node_memory, stage_memory
from autoshard.errors import InvalidArgumentError

DagCostModel = Callable[[nx.DiGraph], dict[str, float]]

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
            f"{attribute}: add '{step}' after 'trace' and before 'build-dag' (it needs example inputs; "
            f"shard_model adds it when given example inputs{' and cost=time' if step == 'profile' else ''})")


def measured(dag: nx.DiGraph, name: str) -> bool:
    """Whether the measurements cost model ``name`` reads are on the DAG."""
    attribute = _READS.get(name)
    return attribute is None or all(d.get("input") or d.get(attribute) is not None for _, d in dag.nodes(data=True))


def param_costs(dag: nx.DiGraph) -> dict[str, float]:
    return {node: float(data["param_bytes"]) for node, data in dag.nodes(data=True)}


def node_count_costs(dag: nx.DiGraph) -> dict[str, float]:
    return {node: 0.0 if data.get("input") else 1.0 for node, data in dag.nodes(data=True)}


def flop_costs(dag: nx.DiGraph) -> dict[str, float]:
    require_measured(dag, _READS["flops"], "flops")
    return {node: float(data["flops"] or 0) for node, data in dag.nodes(data=True)}


def activation_costs(dag: nx.DiGraph) -> dict[str, float]:
    require_measured(dag, _READS["activations"], "activations")
    return {node: 0.0 if data.get("input") else float(data["bytes"]) for node, data in dag.nodes(data=True)}


def memory_costs(dag: nx.DiGraph) -> dict[str, float]:
    require_measured(dag, _READS["memory"], "memory")
    return node_memory(dag)


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


def held_weight_bytes(dag: nx.DiGraph, assignment: Mapping[str, int], num_stages: int) -> list[float]:
    """Bytes of the distinct parameters and buffers each stage holds (a shared one once per stage)."""
    infos = dag.graph["weights"]
    held: list[set[str]] = [set() for _ in range(num_stages)]
    for node, stage in assignment.items():
        held[stage].update(dag.nodes[node].get("weights", ()))
    return [float(sum(infos[w].nbytes for w in names)) for names in held]


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
    totals = [0.0] * num_stages
    for node, stage in assignment.items():
        totals[stage] += float(per_node[node])
    return totals
