"""Cost models: per-node costs the splitter balances, computed once per DAG and cached.

Each cost model is a function of the program registered by name, so ``cost=params`` in a spec
or in ``shard_model`` resolves here. The built-ins (``params``, ``flops``, ``activations``,
``memory``, ``time``, ``nodes``; see ``autoshard.costs.models``) read what ``build-dag``,
``shape-prop`` and ``profile`` recorded on the DAG. A user's ``cost(node) -> float`` works too:
``shard_model`` registers it for one run only (``use_cost_model``), under a generated name.
Results are cached in the ``PassContext`` under the DAG object itself: a pass that provides a
new DAG invalidates them for free.

``params`` and ``memory`` charge weights, and a shared weight costs once per stage that holds
it; per node, that depends on where its readers end up. ``node_costs(..., apart=...)`` charges
the named shared weights to every reader, and ``held_stage_costs`` scores a finished plan with
each weight counted exactly once per stage holding it.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import AbstractSet, Any, Callable, Iterable, Mapping

import torch

from autoshard.costs.memory import stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.models import DAG_COST_MODELS, WEIGHT_CHARGED, DagCostModel, memory_costs, summed_per_stage
from autoshard.arguments import real_number
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, PipelineValidationError, suggest
from autoshard.passes.base import PassContext, ShardProgram

CostModel = Callable[[ShardProgram], dict[str, float]]

COST_MODELS: dict[str, CostModel] = {}

COST_MODEL_READS: dict[str, frozenset[str]] = {}
"""Registered cost model -> the measurements (``facts``, ``times``) it reads off the DAG."""

_BUILTIN_READS = {"flops": "facts", "activations": "facts", "memory": "facts", "time": "times"}
"""What the built-in models read (``costs.models``): FLOPs, value sizes and saved tensors come from
``shape-prop``, seconds from ``profile``; ``params`` and ``nodes`` read what ``build-dag`` records."""


def register_cost_model(name: str, reads: Iterable[str] = ()) -> Callable[[CostModel], CostModel]:
    """Register ``fn(program) -> {node: cost}`` under ``name`` (usable as ``cost=name``).

    ``reads`` names the measurements it needs on the DAG (``facts``, ``times``), so a pipeline
    that balances it without the pass that measures them is refused before it runs.
    """
    needed = frozenset(reads)
    unknown = sorted(needed - ShardProgram.MEASUREMENTS)
    if unknown:
        raise InvalidArgumentError(f"cost model {name!r} reads {', '.join(map(repr, unknown))}, which is no "
                                   f"measurement; measurements are {', '.join(sorted(ShardProgram.MEASUREMENTS))}")

    def decorate(fn: CostModel) -> CostModel:
        if name in COST_MODELS:
            raise InvalidArgumentError(f"a cost model named {name!r} is already registered")
        COST_MODELS[name] = fn
        COST_MODEL_READS[name] = needed
        return fn

    return decorate


def _on_dag(fn: DagCostModel) -> CostModel:
    return lambda program: fn(program.dag)


for _name, _fn in DAG_COST_MODELS.items():
    register_cost_model(_name, [_BUILTIN_READS[_name]] if _name in _BUILTIN_READS else [])(_on_dag(_fn))


def cost_reads(cost: str) -> frozenset[str]:
    """The measurements the cost model ``cost`` reads off the DAG; none for one the run supplies
    (``custom-...``: a user's function is given None where a measurement is missing)."""
    return COST_MODEL_READS.get(cost, frozenset())


@dataclass(frozen=True)
class CostNode:
    """What a user's ``cost(node) -> float`` is given: one compute node of the DAG.

    ``flops``, ``output_bytes`` and ``seconds`` are None until ``shape-prop`` / ``profile`` ran;
    ``attrs`` holds every DAG attribute (see ``autoshard.lowering.from_fx``).
    """

    name: str
    op: str
    target: str
    module: str
    params: int
    param_bytes: int
    output_bytes: float | None
    flops: int | None
    seconds: float | None
    attrs: Mapping[str, Any]


def _cost_node(name: str, data: Mapping[str, Any]) -> CostNode:
    return CostNode(name, data["op"], data["target"], data["module"], data["params"], data["param_bytes"],
                    float(data["bytes"]) if data.get("value_meta") is not None else None,
                    data.get("flops"), data.get("seconds"), MappingProxyType(dict(data)))


def callable_cost_model(fn: Callable[[CostNode], float]) -> CostModel:
    """Adapt ``fn(node) -> float`` to a cost model: called once per compute node, inputs cost 0."""
    if not callable(fn):
        raise InvalidArgumentTypeError(f"a cost must be a cost model name or a callable, got {fn!r}")

    def model(program: ShardProgram) -> dict[str, float]:
        costs = {}
        for node, data in program.dag.nodes(data=True):
            value = 0.0 if data.get("input") else fn(_cost_node(node, data))
            number = real_number(_one_element(value))
            if number is None or not math.isfinite(number) or number < 0:
                raise InvalidArgumentError(
                    f"the cost function {getattr(fn, '__name__', fn)!r} returned {value!r} for node {node!r}; "
                    "it must return a finite number >= 0")
            costs[node] = number
        return costs

    return model


def _one_element(value: Any) -> Any:
    """The number a one-element tensor holds (a cost computed with torch); other values as they are."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.item()
    return value


def run_local_name(fn: Callable[..., Any]) -> str:
    """The name a user's cost function goes by in the pipeline spec: ``custom-<function name>``."""
    return "custom-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", getattr(fn, "__name__", "")).strip("-") or "cost")


