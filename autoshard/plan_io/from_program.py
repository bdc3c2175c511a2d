"""A plan from a program that ran up to its split, with the costs worth showing."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any, Mapping

from autoshard.errors import InvalidArgumentError
from autoshard.plan_io.model import PlanNode, SavedPlan

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.passes.base import PassContext, ShardProgram


def _value_of(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The node's measured value structure as plain JSON data, when ``shape-prop`` ran."""
    meta = data.get("value_meta")
    return meta.to_dict() if hasattr(meta, "to_dict") else None


def versions() -> dict[str, str]:
    """The library versions a plan is made with; a graph mismatch on load reports them."""
    import torch

    import autoshard

    return {"autoshard": autoshard.__version__, "torch": torch.__version__, "python": platform.python_version()}


REPORTED_COSTS = ("params", "flops")
"""Cost models shown beside the split's own when they are registered and their inputs measured.

``activations`` is always shown from the nodes' sizes; ``time`` only when the split measured it
(profiling just for a report would be slow); ``memory`` is not a sum over nodes, so not shown.
"""


def report_costs(program: "ShardProgram", ctx: "PassContext", cost_model: str) -> tuple[dict[str, dict], list[str]]:
    """Per-node costs under the split's model and each of ``REPORTED_COSTS`` that can be computed.

    Returns the costs and one note per reported model that could not be computed, saying why.
    """
    from autoshard.passes.analyses import COST_MODELS, node_costs

    costs = {cost_model: node_costs(program, ctx, cost_model)}
    notes = []
    for name in REPORTED_COSTS:
        if name in costs or name not in COST_MODELS:
            continue
        try:
            costs[name] = node_costs(program, ctx, name)
        except Exception as exc:  # noqa: BLE001 - a column we cannot fill is reported, not fatal
            notes.append(f"{name}: not shown ({type(exc).__name__}: {exc})")
    return costs, notes


def plan_from_program(
    program: "ShardProgram", pipeline: str, cost_model: str, costs: Mapping[str, Mapping[str, float]],
) -> SavedPlan:
    """The plan of a program that has a DAG and a partition.

    ``costs`` maps each cost model to report (the split's ``cost_model`` among them) to its
    per-node costs; ``pipeline`` is the spec that made the split.
    """
    if program.dag is None or program.partition is None:
        raise InvalidArgumentError("a plan needs a program with a DAG and a partition: run up to the split")
    if cost_model not in costs:
        raise InvalidArgumentError(f"the costs given do not include the split's cost model {cost_model!r}")
    dag, partition = program.dag, program.partition
    nodes = []
    for name in partition.assignment:
        data = dag.nodes[name]
        nodes.append(PlanNode(
            name=str(name), stage=partition.assignment[name], op=str(data.get("op", "")),
            target=str(data.get("target", "")), module=str(data.get("module", "")),
            costs={m: float(c[name]) for m, c in costs.items()}, bytes=float(data["bytes"]),
            param_bytes=float(data.get("param_bytes", 0)), input=bool(data.get("input")),
            output=bool(data.get("output")), value=_value_of(data),
        ))
    wrapped = program.traced.wrapped if program.traced is not None else ()
    return SavedPlan(
        num_stages=partition.num_stages, cost_model=cost_model, pipeline=pipeline,
        model=type(program.model).__qualname__, versions=versions(), nodes=tuple(nodes),
        edges=tuple((str(u), str(v)) for u, v in dag.edges), wrapped=tuple(wrapped),
    )
