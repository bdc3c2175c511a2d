"""Run one stage of a plan alone, on real tensors, as the pipeline would: the inputs it receives,
a fresh copy of them per microbatch, and the model given back as it was afterwards. What the
measurements of a stage (``measure_stage_memory``, ``measure_stage_time``) share."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Iterator, Mapping

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from autoshard.arguments import whole_number
from autoshard.costs.layouts import sent_as_copy
from autoshard.errors import InputMismatchError, InvalidArgumentError, InvalidArgumentTypeError, plural
from autoshard.sharded import ShardedModel, moved_to, stage_device


def checked_stage(sharded: Any, stage: Any, caller: str) -> int:
    """``stage`` as an index into ``sharded``'s stages, or a typed error saying what to pass; refused
    when it or a stage before it (they run to make its inputs) is on the meta device."""
    checked_plan(sharded, caller)
    k = sharded.num_stages
    stage = whole_number(stage, "stage")
    if not 0 <= stage < k:
        raise InvalidArgumentError(
            f"stage {stage} is out of range: the plan has {plural(k, 'stage')}; pass a stage from 0 to {k - 1}")
    refuse_meta(sharded, stage, caller)
    return stage


def checked_plan(sharded: Any, caller: str) -> ShardedModel:
    """``sharded``, or a typed error when it is not what ``shard_model`` returns."""
    if not isinstance(sharded, ShardedModel):
        raise InvalidArgumentTypeError(
            f"{caller} needs the ShardedModel that shard_model returned, got {type(sharded).__name__}")
    return sharded


def refuse_meta(sharded: ShardedModel, last: int, caller: str) -> None:
    """A typed error when a stage up to ``last`` is on the meta device, where kernels compute nothing
    to measure (a pipeline rank's other stages may stay there)."""
    on_meta = stages_on_meta(sharded, last)
    if on_meta:
        raise InvalidArgumentError(
            f"{caller} runs stages 0 to {last} on real tensors, and stage{'s' if len(on_meta) > 1 else ''} "
            f"{', '.join(map(str, on_meta))} {'are' if len(on_meta) > 1 else 'is'} on the meta device, where nothing "
            "is computed: move the model to a real device (plan_report(sharded) predicts without running it)")


def stages_on_meta(sharded: ShardedModel, last: int | None = None) -> list[int]:
    """The stages up to ``last`` (every stage by default) whose weights are on the meta device."""
    stages = sharded.stages if last is None else sharded.stages[: last + 1]
    return [j for j, module in enumerate(stages) if getattr(stage_device(module), "type", None) == "meta"]


def checked_call(sharded: ShardedModel, args: Any, kwargs: Any, caller: str) -> tuple[tuple, dict]:
    """The model's inputs as ``(args, kwargs)``, refused with a typed error when they are not a
    sequence and a mapping, on the meta device (nothing is computed there), or not binding to the
    model's arguments (``fit_call``), before anything is measured."""
    if not isinstance(args, (tuple, list)):
        raise InvalidArgumentTypeError(f"{caller}'s example_inputs must be a tuple of the model's positional inputs, "
                                       f"got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidArgumentTypeError(f"{caller}'s example_kwargs must be a dict of the model's keyword inputs, got "
                                       f"{type(kwargs).__name__}")
    args, kwargs = tuple(args), dict(kwargs or {})
    if any(t.device.type == "meta" for t in tensors_in((args, kwargs))):
        raise InvalidArgumentError(f"{caller} runs the stages on real tensors, and some inputs are on the meta device: "
                                   "pass real ones")
    try:
        sharded.fit_call(args, kwargs)
    except InputMismatchError as exc:
        if args or kwargs:
            raise
        raise InputMismatchError(
            f"{caller} runs the stages on one microbatch of the model's inputs, and none were given: pass them as "
            f"its example_inputs (a tuple of positional inputs) and example_kwargs (a dict of keyword inputs), as "
            "the model is called") from exc
    return args, kwargs


@contextlib.contextmanager
def model_kept(sharded: ShardedModel) -> Iterator[None]:
    """Run with gradients enabled and out of inference mode (a caller under ``no_grad`` or
    ``inference_mode`` would get no backward) and from no gradients (autograd would add into the
    user's), then give back the model's gradients, buffer values (BatchNorm statistics) and random
    state: the CPU's and every CUDA device's (a stage without weights runs where its inputs are;
    the stages before the measured one run too). The model's own weights count too: a
    specialisation chosen for the inputs (``serving_plan``) may run modules the plan's stages do
    not hold."""
    owners = [sharded, *(made.sharded for made in sharded.specializations)]
    owners += [sharded.specializer.model] if sharded.specializer is not None else []
    params = list({id(p): p for owner in owners for p in owner.parameters()}.values())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in {id(b): b for owner in owners for b in owner.buffers()}.values()
               if not b.is_meta]  # nothing on the meta device changes
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda), torch.inference_mode(False), torch.enable_grad():
        try:
            yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    if not torch.equal(b, saved):
                        b.copy_(saved)