def use_memory_model(ctx: PassContext, model: MemoryModel) -> None:
    """Plan the runs that use ``ctx`` for this optimizer and microbatch cap (``cost=memory``,
    ``max-memory``); the default is Adam (8 bytes per parameter) with every microbatch in flight."""
    ctx.memory_model = model


def memory_model(ctx: PassContext) -> MemoryModel:
    """The training-memory model of this run."""
    return ctx.memory_model or MemoryModel()


def use_cost_model(ctx: PassContext, name: str, model: CostModel) -> None:
    """Make ``model`` available as ``cost=name`` for the runs that use ``ctx`` only."""
    ctx.cost_models[name] = model


def check_cost_name(cost: str) -> None:
    """Refuse a name that is neither a registered cost model nor a user's function (``custom-...``,
    registered with the run that uses it)."""
    if cost not in COST_MODELS and not cost.startswith("custom-"):
        raise InvalidArgumentError(_unknown_cost(cost))


def _lookup(ctx: PassContext, cost: str) -> CostModel:
    local = ctx.cost_models.get(cost)
    if local is not None:
        return local
    if cost not in COST_MODELS:
        if cost.startswith("custom-"):  # a spec copied from a run that was given a cost function
            raise InvalidArgumentError(
                f"cost model {cost!r} is the name a cost function passed as shard_model(..., cost=fn) goes by, "
                "and this run was given none: pass the function again as cost= (the spec may keep "
                f"cost={cost}), or use a registered cost model: {', '.join(sorted(COST_MODELS))}")
        raise InvalidArgumentError(_unknown_cost(cost))
    return COST_MODELS[cost]


def _unknown_cost(cost: str) -> str:
    return f"unknown cost model {cost!r}{suggest(cost, COST_MODELS)}; known: {', '.join(sorted(COST_MODELS))}"


def charges_weights(ctx: PassContext, cost: str) -> bool:
    """Whether ``cost`` resolves to a built-in model that charges weights (``params``, ``memory``)."""
    return cost in WEIGHT_CHARGED and cost not in ctx.cost_models


def node_costs(
    program: ShardProgram, ctx: PassContext, cost: str, apart: AbstractSet[str] = frozenset(),
) -> dict[str, float]:
    """The per-node costs under the named model, cached for this DAG.

    ``apart`` names shared weights to charge to every reader rather than the first; only the
    models that charge weights read it.
    """
    model = _lookup(ctx, cost)
    if program.dag is None:
        raise PipelineValidationError("cost models need a DAG: run build-dag first")
    if not charges_weights(ctx, cost):
        return ctx.analysis(("cost", cost, program.dag), lambda: model(program))
    apart = frozenset(apart)
    return ctx.analysis(("cost", cost, program.dag, apart), lambda: _weight_charged(ctx, cost)(program.dag, apart))


def _weight_charged(ctx: PassContext, cost: str) -> Callable[..., dict[str, float]]:
    """The built-in model of ``cost`` that takes ``apart``; ``memory`` under this run's MemoryModel."""
    if cost == "memory":
        return functools.partial(memory_costs, model=memory_model(ctx))
    return WEIGHT_CHARGED[cost]


def held_stage_costs(
    program: ShardProgram, ctx: PassContext, cost: str, assignment: Mapping[str, int], num_stages: int,
) -> list[float]:
    """Per-stage totals of ``cost`` for ``assignment``, a shared weight counted once per stage holding it.

    Training memory (``memory``) is counted as a stage holds it: activations once per microbatch
    in flight there, which no sum of node costs can say.
    """
    if cost == "memory" and charges_weights(ctx, cost):
        return [stage.total for stage in stage_memory(program.dag, assignment, num_stages, memory_model(ctx))]
    if charges_weights(ctx, cost):
        return summed_per_stage(WEIGHT_CHARGED[cost](program.dag, assignment=assignment), assignment, num_stages)
    return summed_per_stage(node_costs(program, ctx, cost), assignment, num_stages)
