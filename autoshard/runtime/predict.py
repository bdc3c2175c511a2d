"""``predict_step``: one training step of a plan, predicted from its stages each timed whole and the
runtime's own costs measured on this machine: the most faithful of the step predictions
(``plan_report``'s comes from per-node times, before the stages exist)."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from autoshard.arguments import whole_number
from autoshard.costs.step_time import (
    StepTime, StepTimeModel, checked_step, format_seconds, is_default, run_of, step_time,
)
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, first_few, plural, user_stacklevel
from autoshard.runtime.calibrate import RUNTIME_FIELDS, calibrate_runtime, calibrated_fields
from autoshard.runtime.replay import checked_call, checked_plan, refuse_meta
from autoshard.runtime.stage_time import TIMING_REPEATS, StageTimeMeasurement, time_stages, timed_plan
from autoshard.sharded import ShardedModel, stage_device


class EvalModeStepWarning(UserWarning):
    """A training step predicted from stages captured in eval mode that hold modules (dropout,
    batch norm) which run otherwise in training."""


class TimingSpreadWarning(UserWarning):
    """A step predicted from stage timings whose runs spread widely: the machine was busy or still
    warming up while they ran, so the prediction is as uncertain."""


#: The spread (``StageTimeMeasurement.spread``) above which a prediction warns.
SPREAD_WARNED = 0.5


def predict_step(
    sharded: ShardedModel,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    step: StepTimeModel | None = None,
    calibrate: bool | None = None,
    repeats: int = TIMING_REPEATS,
    times: Sequence[StageTimeMeasurement] | None = None,
    threads: int | None = None,
) -> StepTime:
    """One training step of ``sharded`` under ``step`` (default: the schedule, microbatches and stages
    per rank of the plan's memory model, as ``plan_report`` predicts it), predicted from each stage
    timed whole (``measure_stage_time``) on one microbatch, and its optimizer step (the plan's memory
    model's optimizer) after each rank's last op; the links carry the bytes the timed stages
    sent, so a microbatch of another size than the plan's example moves its own bytes. With
    ``calibrate`` (by default when every stage is on the CPU) the link, the runtime's time per
    message and how much longer the stages compute inside it are this machine's, measured with the
    real runtime on two local gloo processes (``calibrate_runtime``, cached), each one ``step``
    leaves at its default: ``link_bandwidth``, ``link_latency``, ``message_seconds`` or
    ``compute_scale`` given there are kept. Without it they are all ``step``'s own (give the
    interconnect's for GPUs). ``threads``: torch's threads the stages are timed on; by default one
    where the runtime is calibrated (its two ranks run one each, as torchrun starts ranks), else the
    caller's (``torch.get_num_threads()``): give what each rank will run. ``times``, one
    ``measure_stage_time`` per stage in order, predicts from stages timed before: several schedules
    from one timing (the inputs are not used then); times of the specialisation that serves a
    microbatch the plan's guards refuse count as the plan's. Every argument, whether the inputs bind
    to the model's arguments, and whether PyTorch's schedule runs the step, are checked before
    anything is measured (the plan's guards check the inputs when the stages run)."""
    checked_plan(sharded, "predict_step")
    planned = step is None
    step = run_of(sharded.plan.memory_model) if step is None else checked_step(step)
    k = sharded.num_stages
    refused = step.refusal(k)
    if refused is not None:  # without step=, the counts came from the plan, which the user may not know
        m = step.microbatch_count(k)
        raise InvalidArgumentError(refused + (
            f" (the plan's memory model's step: {step.schedule}, {m} microbatch{'' if m == 1 else 'es'}; pass "
            "step=StepTimeModel(schedule, microbatches) to predict another)" if planned else ""))
    if times is not None and not isinstance(times, (list, tuple)):
        raise InvalidArgumentTypeError(f"times must be a list of StageTimeMeasurement, one per stage, got "
                                       f"{type(times).__name__}")
    if times is not None and [getattr(t, "stage", None) for t in times] != list(range(k)):
        raise InvalidArgumentError(
            f"times must be one StageTimeMeasurement per stage, stages 0 to {k - 1} in order; got "
            f"{[getattr(t, 'stage', type(t).__name__) for t in times]}")
    timed_on = {getattr(t, "plan", None) for t in times or ()}
    if times is not None and not (len(timed_on) == 1 and timed_on <= {
            timed_plan(plan) for plan in [sharded, *(made.sharded for made in sharded.specializations)]}):
        raise InvalidArgumentError(
            "times were measured on another plan (another model, split, width or device) or on several: time this "
            "plan's stages on one microbatch, "
            "[measure_stage_time(sharded, j, inputs) for j in range(sharded.num_stages)]")
    if calibrate is not None and not isinstance(calibrate, bool):
        raise InvalidArgumentTypeError(f"calibrate must be True, False or None (on the CPU only), got {calibrate!r}")
    on_cpu = all((stage_device(module) or torch.device("cpu")).type == "cpu" for module in sharded.stages)
    if calibrate is None:
        calibrate = on_cpu
    elif calibrate and not on_cpu:
        raise InvalidArgumentError(
            "calibrate=True measures gloo between local CPU processes, and some stages are on an accelerator: pass "
            "calibrate=False (the default for them) with the interconnect's link_bandwidth and link_latency in step=")
    if times is None:  # inputs that do not bind to the model's arguments are refused before anything is measured
        refuse_meta(sharded, k - 1, "predict_step")
        call = checked_call(sharded, example_inputs, example_kwargs, "predict_step")
        repeats = whole_number(repeats, "repeats", at_least=1)
    threads = None if threads is None else whole_number(threads, "threads", at_least=1)
    modal = _mode_dependent(sharded) if not sharded.plan.training else []
    if modal:
        warnings.warn(
            f"this plan was captured in eval mode, so its stages are timed as in evaluation ({first_few(modal, 3)} "
            f"run as they do in eval), unlike a training step; shard the model after model.train() to "
            "predict one (on the command line: make TARGET return the model in training mode)", EvalModeStepWarning,
            stacklevel=user_stacklevel())
    measured = calibrated_fields(step) if calibrate else []
    if measured:
        step = calibrate_runtime().applied_to(step)
    if times is None:  # the calibrated runtime's ranks run one thread each: its stages are timed so
        times = time_stages(sharded, range(k), *call, repeats, threads or (1 if measured else None))
    widest = max(times, key=lambda t: t.spread)
    if widest.spread > SPREAD_WARNED:
        warnings.warn(
            f"stage {widest.stage}'s timed runs spread {widest.spread:.0%} (their middle half's width over the "
            "median): the machine was busy or still warming up, so this step is as uncertain; predict again on a "
            "quiet machine, or with more repeats= (on the command line: --time-repeats)", TimingSpreadWarning,
            stacklevel=user_stacklevel())
    ran_on = {t.threads for t in times} - {0}
    on_threads = f" on {plural(ran_on.pop(), 'thread')}" if len(ran_on) == 1 else ""
    stepped = [t.optimizer_step for t in times] if any(t.optimizer_step for t in times) else []
    source = (f"each stage timed whole on one microbatch (measure_stage_time{on_threads}; its runs spread up to "
              f"{widest.spread:.0%}), " + (f"then its {sharded.plan.memory_model.optimizer} step" if stepped
                                           else "no optimizer step timed"))
    described = {"link_bandwidth": f"link {step.link_bandwidth / 1e9:.3g} GB/s",
                 "link_latency": f"latency {format_seconds(step.link_latency)}" if step.link_latency else "no latency",
                 "message_seconds": (f"{format_seconds(step.message_seconds)} per message" if step.message_seconds
                                     else "none per message"),
                 "compute_scale": (f"compute x{step.compute_scale:.2f}" if step.compute_scale != 1
                                   else "compute as timed alone")}
    rest = [name for name in RUNTIME_FIELDS if name not in measured]
    # the defaults said too: gloo on one machine and a free runtime can move the step several times over
    for heading, names in (("calibrated with the runtime (calibrate_runtime)", measured),
                           ("as given", [name for name in rest if not is_default(getattr(step, name))]),
                           ("StepTimeModel's defaults, not calibrated",
                            [name for name in rest if is_default(getattr(step, name))])):
        if names:
            source += f"; {heading}: {', '.join(described[name] for name in names)}"
    return step_time([t.forward for t in times], [t.backward for t in times], [t.sent_bytes for t in times[:-1]],
                     step, source, stepped)


def _mode_dependent(sharded: ShardedModel) -> list[str]:
    """The stages' modules known to run otherwise in training (dropout that drops, batch norm), by name:
    a type and a stage alone read 'Dropout in stage 0, Dropout in stage 0, ...'."""
    kinds = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm, nn.RReLU)
    return [f"{name} ({type(module).__name__}, stage {j})" for j, stage in enumerate(sharded.stages)
            for name, module in stage.named_modules() if isinstance(module, kinds) and getattr(module, "p", 1.0) > 0]


__all__ = ["EvalModeStepWarning", "TimingSpreadWarning", "predict_step"]
