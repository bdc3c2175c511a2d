"""``ShardedModel``: the k stages chained, called exactly like the original model."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from autoshard.capture.result import WrappedLeaf
from autoshard.costs.memory import MemoryModel
from autoshard.costs.models import DAG_COST_MODELS, held_weight_bytes, measured, stage_totals
from autoshard.costs.ties import SharedWeight, shared_weights
from autoshard.costs.values import ValueMeta
from autoshard.errors import InputMismatchError
from autoshard.graph.partition import SplitInfo


@dataclass(frozen=True)
class BoundaryValue:
    """A value sent from one stage to the next: its producer's name, structure and size.

    ``meta`` is None (and ``nbytes`` a placeholder of 1) when shapes were not propagated.
    """

    name: str
    meta: ValueMeta | None
    nbytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.meta.to_dict() if self.meta is not None else None,
                "text": str(self.meta) if self.meta is not None else None, "bytes": self.nbytes}


@dataclass(frozen=True)
class StagePlan:
    """What the split decided, kept beside the stages for reports and checks.

    Everything beyond the assignment and boundaries is read from the DAG: per-stage costs under
    each cost model whose measurements it holds, the structure of every boundary value, and the
    weights shared between nodes (tied weights), with the stages that hold them. ``split_info``
    is what the splitter knew about its result (strategy, bound, whether ``exact`` proved it
    optimal, the tied-weight groups it had to separate); None when the split came from elsewhere.
    ``memory_model`` is the optimizer and microbatch cap its training memory was planned for.
    ``training`` is the model's mode at capture: code that reads ``self.training`` (attention
    dropout rates, batch-norm branches) was fixed to it.
    """

    assignment: dict[str, int]
    boundaries: tuple[tuple[str, ...], ...]
    wrapped: tuple[WrappedLeaf, ...]
    dag: Any
    split_info: SplitInfo | None = None
    memory_model: MemoryModel = MemoryModel()
    training: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1

    def stage_nodes(self, stage: int) -> list[str]:
        """The non-input nodes of ``stage`` in program order."""
        return [n for n, s in self.assignment.items() if s == stage and not self.dag.nodes[n].get("input")]

    def modules(self, stage: int) -> list[str]:
        """Owning module paths of the nodes in ``stage``, in program order, without repeats."""
        return list(dict.fromkeys(self.dag.nodes[n]["module"] or "<root>" for n in self.stage_nodes(stage)))

    def weights(self, stage: int) -> tuple[str, ...]:
        """Canonical names of the distinct parameters and buffers ``stage`` holds, in program order."""
        return tuple(dict.fromkeys(w for n in self.stage_nodes(stage) for w in self.dag.nodes[n]["weights"]))

    def param_bytes(self, stage: int) -> int:
        """Bytes of the parameters and buffers ``stage`` holds; a shared one counts once per stage."""
        if "weights" not in self.dag.graph:  # a DAG built by hand: charge each node what it was charged
            return sum(self.dag.nodes[n]["param_bytes"] for n in self.stage_nodes(stage))
        return int(held_weight_bytes(self.dag, self.assignment, self.num_stages)[stage])

    def boundary_values(self, boundary: int) -> tuple[BoundaryValue, ...]:
        """The values crossing from stage ``boundary`` to the next, with shape, dtype and bytes."""
        return tuple(BoundaryValue(name, self.dag.nodes[name].get("value_meta"), float(self.dag.nodes[name]["bytes"]))
                     for name in self.boundaries[boundary])

    @cached_property
    def shared_weights(self) -> tuple[SharedWeight, ...]:
        """Weights read by several nodes or tied under several names, with the stages holding them."""
        return shared_weights(self.dag, self.assignment)

    @property
    def gradient_sync(self) -> tuple[SharedWeight, ...]:
        """Trainable shared parameters held by several stages: those stages must sum their gradients."""
        return tuple(w for w in self.shared_weights if w.needs_gradient_sync)

    def stage_costs(self, cost: str | Mapping[str, float], memory: MemoryModel | None = None) -> list[float]:
        """Per-stage cost under a built-in cost model's name, or of explicit per-node costs;
        ``memory`` (default: the plan's own) is the training-memory model ``memory`` uses."""
        return stage_totals(self.dag, self.assignment, self.num_stages, cost, memory or self.memory_model)

    def cost_models(self) -> tuple[str, ...]:
        """The built-in cost models whose measurements this plan's DAG holds."""
        return tuple(name for name in DAG_COST_MODELS if measured(self.dag, name))


class ShardedModel(nn.Module):
    """An ``nn.Module`` whose forward runs ``stages`` in order.

    ``stages[0]`` takes the model's inputs; every stage but the last returns a tuple of the
    values crossing its boundary, which the next stage takes positionally (moved to the device
    of its weights when it has been placed elsewhere); the last stage returns what the model
    returns.
    """

    def __init__(self, stages: list[fx.GraphModule], plan: StagePlan,
                 model_signature: inspect.Signature | None = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.plan = plan
        self.training = plan.training  # its own flag only: the stages share the model's modules
        #: the model's own call signature, when known: an argument the example left out may be
        #: passed with its default value (``mask=None``), which the plan computes with
        self.model_signature = model_signature

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _fitted_call(self.stages[0], self.model_signature, args, kwargs)
        values = self.stages[0](*args, **kwargs)
        for stage in self.stages[1:]:
            values = stage(*_moved_to(_device_of(stage), values))
        return values


def _fitted_call(first: nn.Module, model_signature: inspect.Signature | None, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call as the first stage takes it.

    The stage takes the arguments the example passed; one the example left out is fixed at its
    default in the plan: passed with that same value (``mask=None``) it is dropped, with another it
    is refused, naming what the plan takes (so are more positional ones than the example had). An
    argument the example passed with another value than the model's default (``scale=2.0``) is
    the stage's default: a call leaving it out gets the model's default instead, as the model would.
    """
    signature = inspect.signature(first.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        if model_signature is None:
            raise _not_fitting(signature, exc) from None
        return (), _dropping_defaults(signature, model_signature, args, kwargs, exc)
    return args, {**kwargs, **_model_defaults(signature, model_signature, bound.arguments)}


def _dropping_defaults(signature: inspect.Signature, model_signature: inspect.Signature, args: tuple[Any, ...],
                       kwargs: dict[str, Any], refusal: TypeError) -> dict[str, Any]:
    """The arguments of a call the stage takes, when every other one has the model's default."""
    try:
        values = model_signature.bind(*args, **kwargs).arguments
    except TypeError:
        raise _not_fitting(signature, refusal) from None
    changed = [name for name in values
               if name not in signature.parameters and not _is_default(model_signature, name, values[name])]
    if changed:
        defaults = [model_signature.parameters[name].default for name in changed]
        if inspect.Parameter.empty not in defaults:
            left = ", ".join(f"{name}={default!r}" for name, default in zip(changed, defaults))
            refusal = TypeError(f"the example left {left} at the default, which the plan computes with")
        raise _not_fitting(signature, refusal) from None
    kept = {name: value for name, value in values.items() if name in signature.parameters}
    try:
        signature.bind(**kept)
    except TypeError as exc:  # it also leaves out one the example passed
        raise _not_fitting(signature, exc) from None
    return kept


def _not_fitting(signature: inspect.Signature, reason: TypeError) -> InputMismatchError:
    return InputMismatchError(
        f"these inputs do not fit the sharded plan: {reason}. The plan takes ({', '.join(signature.parameters)}), "
        "the arguments its example passed (one left out was fixed at its default); shard the model again "
        "with an example that passes these arguments")


def _model_defaults(signature: inspect.Signature, model_signature: inspect.Signature | None,
                    passed: Mapping[str, Any]) -> dict[str, Any]:
    """The model's defaults for the stage's arguments a call leaves out, where they are not the stage's."""
    if model_signature is None:
        return {}
    found = {}
    for name, parameter in signature.parameters.items():
        model_parameter = model_signature.parameters.get(name)
        if name in passed or model_parameter is None or model_parameter.default is inspect.Parameter.empty:
            continue
        if not _is_default(model_signature, name, parameter.default):
            found[name] = model_parameter.default
    return found


def _is_default(signature: inspect.Signature, name: str, value: Any) -> bool:
    """Whether ``value`` is the default of parameter ``name``: the same object, or an equal plain
    number, flag or string (a tensor default never counts: its values could have changed); for
    ``*args`` or ``**kwargs``, nothing."""
    parameter = signature.parameters[name]
    if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return not value
    default = parameter.default
    if default is inspect.Parameter.empty:
        return False
    plain = (bool, int, float, str, type(None))
    return value is default or (type(value) is type(default) and isinstance(value, plain) and value == default)


def _device_of(stage: nn.Module) -> torch.device | None:
    """The one device a stage's weights are on (None: none, or several)."""
    devices = {t.device for t in itertools.chain(stage.parameters(), stage.buffers())}
    return devices.pop() if len(devices) == 1 else None


def _moved_to(device: torch.device | None, values: tuple[Any, ...]) -> tuple[Any, ...]:
    """``values`` with their tensors on ``device``: stages placed on devices of their own by hand
    (``stages[i].to(f"cuda:{i}")``) hand each other their boundary values there."""
    if device is None:
        return values
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v, values)
