"""Predicted against measured time of one pipeline training step, on 2 CPU processes (gloo).

    python benchmarks/step_time.py               # about 5 minutes on a quiet 2-core machine
    python benchmarks/step_time.py --repeats 3   # quicker, noisier
    python benchmarks/step_time.py --stages-only # the one-process checks alone, ~2 minutes

Three models (the residual MLP and the GPT-style LM computing its loss from the project's
examples, and a small Hugging Face GPT-2 given labels) are split into 2 stages (GPipe, 1F1B) and
4 (interleaved 1F1B, 2 stages per process). Plans are made on one microbatch, as each stage runs
it. Each worker runs one torch thread, so the plans are made, profiled and the machine calibrated
on one thread too. Each case runs a few warm-up steps, then ``--repeats`` timed ones: a step
is ``schedule.step`` (forward and backward of every microbatch), timed from a barrier to the
last rank's end; the median counts. Each rank then steps Adam over its stages' weights: the
training step, timed from the same barrier to the last rank's end of its optimizer step, is in the
last columns, against ``predict_step`` from the stages timed between the steps with their optimizer
step (``measure_stage_time`` times the plan's optimizer too); the other columns leave it out.
Beside the step: the machine's busy share and load average during the case (other processes'
work shows there), and each rank's CPU time in a step against the busy time the profile predicts
for its stages.

The first two predictions are ``autoshard.runtime.predict_step``: each stage timed whole on one
microbatch, with the link and the runtime's time per message calibrated by
``calibrate_runtime(refresh=True)`` just after the steps ran. The stages are timed by rank 0
between each case's steps (one run of each stage before every step, while rank 1 waits; per
stage the median over the steps), and again in this process after every case ran (once per
model and stage count): this VM's speed drifts by up to a half from minute to minute, so only
the first compares the model with the machine the steps met. The others are
``plan_report(...).step_time`` from three sources of stage time: each node's forward measured
(``profile``, backward = 2 x forward; one profile per model, which its 2- and 4-stage plans
share), each node's forward and backward measured (``profile{backward=true}``), and the roofline
estimate under this machine's calibration; each with the link (gloo between the two processes)
measured here by a ping-pong, and with the default link. Last, the step model's own error: the
step simulated from each stage's forward and backward as the timed steps ran them (each
``PipelineStage``'s ``forward_one_chunk`` and ``backward_one_chunk`` timed, mean per microbatch),
and how much longer those ops ran than the same stages timed between the steps (the runtime
calibration's compute scale left out: they ran inside). Then, in this
process: stage 0's forward and backward measured alone against its estimate, and two identical
planning commands, each in a fresh process, reporting their stage time estimates, once reading
the calibration cache and once measuring the machine again (``AUTOSHARD_RECALIBRATE=1``, in a
scratch cache).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from datetime import date
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn

import autoshard
from autoshard.costs.estimate import calibrated_device
from autoshard.runtime.machine_load import machine_cpu_seconds
from autoshard.costs.step_time import StepTimeModel, step_time
from autoshard.examples import GPTStyleLMWithLoss, ResidualMLP
from autoshard.runtime import (
    StageTimeMeasurement, build_schedule, calibrate_runtime, local_stage_indices, measure_stage_time, model_loss,
    pipeline_stage, predict_step, run_local)
from autoshard.runtime.calibrate import measure_link, timed_ops
from autoshard.passes import (
    BuildDagPass, CapturePass, EmitPass, LinearizePass, Pipeline, ProfilePass, ShapePropPass, SplitPass, VerifyPass)

SEQ, VOCAB = 64, 2048
CASES = [("gpipe", 2, 4), ("gpipe", 2, 8), ("1f1b", 2, 2), ("1f1b", 2, 4), ("1f1b", 2, 8),
         ("interleaved-1f1b", 4, 4), ("interleaved-1f1b", 4, 8)]
"""(schedule, stages, microbatches)."""
WARMUP = 2


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    microbatch: Callable[[int, torch.Generator], tuple[tuple, dict, torch.Tensor]]  # rows -> args, kwargs, target
    loss_fn: Callable[..., torch.Tensor]
    rows: int


def _vectors(rows: int, gen: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    return (torch.randn(rows, 512, generator=gen),), {}, torch.randn(rows, 512, generator=gen)


def _ids_targets(rows: int, gen: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    return (ids, ids), {}, ids


def _ids_labels(rows: int, gen: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    return (ids,), {"labels": ids}, ids


def hf_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


WORKLOADS = {
    "residual-mlp 8x512": Workload(lambda: ResidualMLP(8, 512), _vectors, F.mse_loss, 64),
    "gpt-lm 4x128": Workload(lambda: GPTStyleLMWithLoss(vocab=VOCAB, width=128, layers=4, heads=4, max_seq=SEQ,
                                                        tied=False), _ids_targets, model_loss, 4),
    "hf-gpt2 4x128": Workload(hf_gpt2, _ids_labels, model_loss, 4),
}


def build(name: str, rows: int, seed: int = 7) -> tuple[nn.Module, tuple, dict, torch.Tensor]:
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    model = workload.build()
    args, kwargs, target = workload.microbatch(rows, torch.Generator().manual_seed(seed))
    return model, args, kwargs, target


def shard(name: str, k: int, time_profile: str | None = None, backward: bool = False) -> autoshard.ShardedModel:
    """The plan every process makes alike: split by parameters on one microbatch. ``time_profile``
    times each node's forward (``backward``: its forward and backward) into that file."""
    model, args, kwargs, _ = build(name, WORKLOADS[name].rows)
    if not backward:
        return autoshard.shard_model(model, k, example_inputs=args, example_kwargs=kwargs, time_profile=time_profile)
    pipeline = Pipeline([CapturePass(), ShapePropPass(), ProfilePass(path=time_profile, backward=True), BuildDagPass(),
                         LinearizePass(), SplitPass(stages=k), EmitPass(), VerifyPass()])
    return autoshard.shard_model(model, k, example_inputs=args, example_kwargs=kwargs, pipeline=pipeline)


