"""``shard_model``: the one call most users need."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from autoshard.arguments import byte_count, real_number, whole_number
from autoshard.costs.execution import holds_meta_tensors
from autoshard.costs.memory import check_memory_budgets, stage_memory
from autoshard.costs.memory_model import MemoryModel
from autoshard.errors import (
    InvalidArgumentError, InvalidArgumentTypeError, PipelineValidationError, VerificationError, brief, first_few,
    keywords_named, plural, shown, user_stacklevel,
)
from autoshard.isolation import arguments_drawn_from
from autoshard.passes.analyses import (
    CostModel,
    CostNode,
    callable_cost_model,
    run_local_name,
    use_cost_model,
    use_memory_model,
)
from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram
from autoshard.passes.capture import CapturePass
from autoshard.passes.constrain import CONSTRAINT_PASSES, with_constraints
from autoshard.passes.dag import BuildDagPass
from autoshard.passes.emit import EmitPass
from autoshard.passes.instruments import Instrument
from autoshard.passes.linearize import LinearizePass
from autoshard.passes.pipeline import Pipeline, PipelineResult
from autoshard.passes.profile import ProfilePass
from autoshard.passes.shapes import ShapePropPass
from autoshard.passes.split import SplitPass
from autoshard.passes.stages import bind_stages, check_stages_made
from autoshard.passes.trace import TracePass
from autoshard.passes.verify import VerifyPass
from autoshard.plan_format.fits import UnmeasuredMemoryWarning
from autoshard.plan_origin import PlanOrigin
from autoshard.sharded import ShardedModel, StagePlan
from autoshard.specialize import MAX_SPECIALIZATIONS, Specializer

CostFunction = Callable[[CostNode], float]


def check_model(model: Any) -> nn.Module:
    """``model``, or a refusal that says what to pass instead of what was given."""
    if isinstance(model, torch.jit.ScriptModule):
        raise InvalidArgumentTypeError(
            f"autoshard splits an eager torch.nn.Module, got a TorchScript {type(model).__name__} (torch.jit.script "
            "or torch.jit.trace), whose compiled code it cannot capture; pass the module it was made from")
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, Mapping) and model and all(isinstance(v, torch.Tensor) for v in model.values()):
        raise InvalidArgumentTypeError(
            f"autoshard splits a torch.nn.Module, got a state dict ({len(model)} tensors): it holds the weights, "
            "not the code that runs them; build the model, load them with model.load_state_dict(state_dict) "
            "and pass the model")
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise InvalidArgumentTypeError(
            f"autoshard splits a torch.nn.Module, got the class {model.__name__} itself; pass a model made from "
            f"it ({model.__name__}(...))")
    advice = "wrap your function in a Module" if callable(model) else "pass the model (an nn.Module) itself"
    raise InvalidArgumentTypeError(f"autoshard splits a torch.nn.Module, got {type(model).__name__}; {advice}")


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


def check_flags(**flags: Any) -> None:
    """Refuse a flag that is not a bool (``verify="no"`` would verify)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise InvalidArgumentTypeError(f"{name} must be True or False, got {flag!r}")


