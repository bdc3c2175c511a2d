"""Throughput of one model under the GPipe schedule on 2 CPU processes, with three plans.

    python benchmarks/pipeline_throughput.py                       # a few minutes on 2 cores
    python benchmarks/pipeline_throughput.py --steps 2 --rounds 1  # quicker, noisier

Plans for the same 2-stage split of an LM with a large vocabulary: the embedding and the head hold
as many parameters, but the embedding does almost no work and the head a lot, so parameter
counts are a poor guide to where the time goes:
* autoshard, once per registered cost model among ``params``, ``flops`` and ``time`` (measured
  on this machine);
* equal layers: the anchors' equal-size policy, the same number of top-level layers per stage
  (embeddings and head count as layers);
* param greedy: the anchors' parameter-balanced greedy policy, a new stage before the layer that
  would take the running parameter count past the stage's share.
The plans are made once in this process and shipped to the workers as ``{node: stage}``.
Columns: parameters per stage, busy time per stage (forward and backward of its microbatches,
and the loss on the last stage, timed on its rank while the other rank waits), and samples per
second through the pipeline. The plans are timed in turn over several rounds and the medians
kept, so background load weighs on all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.graph import Partition
from autoshard.passes import Pipeline
from autoshard.passes.analyses import COST_MODELS
from autoshard.passes.base import ExampleInputs, PassContext
from autoshard.passes.emit import EmitPass
from autoshard.runtime import build_schedule, pipeline_stage, run_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_pipeline import TinyGPT, lm_loss  # noqa: E402

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 16384, 192, 4, 8, 64
BATCH, MICROBATCHES, STAGES = 16, 4, 2


def wide_vocab_lm() -> nn.Module:
    """A GPT-2-style LM with an untied head: as many parameters in the embedding (no work) as in
    the head (much work)."""
    return TinyGPT(vocab=VOCAB, width=WIDTH, heads=HEADS, layers=LAYERS, max_len=SEQ, tied=False)


LAYER_GROUPS = [("wte", "wpe"), *[(f"blocks.{i}",) for i in range(LAYERS)], ("ln_f", "lm_head")]


def layer_params(model: nn.Module) -> list[int]:
    return [sum(p.numel() for m in group for p in model.get_submodule(m).parameters())
            for group in LAYER_GROUPS]


def equal_layers(model: nn.Module) -> list[int]:
    """Stage of each layer group: the same count per stage (the first stages take the remainder)."""
    count = len(LAYER_GROUPS)
    sizes = [count // STAGES + (s < count % STAGES) for s in range(STAGES)]
    return [s for s, size in enumerate(sizes) for _ in range(size)]


def param_greedy(model: nn.Module) -> list[int]:
    """Stage of each layer group: move on before the layer that would take the running parameter
    count past the stage's share."""
    params = layer_params(model)
    share, running, stage, stages = sum(params) / STAGES, 0, 0, []
    for p in params:
        if running + p > share * (stage + 1) and stage < STAGES - 1 and stages:
            stage += 1
        stages.append(stage)
        running += p
    return stages


def planning_program(model: nn.Module, example: torch.Tensor):
    planning = Pipeline.parse("trace,shape-prop,build-dag")
    return run_pipeline(model, planning, ExampleInputs((example,), {})).program


def layer_assignment(model: nn.Module, example: torch.Tensor, layer_stage: list[int]) -> dict[str, int]:
    """Every node of layer group i on ``layer_stage[i]``; glue between layers goes with the layer
    before it (stages never decrease along the program)."""
    owner = {m: layer_stage[i] for i, group in enumerate(LAYER_GROUPS) for m in group}
    assignment, current = {}, 0
    for node, data in planning_program(model, example).dag.nodes(data=True):
        scopes = [path for path, _ in data.get("scopes", ())]
        current = max(current, next((owner[p] for p in scopes if p in owner), current))
        assignment[node] = current
    return assignment


def plan_assignments(example: torch.Tensor) -> dict[str, dict[str, int]]:
    """Each plan as ``{node: stage}``, made once here and shipped to the workers, as one would
    ship a plan: a measured (``time``) plan differs from process to process."""
    plans = {}
    for cost in [c for c in ("params", "flops", "time") if c in COST_MODELS]:
        torch.manual_seed(0)
        sharded = autoshard.shard_model(wide_vocab_lm(), STAGES, example_inputs=(example,), cost=cost)
        plans[f"autoshard cost={cost}"] = dict(sharded.plan.assignment)
    for name, policy in (("equal layers", equal_layers), ("param greedy", param_greedy)):
        model = wide_vocab_lm()
        plans[name] = layer_assignment(model, example, policy(model))
    return plans


