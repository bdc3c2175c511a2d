"""``measure_stage_time``: one stage's forward and backward, timed whole on real tensors.

A ``profile`` times each node alone and sums them per stage; a backward timed node by node pays
for starting autograd once per node where the stage's one backward pays once, so the sums run
13-38% above the stage (``benchmarks/RESULTS.md``, "Step time"). Once the plan exists, the stage
itself can be timed as the pipeline runs it: its forward on one microbatch of what it receives,
then its backward from a gradient of each output, and the optimizer's step over its weights, which
ends a training step (``autoshard.runtime.predict_step`` turns those into a step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from autoshard.arguments import whole_number
from autoshard.costs.execution import on_threads
from autoshard.runtime.optimizer_step import stand_ins
from autoshard.runtime.replay import (
    checked_call, checked_stage, fresh_copy, model_kept, plan_fingerprint, running_device, serving_plan, stage_inputs,
    tensors_in)
from autoshard.sharded import ShardedModel, stage_device

TIMING_REPEATS = 9
"""Timed runs of a stage after one warm-up; the median counts. Not the fastest, as the device
calibration keeps: a pipeline's step runs at the machine's typical speed, and its ops inside
``PipelineStage`` took the median of such runs, 10-40% above the fastest, on this project's VM."""


@dataclass(frozen=True)
class StageTimeMeasurement:
    """Seconds of one stage's ``forward`` and ``backward`` on one microbatch, the median of
    ``repeats`` runs on ``device``; ``sent_bytes``, the bytes of its outputs, which it sends the
    next stage (for the last stage, the model's outputs); ``plan``, the fingerprint of what it was
    timed in (``timed_plan``; ``predict_step`` refuses a timing of another); ``spread``, how far apart
    the runs were: the interquartile range over the median of forward + backward (a loaded machine
    shows here; one run stalled by a pause of the VM, which the median shrugs off, does not);
    ``threads``, torch's intra-op threads it ran on (0: not recorded); ``optimizer_step``, seconds of
    one step of the plan's optimizer over the stage's weights (the median of ``repeats``; 0: none)."""

    stage: int
    forward: float
    backward: float
    repeats: int
    device: str
    sent_bytes: int
    plan: str
    spread: float = 0.0
    threads: int = 0
    optimizer_step: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure_stage_time(
    sharded: ShardedModel,
    stage: int,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    repeats: int = TIMING_REPEATS,
    threads: int | None = None,
) -> StageTimeMeasurement:
    """Time stage ``stage`` of ``sharded`` whole on one microbatch (``example_inputs`` /
    ``example_kwargs``, the model's inputs): its forward, then its backward from a gradient of ones
    for each output that requires one, on a fresh copy of its inputs each run. The weights'
    gradients accumulate from run to run, as over a step's microbatches (adding to a gradient
    costs a read and a write of it: 25% of a weight-heavy stage's backward). Then the optimizer of
    the plan's memory model steps the weights ``repeats`` times (``runtime.optimizer_step``: the real
    ``torch.optim`` class, foreach as the memory model says, no bit of the weights changed). On CUDA the device
    is synchronised around each timing. The model is left as it was (gradients, buffers, random
    state). A loss the runtime computes after the last stage is not part of it. Inputs the plan's
    guards refuse are timed on the specialisation that serves them, as a call would choose it.
    ``threads``: torch's intra-op threads to time on (None: the caller's, ``torch.get_num_threads()``);
    give what each rank will run (torchrun starts ranks on one unless ``OMP_NUM_THREADS`` says
    otherwise): on the CPU a stage's time moves with it, several times over on a busy machine."""
    stage = checked_stage(sharded, stage, "measure_stage_time")
    example_inputs, example_kwargs = checked_call(sharded, example_inputs, example_kwargs, "measure_stage_time")
    repeats = whole_number(repeats, "repeats", at_least=1)
    threads = None if threads is None else whole_number(threads, "threads", at_least=1)
    return time_stages(sharded, [stage], example_inputs, example_kwargs, repeats, threads)[0]


def time_stages(sharded: ShardedModel, stages: Sequence[int], example_inputs: tuple, example_kwargs: dict,
                repeats: int, threads: int | None = None) -> list[StageTimeMeasurement]:
    """``measure_stage_time`` of each of ``stages`` (arguments checked by the caller), on the plan
    serving the inputs, chosen once for them all (choosing runs every stage), on ``threads`` (None:
    the caller's)."""
    with on_threads(threads), model_kept(sharded):
        plan = serving_plan(sharded, example_inputs, example_kwargs)
        return [_timed(plan, stage, example_inputs, example_kwargs, repeats) for stage in stages]


def _timed(plan: ShardedModel, stage: int, example_inputs: tuple, example_kwargs: dict,
           repeats: int) -> StageTimeMeasurement:
    module = plan.stages[stage]
    forward, backward, stepped, sent_bytes = [], [], [], 0
    args, kwargs = stage_inputs(plan, stage, example_inputs, example_kwargs)
    device = running_device(module, (args, kwargs))

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for _ in range(repeats + 1):
        call_args, call_kwargs = fresh_copy((args, kwargs), stage > 0)
        start = now()
        outputs = module(*call_args, **call_kwargs)
        middle = now()
        sent_bytes = sum(t.nbytes for t in tensors_in(outputs))
        sent = [t for t in tensors_in(outputs) if t.requires_grad]
        gradients = [torch.ones_like(t) for t in sent]
        begin = now()
        if sent:
            torch.autograd.backward(sent, gradients)
        forward.append(middle - start)
        backward.append(now() - begin)
    memory = plan.plan.memory_model
    trainable = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
    optimizer = stand_ins(trainable, memory.optimizer, memory.master_weights, memory.optimizer_foreach)
    optimizer.prepare()
    for _ in range(repeats + 1 if optimizer.stepping is not None else 0):
        start = now()
        optimizer.stepping.step()
        stepped.append(now() - start)
    totals = [f + b for f, b in zip(forward[1:], backward[1:])]
    quartiles = statistics.quantiles(totals, n=4, method="inclusive") if len(totals) > 1 else [totals[0]] * 3
    spread = (quartiles[2] - quartiles[0]) / quartiles[1] if quartiles[1] > 0 else 0.0
    return StageTimeMeasurement(stage, statistics.median(forward[1:]), statistics.median(backward[1:]), repeats,
                                str(device), sent_bytes, timed_plan(plan), spread, torch.get_num_threads(),
                                statistics.median(stepped[1:]) if stepped else 0.0)


def timed_plan(sharded: ShardedModel) -> str:
    """A digest of what a stage's time depends on besides its inputs: the split (``plan_fingerprint``)
    and, per stage, the shapes and dtypes of its weights and its device. Two models of one structure
    and other widths split alike but time otherwise."""
    stages = [([(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()],
               str(stage_device(module))) for module in sharded.stages]
    return hashlib.sha256(repr((plan_fingerprint(sharded), stages)).encode()).hexdigest()[:16]


__all__ = ["StageTimeMeasurement", "TIMING_REPEATS", "measure_stage_time", "time_stages", "timed_plan"]