def _per_stage(name: str, values: Any, num_stages: int, positive: bool, one: bool = False,
               kind: str = "number") -> tuple[float, ...]:
    """``values`` checked as one number per stage (``one``: the single number given for every stage);
    ``kind`` is what the refusals call an entry (``max_memory`` takes sizes such as ``"40GiB"`` too)."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        takes = (f"a {kind} or a list with one per stage" if name == "max_memory"
                 else f"a list with one {kind} per stage")
        raise InvalidArgumentTypeError(f"{name} must be {takes}, got {values!r}")
    if len(values) != num_stages:
        raise InvalidArgumentError(
            f"{name} has {'1 entry' if len(values) == 1 else f'{len(values)} entries'} but there "
            f"{'is 1 stage' if num_stages == 1 else f'are {num_stages} stages'}; give one per stage")
    parsed = [real_number(v) for v in values]
    for j, (v, number) in enumerate(zip(values, parsed)):
        if number is None:
            raise InvalidArgumentTypeError(f"{name}[{j}] must be a {kind}, got {v!r}")
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise InvalidArgumentError(f"{name if one else f'{name}[{j}]'} must be finite and "
                                       f"{'> 0' if positive else '>= 0'}, got {v!r}")
    return tuple(parsed)


def stage_limits(num_stages: int, capacities: Any = None, max_memory: Any = None) -> dict[str, tuple[float, ...]]:
    """The split options ``capacities`` and ``max_memory``, checked: one number per stage each.

    A single number for ``max_memory`` is every stage's budget; its numbers may be byte strings
    (``"40GiB"``, ``"512MB"``), as on the command line. Options not given are left out.
    """
    limits = {}
    if capacities is not None:
        if real_number(capacities) is not None:  # (one speed for every stage balances as none does)
            example = [1.0] * (num_stages - 1) + [2.0]
            raise InvalidArgumentTypeError(
                f"capacities takes one number per stage, its relative speed (such as {example}), got {capacities!r}; "
                "leave it out where the stages are equally fast")
        limits["capacities"] = _per_stage("capacities", capacities, num_stages, positive=True)
    if isinstance(max_memory, str) and "," in max_memory:  # the flag's form, "takes bytes" alone did not say so
        raise InvalidArgumentError(
            f"max_memory is one value for every stage or a list with one per stage, got {max_memory!r}: write "
            f"max_memory={[part.strip() for part in max_memory.split(',')]!r}")
    if isinstance(max_memory, str):
        max_memory = byte_count(max_memory, "max_memory")
    elif isinstance(max_memory, (list, tuple)):
        max_memory = [byte_count(v, f"max_memory[{j}]") if isinstance(v, str) else v for j, v in enumerate(max_memory)]
    one = real_number(max_memory) is not None  # every stage's budget: named as given, not as max_memory[0]
    if one:
        max_memory = [max_memory] * num_stages
    if max_memory is not None:  # (0: nothing fits)
        limits["max_memory"] = _per_stage("max_memory", max_memory, num_stages, positive=True, one=one,
                                          kind="number of bytes or a size such as '40GiB'")
    return limits


def default_pipeline(
    num_stages: int,
    cost: str = "params",
    verify: bool = True,
    *,
    shapes: bool | None = None,
    time_profile: str | None = None,
    capacities: Sequence[float] | None = None,
    max_memory: Sequence[float | str] | float | str | None = None,
    tolerance: float = 0.0,
) -> Pipeline:
    """``capture,shape-prop,build-dag,linearize,split{stages=K cost=C},emit,verify``.

    ``shape-prop`` runs when ``shapes`` is true (default: when ``verify`` is: both need example
    inputs); ``profile`` runs when ``cost`` is ``time`` or a ``time_profile`` path is given;
    ``verify`` when asked. ``capacities``, ``max_memory`` and ``tolerance`` go to the split.
    """
    steps: list[Pass] = [CapturePass()]
    if verify if shapes is None else shapes:
        steps.append(ShapePropPass())
    if cost == "time" or time_profile is not None:
        steps.append(ProfilePass(path=time_profile))
    limits = stage_limits(num_stages, capacities, max_memory)
    steps += [BuildDagPass(), LinearizePass(), SplitPass(cost=cost, tolerance=tolerance, **limits), EmitPass()]
    if verify:
        steps.append(VerifyPass())
    return bind_stages(Pipeline(steps), num_stages)


def _bind(pipeline: Pipeline, option: str, value: Any, call_default: Any) -> Pipeline:
    """Give every pass with ``option`` the call's value, unless the call left it at its default.

    A pass that does not set the option takes the call's value; a pipeline and a call that set
    it to different values are refused rather than guessed between. (The stage count, which the
    call always gives, is decided by ``passes.stages.bind_stages``.)
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


def bind_pipeline(
    pipeline: Pipeline | str,
    num_stages: int,
    cost: str,
    *,
    capacities: Sequence[float] | None = None,
    max_memory: Sequence[float | str] | float | str | None = None,
    tolerance: float = 0.0,
    asker: str = "num_stages",
) -> Pipeline:
    """Parse a spec if needed and fill in the stage count, cost, tolerance and per-stage limits the call
    asked for; ``asker`` names where the stage count came from (``--stages`` on the command line)."""
    if isinstance(pipeline, str):
        pipeline = Pipeline.parse(pipeline)
    if not isinstance(pipeline, Pipeline):
        raise InvalidArgumentTypeError(
            f"pipeline must be a Pipeline or a spec string, got {type(pipeline).__name__}")
    limits = stage_limits(num_stages, capacities, max_memory)
    for option in [*limits, *(["cost"] if cost != "params" else []), *(["tolerance"] if tolerance != 0 else [])]:
        if not any(option in {f.name for f in step.options()} for step in pipeline):
            raise InvalidArgumentError(
                f"{option}= was given, but no pass of the pipeline '{pipeline}' takes it; add 'split'")
    pipeline = _bind(bind_stages(pipeline, num_stages, asker), "cost", cost, "params")
    pipeline = _bind(pipeline, "tolerance", tolerance, 0.0)
    for option, value in limits.items():
        pipeline = _bind(pipeline, option, value, ())
    return pipeline