def running_device(module: torch.nn.Module, inputs: Any) -> torch.device:
    """Where a stage runs: its weights' device; for a stage without weights, its inputs'; else the CPU."""
    found = stage_device(module)
    if found is None:
        found = next((t.device for t in tensors_in(inputs)), None)
    return found or torch.device("cpu")


def serving_plan(sharded: ShardedModel, args: tuple, kwargs: dict) -> ShardedModel:
    """The plan that serves these inputs, as ``sharded(*args, **kwargs)`` chooses it: the plan itself,
    else the specialisation whose guards hold, made now if none does (a microbatch smaller than
    the plan's example may flip a branch). Chosen by running every stage once, under ``model_kept``,
    which sets the grad mode the measurement runs in (a capture fixes the grad mode it sees) and
    gives the weights, buffers and random state back. Where each call of that plan writes a setting
    of the model that its next call reads (a Hugging Face classifier's ``config.problem_type``, on its
    first call with labels), the plan made for the model as a call leaves it (``Specializer.settled``):
    a measurement runs the stage again and again. Where a stage is on the meta device none runs
    to choose: the plan captured for inputs like these (``sharded.specialize`` makes one), else the
    plan itself."""
    specializer = sharded.specializer
    if specializer is None:
        return sharded
    if stages_on_meta(sharded):
        return specializer.made_for(sharded, args, kwargs) or sharded
    args, kwargs = autograd_usable((args, kwargs))
    return specializer.settled(sharded, specializer.serve(sharded, args, kwargs, run=_ran, given_back=True),
                               (args, kwargs))


def _ran(plan: ShardedModel, args: tuple, kwargs: dict) -> ShardedModel:
    plan.run_stages(args, kwargs)
    return plan


def stage_inputs(sharded: ShardedModel, stage: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """One microbatch of what ``stage`` receives: the model's inputs, or what the stages before it
    send."""
    args, kwargs = autograd_usable((args, kwargs))
    args, kwargs = sharded.fit_call(args, kwargs)
    first = sharded.stages[0]
    args, kwargs = moved_to(stage_device(first), args), moved_to(stage_device(first), kwargs)
    if stage == 0:
        return args, kwargs
    values = first(*args, **kwargs)
    for later in sharded.stages[1:stage]:
        values = later(*moved_to(stage_device(later), values))
    sent = moved_to(stage_device(sharded.stages[stage]), values)
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), sent), {}


def autograd_usable(values: Any) -> Any:
    """``values`` with tensors made under ``inference_mode`` copied: autograd cannot save those for a
    backward."""
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t.is_inference() else t, values)


def fresh_copy(values: Any, receives_gradients: bool) -> Any:
    """A microbatch's own copy of ``values``; a stage after the first sends gradients back for the
    inputs that required grad where they were made, as ``PipelineStage``'s receive buffers do
    (torch 2.13: the sender's ``requires_grad``, not every floating-point tensor). Laid out as the wire
    delivers them (``runtime.wire``): as they are where they fill their storage (a transpose crosses
    permuted and is permuted back), contiguous where not (a slice crosses as a copy), as ``clone``
    lays out a copy."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        # ``clone`` keeps the order of a value with gaps (a transposed slice), which the wire sends contiguous
        wired = torch.contiguous_format if receives_gradients and sent_as_copy(t) else torch.preserve_format
        return t.detach().clone(memory_format=wired).requires_grad_(receives_gradients and t.requires_grad)
    return tree_map_only(torch.Tensor, copy, values)


def tensors_in(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values``, nested ones too."""
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]


def plan_fingerprint(sharded: ShardedModel) -> str:
    """A digest of the split that is the same in every process that made the same plan."""
    plan = sharded.plan
    text = repr((plan.boundaries, sorted(plan.assignment.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