def timed_steps(rank: int, world: int, sharded: autoshard.ShardedModel, name: str, schedule: str, m: int,
                repeats: int) -> tuple[list[tuple[float, float]], list[StageTimeMeasurement], dict]:
    """This rank's (wall, CPU) seconds for each timed step of ``name`` under ``schedule``; (rank 0)
    the plan's stages timed whole on one microbatch, one run each before every step while rank 1
    waits: per stage, the median forward and backward over the steps, so the stages meet the
    machine the steps meet; and this rank's ops as the timed steps ran them (``timed_ops``)."""
    k = sharded.num_stages
    stages = [pipeline_stage(sharded, index, k, "cpu") for index in local_stage_indices(k, rank, world)]
    ops = timed_ops(stages)
    runner = build_schedule(stages, schedule, m, loss_fn=WORKLOADS[name].loss_fn)
    _, args, kwargs, target = build(name, m * WORKLOADS[name].rows, seed=11)
    _, one_args, one_kwargs, _ = build(name, WORKLOADS[name].rows)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    optimizer = torch.optim.Adam([p for stage in stages for p in stage.submod.parameters() if p.requires_grad],
                                 lr=1e-4)
    seconds, timed = [], []
    for i in range(WARMUP + repeats):
        if rank == 0 and i >= WARMUP:
            timed.append([measure_stage_time(sharded, j, one_args, one_kwargs, repeats=1) for j in range(k)])
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        runner.step(*(args if first else ()), **(kwargs if first else {}), target=target if last else None,
                    return_outputs=False)
        scheduled, scheduled_cpu = time.perf_counter() - start, time.process_time() - cpu
        optimizer.step()
        if i >= WARMUP:
            seconds.append((scheduled, scheduled_cpu, time.perf_counter() - start))
        else:
            for calls in ops.values():
                calls.clear()
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
    medians = [dataclasses.replace(runs[0], forward=statistics.median(r.forward for r in runs),
                                   backward=statistics.median(r.backward for r in runs),
                                   optimizer_step=statistics.median(r.optimizer_step for r in runs), repeats=len(runs))
               for runs in zip(*timed)]
    return seconds, medians, ops