def steps_at(pipeline: Pipeline, indices: Sequence[int]) -> Pipeline:
    """The steps of ``pipeline`` at ``indices``, each with its spec as it was written."""
    kept = Pipeline()
    for index in indices:
        kept += pipeline[index:index + 1]
    return kept


def without_verify(pipeline: Pipeline) -> Pipeline:
    """The pipeline minus its verifying passes."""
    return steps_at(pipeline, [i for i, step in enumerate(pipeline) if "verification" not in step.provides])


def run_pipeline(
    model: nn.Module,
    pipeline: Pipeline,
    inputs: ExampleInputs | None,
    instruments: Iterable[Instrument] = (),
    cost_models: Mapping[str, CostModel] | None = None,
    memory_model: MemoryModel | None = None,
) -> PipelineResult:
    """Run ``pipeline`` on ``model``; the result's program holds every artifact.

    ``cost_models`` are available by name to this run only (a user's cost function).
    """
    check_model(model)
    if not isinstance(instruments, Iterable) or isinstance(instruments, Instrument):
        raise InvalidArgumentTypeError(f"instruments must be a list of Instrument instances, got {instruments!r}")
    ctx = PassContext(instruments=list(instruments))
    for name, cost_model in (cost_models or {}).items():
        use_cost_model(ctx, name, cost_model)
    if memory_model is not None:
        use_memory_model(ctx, memory_model)
    with arguments_drawn_from(*((inputs.args, inputs.kwargs) if inputs is not None else ())):
        result = pipeline.run(ShardProgram(model=model, example_inputs=inputs), ctx)
    traced = result.program.traced
    if traced is not None and traced.difference and not any(p.name == VerifyPass.name for p in pipeline.passes) \
            and not holds_meta_tensors(model, inputs):  # (on meta no run compares values)
        raise VerificationError(  # (verify's own refusal says more: the likely causes)
            f"the captured graph differs from the model on the example ({traced.difference}), and no front end "
            f"captured it as it computes ({'; '.join(traced.considered)}); without the verify pass nothing else would "
            "say so. Shard with verification for the likely causes", stage=None)
    return result


def _cost_name(cost: Any) -> tuple[str, dict[str, CostModel]]:
    """A cost model name, and the run-local model a user's cost function is registered as."""
    if isinstance(cost, str):
        return cost, {}
    if callable(cost):
        name = run_local_name(cost)
        return name, {name: callable_cost_model(cost)}
    raise InvalidArgumentTypeError(
        f"cost must be a cost model name (params, flops, ...) or a function cost(node) -> float, got {cost!r}")


