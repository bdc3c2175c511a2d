"""Predicted against measured training step with every stage on one device (one process).

    python benchmarks/one_device_step.py --device cuda   # one GPU: ~2 minutes
    python benchmarks/one_device_step.py                 # the same on the CPU (slow for the large model)

Where one GPU is lent, two ranks on it make no pipeline (they take turns on the one device), so
the step-time model is checked the way one device runs a plan: one process holding every stage
under PyTorch's interleaved 1F1B schedule (``stages_per_rank = k``, NCCL on a GPU, gloo on the CPU),
where the model's simulation reduces to each stage's forward and backward per microbatch, run in
the schedule's order, with no link between stages of one rank. ``benchmarks/step_time.py`` checks
the two-process CPU pipeline, links and bubbles included.

Workloads: the sizes of ``step_time.py``'s three (a GPU runs them in well under a millisecond a
stage: the runtime's and PyTorch's per-op overhead is most of their time) and a GPT-style LM of
8 layers of width 1024 (8 sequences of 64 tokens a microbatch: the GPU's arithmetic is most of its
time); the language models' loss is computed after the last stage. Plans are made on the CPU on
one microbatch, split by parameters. Measured: the median of ``--repeats`` ``schedule.step`` calls after two warm-ups,
synchronised on CUDA. Predicted: ``predict_step`` from each stage timed whole on one microbatch
on the same device (``measure_stage_time``), ``calibrate=False`` (the calibration is gloo's between
CPU processes), the loss after the last stage not counted.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from datetime import date

import torch
import torch.nn.functional as F

import autoshard
from autoshard.costs.step_time import StepTimeModel
from autoshard.examples import GPTStyleLM
from autoshard.runtime import build_schedule, measure_stage_time, pipeline_stage, predict_step, run_local
from step_time import SEQ, VOCAB, WORKLOADS, Workload, hf_gpt2

WARMUP = 2


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _ids(rows: int, gen: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    return (ids,), {}, ids


#: The loss after the last stage, so only floats cross the boundaries: the GPU image's torch 2.11
#: ``PipelineStage`` refuses an integer tensor received (it asks it to require grad), 2.13 does not.
ALL = {
    "gpt-lm 8x1024": Workload(lambda: GPTStyleLM(vocab=VOCAB, width=1024, layers=8, heads=16, max_seq=SEQ),
                              _ids, _lm_loss, 8),  # first: it is what a GPU is for
    "residual-mlp 8x512": WORKLOADS["residual-mlp 8x512"],
    "gpt-lm 4x128": Workload(lambda: GPTStyleLM(vocab=VOCAB, width=128, layers=4, heads=4, max_seq=SEQ),
                             _ids, _lm_loss, 4),
    "hf-gpt2 4x128": Workload(hf_gpt2, _ids, _lm_loss, 4),
}
CASES = [(2, 4), (2, 8), (4, 4), (4, 8)]
"""(stages, microbatches)."""


def _inputs(name: str, rows: int, seed: int, device: str) -> tuple[tuple, dict, torch.Tensor]:
    args, kwargs, target = ALL[name].microbatch(rows, torch.Generator().manual_seed(seed))
    return tuple(a.to(device) for a in args), {n: v.to(device) for n, v in kwargs.items()}, target.to(device)


def _synchronised(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def one_case(name: str, k: int, m: int, device: str, repeats: int) -> tuple[float, float]:
    """The measured (median) and predicted seconds of one step."""
    workload = ALL[name]
    torch.manual_seed(0)
    one_args, one_kwargs, _ = workload.microbatch(workload.rows, torch.Generator().manual_seed(7))
    sharded = autoshard.shard_model(workload.build(), k, example_inputs=one_args, example_kwargs=one_kwargs)
    timed_copy = copy.deepcopy(sharded).to(device)  # pipeline_stage moves the plan's own stages
    there_args, there_kwargs, _ = _inputs(name, workload.rows, 7, device)
    times = [measure_stage_time(timed_copy, j, there_args, there_kwargs) for j in range(k)]
    predicted = predict_step(timed_copy, step=StepTimeModel("interleaved-1f1b", m, stages_per_rank=k),
                             calibrate=False, times=times)
    stages = [pipeline_stage(sharded, j, k, device) for j in range(k)]
    runner = build_schedule(stages, "interleaved-1f1b", m, loss_fn=workload.loss_fn)
    args, kwargs, target = _inputs(name, m * workload.rows, 11, device)
    seconds = []
    for i in range(WARMUP + repeats):
        start = _synchronised(device)
        runner.step(*args, **kwargs, target=target, return_outputs=False)
        if i >= WARMUP:
            seconds.append(_synchronised(device) - start)
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
    return statistics.median(seconds), predicted.seconds


def worker(rank: int, world: int, device: str, repeats: int, names: list[str]) -> None:
    """Each case's row, printed as it is measured (a run stopped at a time limit keeps its rows)."""
    for name in names:
        for k, m in CASES:
            measured, predicted = one_case(name, k, m, device, repeats)
            print(f"| {name} | {k} | {m} | {measured * 1e3:.2f} | {predicted * 1e3:.2f} | "
                  f"{(predicted - measured) / measured:+.0%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per case (after warm-up); median kept")
    parser.add_argument("--models", default=",".join(ALL), help="comma-separated subset of " + ", ".join(ALL))
    options = parser.parse_args()
    names = options.models.split(",")
    gpu = torch.cuda.get_device_name(options.device) if options.device.startswith("cuda") else "no GPU"
    print(f"{date.today()}, {platform.processor() or platform.machine()}, {gpu}, torch {torch.__version__}")
    backend = "nccl" if options.device.startswith("cuda") else "gloo"
    started = time.perf_counter()
    print("| model | k | m | measured (ms) | predicted (ms) | err |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    run_local(worker, 1, args=(options.device, options.repeats, names), timeout=540, backend=backend)
    print(f"(interleaved 1F1B, every stage on {options.device}, {backend}; {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