def emit_plan(model: nn.Module, example: torch.Tensor, assignment: dict[str, int]):
    program = planning_program(model, example)
    partition = Partition.from_assignment(program.dag, assignment, STAGES)
    return EmitPass().run(dataclasses.replace(program, partition=partition), PassContext()).sharded


def busy_seconds(sharded, stage_index: int, ids: torch.Tensor, target: torch.Tensor,
                 repeats: int = 3) -> float:
    """Forward and backward of this stage (and the loss, on the last) over one step's
    microbatches, timed alone (median)."""
    values = (ids.chunk(MICROBATCHES)[0],)
    with torch.no_grad():
        for stage in sharded.stages[:stage_index]:
            values = stage(*values)
    stage = sharded.stages[stage_index]
    inputs = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = stage(*inputs)
        if stage_index == STAGES - 1:
            lm_loss(out, target.chunk(MICROBATCHES)[0]).backward()
        else:
            outs = [o for o in out if o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * MICROBATCHES


def timed_steps(schedule, rank: int, ids: torch.Tensor, target: torch.Tensor, steps: int) -> float:
    """Samples per second over ``steps`` GPipe steps, between barriers."""
    args, kwargs = ((ids,) if rank == 0 else ()), ({"target": target} if rank == STAGES - 1 else {})
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        schedule.step(*args, **kwargs)
    dist.barrier()
    return steps * BATCH / (time.perf_counter() - start)


def worker(rank: int, world: int, plans: dict[str, dict[str, int]], steps: int, rounds: int) -> dict:
    """Build every plan's stage, then time the plans in turn, ``rounds`` times: background load
    on a shared machine then weighs on every plan alike. Medians over the rounds."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ids, target = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))
    built = {}
    for plan, assignment in plans.items():
        torch.manual_seed(0)
        sharded = emit_plan(wide_vocab_lm(), ids[:2], assignment)
        stage = pipeline_stage(sharded, rank, STAGES, "cpu")
        schedule = build_schedule(stage, "gpipe", MICROBATCHES, loss_fn=lm_loss)
        timed_steps(schedule, rank, ids, target, 1)  # warm-up: metadata exchange, allocator
        built[plan] = (sharded, stage, schedule)
    samples: dict[str, list[float]] = {plan: [] for plan in plans}
    busy: dict[str, list[float]] = {plan: [] for plan in plans}
    for _ in range(rounds):
        for plan, (sharded, _, schedule) in built.items():
            samples[plan].append(timed_steps(schedule, rank, ids, target, steps))
            for turn in range(world):  # one rank at a time, so the ranks do not slow each other
                dist.barrier()
                if turn == rank:
                    busy[plan].append(busy_seconds(sharded, rank, ids, target))
    return {plan: {"params": sum(p.numel() for p in built[plan][1].submod.parameters()),
                   "busy": statistics.median(busy[plan]),
                   "samples_per_s": statistics.median(samples[plan])} for plan in plans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="GPipe steps per plan per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all plans (medians are reported)")
    args = parser.parse_args()
    plans = plan_assignments(torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1)))
    per_rank = run_local(worker, STAGES, args=(plans, args.steps, args.rounds), timeout=1800)
    print(f"GPT-style LM, untied head, vocab={VOCAB} width={WIDTH} layers={LAYERS} seq={SEQ}; "
          f"batch {BATCH} in {MICROBATCHES} microbatches; GPipe on {STAGES} gloo processes, 1 thread each")
    print("| plan | params per stage (M) | busy per stage (ms/step) | busiest / idlest | samples/s |")
    print("|---|---|---|---|---|")
    for plan in plans:
        rows = [r[plan] for r in per_rank]
        params = " / ".join(f"{r['params'] / 1e6:.2f}" for r in rows)
        busy = [r["busy"] * 1e3 for r in rows]
        print(f"| {plan} | {params} | {' / '.join(f'{b:.1f}' for b in busy)} | {max(busy) / min(busy):.2f} "
              f"| {min(r['samples_per_s'] for r in rows):.1f} |")


if __name__ == "__main__":
    main()
