"""``shard_model``: the one call most users need."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, PipelineValidationError
from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram
from autoshard.passes.dag import BuildDagPass
from autoshard.passes.emit import EmitPass
from autoshard.passes.instruments import Instrument
from autoshard.passes.linearize import LinearizePass
from autoshard.passes.pipeline import Pipeline, PipelineResult
from autoshard.passes.split import SplitPass
from autoshard.passes.trace import TracePass
from autoshard.passes.verify import VerifyPass
from autoshard.sharded import ShardedModel


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidArgumentTypeError(
            f"autoshard splits a torch.nn.Module, got {type(model).__name__}; wrap your function in a Module")
    return model


def check_stage_count(num_stages: Any) -> int:
    """``num_stages`` must be a plain int >= 1 (a bool is not a stage count)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise InvalidArgumentTypeError(
            f"num_stages must be an int, got {type(num_stages).__name__} {num_stages!r}")
    if num_stages < 1:
        raise InvalidArgumentError(f"num_stages must be at least 1, got {num_stages}")
    return num_stages


def example_inputs_of(example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> ExampleInputs | None:
    """Normalise the example inputs: a single tensor, a tuple or list of arguments, or None."""
    if example_inputs is None and not example_kwargs:
        return None
    if example_inputs is None:
        args: tuple[Any, ...] = ()
    elif isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        raise InvalidArgumentTypeError(
            "example_inputs must be a tensor or a tuple of positional arguments, "
            f"got {type(example_inputs).__name__}; pass keyword arguments as example_kwargs")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise InvalidArgumentTypeError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    return ExampleInputs(args, dict(example_kwargs or {}))


def default_pipeline(num_stages: int, cost: str = "params", verify: bool = True) -> Pipeline:
    """``trace,build-dag,linearize,split{stages=K cost=C},emit`` plus ``verify`` when asked."""
    steps: list[Pass] = [TracePass(), BuildDagPass(), LinearizePass(), SplitPass(stages=num_stages, cost=cost), EmitPass()]
    if verify:
        steps.append(VerifyPass())
    return Pipeline(steps)


def _bind(pipeline: Pipeline, option: str, value: Any, call_default: Any) -> Pipeline:
    """Give every pass with ``option`` the call's value, unless the call left it at its default.

    A pass that does not set the option takes the call's value; a pipeline and a call that set
    it to different values are refused rather than guessed between.
    """
    for index, step in enumerate(pipeline):
        if option not in {f.name for f in step.options()} or value == call_default:
            continue
        current = getattr(step, option)
        if not pipeline.sets_option(index, option):
            pipeline = pipeline.with_options(index, **{option: value})
        elif current != value:
            raise InvalidArgumentError(
                f"the pipeline's '{step.name}' has {option}={current!r} but shard_model was asked for "
                f"{option}={value!r}; make them agree or leave the option out of the pipeline")
    return pipeline


def bind_pipeline(pipeline: Pipeline | str, num_stages: int, cost: str) -> Pipeline:
    """Parse a spec if needed and fill in the stage count and cost the call asked for."""
    if isinstance(pipeline, str):
        pipeline = Pipeline.parse(pipeline)
    if not isinstance(pipeline, Pipeline):
        raise InvalidArgumentTypeError(
            f"pipeline must be a Pipeline or a spec string, got {type(pipeline).__name__}")
    return _bind(_bind(pipeline, "stages", num_stages, None), "cost", cost, "params")


def run_pipeline(
    model: nn.Module,
    pipeline: Pipeline,
    inputs: ExampleInputs | None,
    instruments: Iterable[Instrument] = (),
) -> PipelineResult:
    """Run ``pipeline`` on ``model``; the result's program holds every artifact."""
    check_model(model)
    ctx = PassContext(instruments=list(instruments))
    return pipeline.run(ShardProgram(model=model, example_inputs=inputs), ctx)


def shard_model(
    model: nn.Module,
    num_stages: int,
    example_inputs: Sequence[Any] | torch.Tensor | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    cost: str = "params",
    pipeline: Pipeline | str | None = None,
    *,
    instruments: Iterable[Instrument] = (),
) -> ShardedModel:
    """Split ``model`` into exactly ``num_stages`` ordered stages.

    The stages hold the model's own parameters; ``sharded(*args, **kwargs)`` returns what
    ``model(*args, **kwargs)`` returns. With example inputs the result is verified against the
    model before it is returned. The model itself is never modified.
    """
    check_model(model)
    num_stages = check_stage_count(num_stages)
    inputs = example_inputs_of(example_inputs, example_kwargs)
    if pipeline is None:
        chosen = default_pipeline(num_stages, cost, verify=inputs is not None)
    else:
        chosen = bind_pipeline(pipeline, num_stages, cost)
    program = run_pipeline(model, chosen, inputs, instruments).program
    if program.sharded is None:
        raise PipelineValidationError(
            f"the pipeline '{chosen}' produced no stages; end it with 'emit' (and 'verify')")
    return program.sharded
