"""Cost models: per-node costs the splitter balances, computed once per DAG and cached.

Each cost model is a function of the program registered by name, so ``cost=params`` in a spec
or in ``shard_model`` resolves here. Results are cached in the ``PassContext`` under the DAG
object itself: a pass that provides a new DAG invalidates them for free.
"""

from __future__ import annotations

import difflib
from typing import Callable

from autoshard.errors import InvalidArgumentError, PipelineValidationError
from autoshard.passes.base import PassContext, ShardProgram

CostModel = Callable[[ShardProgram], dict[str, float]]

COST_MODELS: dict[str, CostModel] = {}


def register_cost_model(name: str) -> Callable[[CostModel], CostModel]:
    """Register ``fn(program) -> {node: cost}`` under ``name`` (usable as ``cost=name``)."""

    def decorate(fn: CostModel) -> CostModel:
        if name in COST_MODELS:
            raise InvalidArgumentError(f"a cost model named {name!r} is already registered")
        COST_MODELS[name] = fn
        return fn

    return decorate


@register_cost_model("params")
def param_bytes(program: ShardProgram) -> dict[str, float]:
    """Bytes of the parameters and buffers each node reads (each tensor charged once)."""
    return {node: float(data["param_bytes"]) for node, data in program.dag.nodes(data=True)}


@register_cost_model("nodes")
def node_count(program: ShardProgram) -> dict[str, float]:
    """One per compute node: balances the number of operations per stage."""
    return {node: 0.0 if data.get("input") else 1.0 for node, data in program.dag.nodes(data=True)}


def node_costs(program: ShardProgram, ctx: PassContext, cost: str) -> dict[str, float]:
    """The per-node costs under the named model, cached for this DAG."""
    if cost not in COST_MODELS:
        close = difflib.get_close_matches(cost, COST_MODELS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidArgumentError(
            f"unknown cost model {cost!r}{hint}; known: {', '.join(sorted(COST_MODELS))}")
    if program.dag is None:
        raise PipelineValidationError("cost models need a DAG: run build-dag first")
    return ctx.analysis(("cost", cost, program.dag), lambda: COST_MODELS[cost](program))