def worker(rank: int, world: int, repeats: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    found: dict[Any, Any] = {"link": measure_link(rank)}
    for name in WORKLOADS:
        for k in sorted({k for _, k, _ in CASES}):
            sharded = shard(name, k)
            for schedule, _, m in (case for case in CASES if case[1] == k):
                dist.barrier()
                machine, load = machine_cpu_seconds(), os.getloadavg()[0]
                steps, times, ops = timed_steps(rank, world, sharded, name, schedule, m, repeats)
                found[(name, schedule, k, m)], found[(name, schedule, k, m, "times")] = steps, times
                found[(name, schedule, k, m, "ops")] = ops
                busy, total = (after - before for after, before in zip(machine_cpu_seconds(), machine))
                found[(name, schedule, k, m, "machine")] = (busy / total, load)
    return found


def predictions(name: str, link: tuple[float, float], profile_dir: str, found: dict[Any, Any]
                ) -> dict[tuple, dict[str, float]]:
    """Per case, the predicted step under each source of stage time and link (``found``: rank 0's results)."""
    device = calibrated_device()
    _, args, kwargs, _ = build(name, WORKLOADS[name].rows)
    out: dict[tuple, dict[str, float]] = {}
    for k in sorted({k for _, k, _ in CASES}):
        estimated = shard(name, k)
        timed = [measure_stage_time(estimated, j, args, kwargs) for j in range(k)]  # one timing for every case
        profiled = shard(name, k, time_profile=os.path.join(profile_dir, f"{name.split()[0]}.json"))
        both = shard(name, k, time_profile=os.path.join(profile_dir, f"{name.split()[0]}-backward.json"), backward=True)
        assert profiled.plan.assignment == estimated.plan.assignment == both.plan.assignment, "plans must split alike"
        for schedule, stages, m in CASES:
            if stages != k:
                continue
            measured_link = StepTimeModel(schedule, m, link_bandwidth=link[0], link_latency=link[1])
            default_link = StepTimeModel(schedule, m)
            with_profile = autoshard.plan_report(profiled, step=measured_link).step_time
            between = found[(name, schedule, k, m, "times")]
            out[(name, schedule, k, m)] = {  # the schedule's step alone, but in the last column
                "stages whole": predict_step(estimated, step=StepTimeModel(schedule, m),
                                             times=_without_optimizer(timed)).seconds,
                "stages between steps": predict_step(estimated, step=StepTimeModel(schedule, m),
                                                     times=_without_optimizer(between)).seconds,
                "with the optimizer step": predict_step(estimated, step=StepTimeModel(schedule, m),
                                                        times=between).seconds,
                "profile": with_profile.seconds,
                "profile with backward": autoshard.plan_report(both, step=measured_link).step_time.seconds,
                "estimate": autoshard.plan_report(estimated, device=device, step=measured_link).step_time.seconds,
                "default link": autoshard.plan_report(profiled, step=default_link).step_time.seconds,
                "busy": [sum(with_profile.busy[s] for s in range(rank, k, 2)) for rank in range(2)],
            }
    return out


def _without_optimizer(times: list[StageTimeMeasurement]) -> list[StageTimeMeasurement]:
    return [dataclasses.replace(t, optimizer_step=0.0) for t in times]


REPORT_COMMAND = """
import torch, autoshard
from autoshard.examples import GPTStyleLMWithLoss
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPTStyleLMWithLoss(vocab=2048, width=128, layers=4, heads=4, max_seq=64, tied=False)
ids = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(7))
print(*(s.seconds for s in autoshard.plan_report(autoshard.shard_model(model, 2, example_inputs=(ids, ids))).stages))
"""


def planning_twice(recalibrate: bool) -> tuple[list[float], list[float]]:
    """Stage time estimates of two identical planning commands, each a fresh process."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as scratch:
        if recalibrate:
            env.update(AUTOSHARD_RECALIBRATE="1", XDG_CACHE_HOME=scratch)
        runs = [subprocess.run([sys.executable, "-c", REPORT_COMMAND], env=env, capture_output=True, text=True,
                               check=True, timeout=300).stdout.split() for _ in range(2)]
    first, second = ([float(x) for x in run] for run in runs)
    return first, second


def stage_zero_alone(name: str) -> str:
    """Stage 0 of the 2-stage plan on one microbatch in this process: its estimated forward, and its
    measured forward and backward (this thread's CPU time, the least of 15 runs, so load from
    elsewhere adds little)."""
    sharded = shard(name, 2)
    estimate = autoshard.plan_report(sharded, device=calibrated_device()).stages[0].seconds
    _, args, kwargs, _ = build(name, WORKLOADS[name].rows)
    stage = sharded.stages[0]
    forward, backward = [], []
    for _ in range(15):
        start = time.thread_time()
        out = stage(*args, **kwargs)
        forward.append(time.thread_time() - start)
        sent = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        start = time.thread_time()
        torch.autograd.backward(sent, [torch.ones_like(t) for t in sent])
        backward.append(time.thread_time() - start)
        stage.zero_grad(set_to_none=True)
    f, b = min(forward), min(backward)
    return (f"{name}: stage 0 forward estimated {estimate * 1e3:.2f} ms, measured {f * 1e3:.2f} ms "
            f"({f / estimate:.1f}x); backward {b * 1e3:.2f} ms ({b / f:.2f}x the forward)")


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per case (after warm-up); median kept")
    parser.add_argument("--stages-only", action="store_true", help="only the one-process stage and calibration checks")
    options = parser.parse_args()
    torch.set_num_threads(1)  # plan, profile and calibrate as the workers run: one thread each
    print(f"{date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}; load average {os.getloadavg()[0]:.2f}; calibration (1 thread): "
          f"{calibrated_device().describe()}")
    if not options.stages_only:
        pipeline_steps(options.repeats)
    for name in WORKLOADS:
        print(stage_zero_alone(name))
    for recalibrate in (False, True):
        first, second = planning_twice(recalibrate)
        spread = max(abs(a - b) / min(a, b) for a, b in zip(first, second))
        how = "each measuring the machine again" if recalibrate else "reading the calibration cache"
        print(f"two identical planning commands, {how}: stage estimates {[f'{s * 1e3:.3f}' for s in first]} ms and "
              f"{[f'{s * 1e3:.3f}' for s in second]} ms, differing by {spread:.1%} at most")


def ops_in_the_step(case: tuple, results: list[dict], runtime: Any) -> tuple[float, str]:
    """The step simulated from each stage's ops as the timed steps ran them (mean seconds per
    microbatch, both ranks) under the runtime calibration: the step model's own error, whatever
    the stage times fed to it. Beside it, those ops' time over the stages timed between the steps
    (forward / backward, all stages together)."""
    ops = {key: seconds for rank in results for key, seconds in rank[(*case, "ops")].items()}
    timed = results[0][(*case, "times")]
    k = len(timed)
    forward = [statistics.mean(ops[(j, "forward")]) for j in range(k)]
    backward = [statistics.mean(ops[(j, "backward")]) for j in range(k)]
    inside = dataclasses.replace(runtime.applied_to(StepTimeModel(case[1], case[3])), compute_scale=1.0)  # as ran
    simulated = step_time(forward, backward, [t.sent_bytes for t in timed[:-1]], inside).seconds
    slower = (f"{sum(forward) / sum(t.forward for t in timed):.2f} / "
              f"{sum(backward) / sum(t.backward for t in timed):.2f}")
    return simulated, slower


def pipeline_steps(repeats: int) -> None:
    """Every case on two processes, predicted against measured."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = run_local(worker, 2, args=(repeats,), timeout=3600)
    link = results[0]["link"]
    runtime = calibrate_runtime(refresh=True)
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"gloo link between the two processes: {link[0] / 1e9:.2f} GB/s, {link[1] * 1e6:.0f} µs a message; "
          f"runtime calibration: {runtime.describe()}")
    print("| model | schedule | k | m | machine busy, load | measured (ms) | stages timed between the steps | err | "
          "stages timed after | err | profile | err | profile with backward | err | estimate | err | profile, default "
          "link | err | CPU per rank, measured (ms) | profile busy | err | ops as the step ran them | err | "
          "those ops over the stages timed between steps, f / b | measured with the optimizer step (ms) | "
          "stages between steps with theirs | err |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
          "---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as profiles:
        for name in WORKLOADS:
            predicted = predictions(name, link, profiles, results[0])
            for case, guess in predicted.items():
                steps = [max(r[case][i][0] for r in results) for i in range(repeats)]
                cpu = [statistics.median(step[1] for step in r[case]) for r in results]
                measured = statistics.median(steps)
                busy, load = results[0][(*case, "machine")]
                row = [f"{busy:.0%}, {load:.1f}", f"{measured * 1e3:.1f}"]
                for source in ("stages between steps", "stages whole", "profile", "profile with backward", "estimate",
                               "default link"):
                    row += [f"{guess[source] * 1e3:.1f}", error(guess[source], measured)]
                row += ["/".join(f"{c * 1e3:.0f}" for c in cpu), "/".join(f"{b * 1e3:.0f}" for b in guess["busy"]),
                        "/".join(error(b, c) for b, c in zip(guess["busy"], cpu))]
                inside, slower = ops_in_the_step(case, results, runtime)
                row += [f"{inside * 1e3:.1f}", error(inside, measured), slower]
                trained = statistics.median(max(r[case][i][2] for r in results) for i in range(repeats))
                row += [f"{trained * 1e3:.1f}", f"{guess['with the optimizer step'] * 1e3:.1f}",
                        error(guess["with the optimizer step"], trained)]
                print(f"| {case[0]} | {case[1]} | {case[2]} | {case[3]} | " + " | ".join(row) + " |")
    print(f"(runs took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