@keywords_named
def shard_model(
    model: nn.Module,
    num_stages: int,
    example_inputs: Sequence[Any] | torch.Tensor | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    cost: str | CostFunction = "params",
    pipeline: Pipeline | str | None = None,
    *,
    instruments: Iterable[Instrument] = (),
    capacities: Sequence[float] | None = None,
    max_memory: Sequence[float | str] | float | str | None = None,
    tolerance: float = 0.0,
    time_profile: str | os.PathLike[str] | None = None,
    memory_model: MemoryModel | None = None,
    pin: Mapping[str, int] | None = None,
    no_split: Sequence[str] | None = None,
    cut_before: Sequence[str] | None = None,
    respecialize: bool = True,
    max_specializations: int = MAX_SPECIALIZATIONS,
    verify: bool = True,
) -> ShardedModel:
    """Split ``model`` into exactly ``num_stages`` ordered stages.

    The stages hold the model's own parameters; ``sharded(*args, **kwargs)`` returns what
    ``model(*args, **kwargs)`` returns. With example inputs the result is verified against the
    model before it is returned (not for a model on the meta device, which has no values to
    compare; it is planned with fake tensors). The model itself is never modified.

    ``cost`` is a registered cost model (``params``, ``flops``, ``activations``, ``memory``,
    ``time``, ``nodes``) or a function ``cost(node: CostNode) -> float``; ``params`` and
    ``memory`` count a tied weight once in every stage that holds it. ``capacities`` gives each
    stage's relative speed (stage j's cost / capacities[j] is balanced); ``max_memory`` each
    stage's budget (or one for all; bytes, or a size such as ``"40GiB"``) of training memory as
    ``memory_model`` counts it (``autoshard.costs.memory``; docs/splitting.md, "Memory budgets"):
    weights, gradients and optimizer state, the saved activations and the values received and sent
    of every microbatch in flight at that stage under its schedule, one backward, and the receive
    buffers of the step's microbatches. The split looks for the best-balanced plan that fits, and
    the final plan is checked again; a budget no plan fits raises ``InfeasibleSplitError``
    naming the stage that is short and by how much. ``tolerance`` lets the costliest stage cost up
    to that fraction more than the best balance where fewer bytes then cross the boundaries (0.1: a
    cut between two blocks rather than inside one, sending a 4x-wide hidden value).
    ``time_profile`` is a JSON file of measured node times, loaded when it exists and written
    otherwise; a loaded profile keeps its settings (whether it timed the backward, which the step
    time reads). ``memory_model``
    (``autoshard.MemoryModel(optimizer_bytes_per_param=..., microbatches=...)``) is the optimizer
    and schedule that ``cost="memory"`` and ``max_memory`` plan for (default: Adam, 8 bytes per
    parameter, 1F1B with one microbatch per stage); the plan keeps it, so ``plan_report`` reports with it.
    ``pin`` holds modules, classes or weights to stages (``{"blocks.0": 0, "lm_head.weight": 3}``),
    ``no_split`` keeps modules (paths or class names) whole, ``cut_before`` starts a stage at each
    module: they become ``pin``, ``no-split`` and ``cut-before`` passes before the split.
    With ``respecialize`` (and example inputs), a call that flips a size or branch the capture
    fixed, or passes other constants or arguments than the example (``labels=``), captures the
    model again for that call, with every weight held in its stage
    (``autoshard.specialize``), at most ``max_specializations`` times; ``sharded.specializations``
    lists them. ``respecialize=False`` refuses such calls. ``verify=False`` skips running the model
    and the stages on the example to compare them (the pipeline's ``verify`` passes too).
    """
    check_model(model)
    if isinstance(example_inputs, int) and not isinstance(num_stages, int):
        raise InvalidArgumentTypeError(f"num_stages must be an int, got {shown(num_stages)}, and example_inputs is "
                                       f"{example_inputs}: the stage count comes first, "
                                       "shard_model(model, num_stages, example_inputs)")
    num_stages = whole_number(num_stages, "num_stages", at_least=1)
    check_flags(respecialize=respecialize, verify=verify)
    max_specializations = whole_number(max_specializations, "max_specializations", at_least=0)
    inputs = example_inputs_of(example_inputs, example_kwargs)
    cost_name, cost_models = _cost_name(cost)
    if pipeline is None:
        on_meta = inputs is not None and holds_meta_tensors(model, inputs)
        chosen = default_pipeline(
            num_stages, cost_name, verify=verify and inputs is not None and not on_meta, shapes=inputs is not None,
            time_profile=None if time_profile is None else os.fspath(time_profile),
            capacities=capacities, max_memory=max_memory, tolerance=tolerance)
        if inputs is None:
            _refuse_measuring_without_inputs(chosen, cost_name, max_memory)
    else:
        if time_profile is not None:
            raise InvalidArgumentError("time_profile= applies to the default pipeline; with a pipeline, "
                                       "write profile{path=...} in it")
        chosen = bind_pipeline(pipeline, num_stages, cost_name, capacities=capacities, max_memory=max_memory,
                               tolerance=tolerance)
        if not any("sharded" in step.provides for step in chosen):
            raise PipelineValidationError(f"the pipeline '{chosen}' makes no stages; end it with 'emit' (and 'verify')")
    chosen = with_constraints(chosen, pin, no_split, cut_before)
    if not verify:
        chosen = without_verify(chosen)
    if memory_model is not None and not isinstance(memory_model, MemoryModel):
        raise InvalidArgumentTypeError(
            f"memory_model must be an autoshard.MemoryModel(optimizer=..., schedule=..., microbatches=...), "
            f"got {shown(memory_model)}")
    if memory_model is not None:  # before the split: a schedule these stages cannot run has no memory or step
        memory_model.all_in_flight(num_stages)
    program = run_pipeline(model, chosen, inputs, instruments, cost_models, memory_model).program
    check_stages_made(num_stages, len(program.sharded.stages), chosen)
    budgets = stage_limits(num_stages, max_memory=max_memory).get("max_memory")
    if budgets is not None and _limits_training_memory(chosen):
        plan = program.sharded.plan
        check_memory_budgets(stage_memory(plan.dag, plan.assignment, num_stages, memory_model or MemoryModel()),
                             budgets)
        _warn_unmeasured(plan)
    program.sharded.plan_origin = PlanOrigin.made(program, chosen, cost_models)  # for sharded.save_plan
    if respecialize and inputs is not None:
        program.sharded.specializer = specializer_for(model, num_stages, chosen, cost, memory_model, inputs,
                                                      max_specializations, program.sharded)
    return program.sharded


def _refuse_measuring_without_inputs(chosen: Pipeline, cost_name: str, max_memory: Any) -> None:
    """A cost or budget that counts what the model computes, asked without example inputs, named as
    the caller asked for it (the pipeline's refusal speaks of passes and artifacts)."""
    try:
        chosen.validate()
    except PipelineValidationError as exc:
        asked = [f"cost={cost_name!r}"] * (cost_name != "params") + [f"max_memory={brief(max_memory)}"] * (
            max_memory is not None)
        params = ", or plan by cost='params'" * (max_memory is None)
        raise InvalidArgumentError(
            f"{' and '.join(asked) or 'this pipeline'} counts what the model computes on example inputs, and none "
            f"were given: pass example_inputs= (and example_kwargs=){params}") from exc


def _warn_unmeasured(plan: StagePlan) -> None:
    """Warn where the budgets were met by counting some nodes' outputs only (``UnmeasuredMemoryWarning``):
    the plan report names them, but a plan made and used without a report held up to twice its budget."""
    unmeasured = [node for node, data in plan.dag.nodes(data=True)
                  if not data.get("input") and data.get("training") is None]
    if not unmeasured:
        return
    by_stage = sorted({plan.assignment[node] for node in unmeasured if node in plan.assignment})
    warnings.warn(
        f"max_memory was met counting {plural(len(unmeasured), 'node')} by their output's bytes only "
        f"({first_few(unmeasured)}: fake tensors could not run or size them, nor could a real run), in "
        f"{'stage' if len(by_stage) == 1 else 'stages'} {', '.join(map(str, by_stage))}: what "
        "they save for backward is not counted, so those stages may hold more than their budget; check each with "
        "autoshard.runtime.measure_stage_memory(sharded, stage, example_inputs) and lower max_memory by what it "
        "shows over", UnmeasuredMemoryWarning, stacklevel=user_stacklevel())


def specializer_for(model: nn.Module, num_stages: int, pipeline: Pipeline, cost: str | CostFunction,
                    memory_model: MemoryModel | None, example: ExampleInputs,
                    limit: int = MAX_SPECIALIZATIONS, primary: ShardedModel | None = None) -> Specializer:
    """The ``Specializer`` that captures ``model`` again with ``pipeline`` (which made the first plan),
    each weight pinned to the stage holding it. The pipeline's own constraints become optional (a
    split's own ``no-split`` and ``cut-before`` move into optional passes): a module another branch
    does not run is pinned, kept whole or cut before nowhere there. The capture traces through
    modules with forward hooks (``trace_hooks``): a layer the plan split that gained hooks since
    (Transformers installs them the first time hidden states are asked for) could not be kept whole
    with each weight in its stage. The example's inputs are kept where each call of ``primary`` (the first
    plan) writes a setting its next call reads anew (``Specializer.settled``)."""
    moved: dict[str, list[str]] = {"no_split": [], "cut_before": []}
    for index, step in enumerate(pipeline):
        if isinstance(step, CONSTRAINT_PASSES):
            pipeline = pipeline.with_options(index, optional=True)
        if isinstance(step, (CapturePass, TracePass)):  # a layer that gained hooks since stays splittable
            pipeline = pipeline.with_options(index, trace_hooks=True)
        own = {name: getattr(step, name) for name in moved if name in {f.name for f in step.options()}}
        if any(own.values()):
            pipeline = pipeline.with_options(index, **{name: () for name in own})
            for name, names in own.items():
                moved[name] += names
    pipeline = with_constraints(pipeline, no_split=moved["no_split"], cut_before=moved["cut_before"], optional=True)

    def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                pins: Mapping[str, int]) -> ShardedModel:
        return shard_model(model, num_stages, args, kwargs, cost, with_constraints(pipeline, pin=pins, optional=True),
                           memory_model=memory_model, respecialize=False)

    moving = primary is not None and bool(primary.attributes_moved_by_each_call())
    return Specializer(model, capture, limit, (example.args, dict(example.kwargs)), keep_example=moving)


def _limits_training_memory(pipeline: Pipeline) -> bool:
    """Whether the pipeline's split holds ``max_memory`` against the training-memory model."""
    return any(getattr(step, "memory_cost", None) == "memory" for step in pipeline)
