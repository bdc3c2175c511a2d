"""Throughput of one model under the GPipe schedule on 2 CPU processes, with several plans.

    python benchmarks/pipeline_throughput.py                       # ~3 minutes on 2 cores
    python benchmarks/pipeline_throughput.py --steps 2 --rounds 1  # quicker, noisier

The model is a GPT-2-style LM with a large vocabulary and an untied head: the embedding and the
head hold as many parameters, but the embedding does almost no work and the head (with the
cross-entropy over its logits) a lot, so parameter counts are a poor guide to where time goes.
The model computes its own loss (``GPTStyleLMWithLoss``), so the loss is part of every plan and
of the last stage; ``loss_fn`` only hands it on. Plans of 2 stages:
* autoshard, with ``cost=params``, ``flops`` and ``time`` (each node's forward and backward
  measured here on one microbatch, one thread, as each worker runs);
* autoshard ``cost=time`` planned on the same LM returning logits, its loss computed after the
  last stage by ``loss_fn``: the work no cost model of the model can see;
* equal layers: the anchors' equal-size policy, the same number of top-level layers per stage
  (the embeddings and the head with the loss count as layers);
* param greedy: the anchors' parameter-balanced greedy policy, a new stage before the layer that
  would take the running parameter count past the stage's share.
The plans are made once in this process and shipped to the workers as ``{node: stage}``.
Columns: the layer stage 1 starts in, parameters per stage, busy time per stage (forward and backward
of its microbatches, loss included, timed on its rank while the other rank waits: the least of 5
runs, as background load only ever adds time), samples per second through the pipeline, and the
samples per second GPipe would reach with a free core per process, ``BATCH / ((M + S - 1) / M *
busiest stage)``. The plans are timed in turn over several rounds and medians kept, so background
load weighs on all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.examples import GPTStyleLM, GPTStyleLMWithLoss
from autoshard.graph import Partition
from autoshard.passes import Pipeline
from autoshard.passes.base import ExampleInputs, PassContext
from autoshard.passes.emit import EmitPass
from autoshard.runtime import build_schedule, model_loss, pipeline_stage, run_local

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 16384, 192, 4, 8, 64
BATCH, MICROBATCHES, STAGES = 16, 4, 2
MICROBATCH = BATCH // MICROBATCHES  # plans are made on one microbatch: the size each stage runs
TIME_PLAN = (f"capture,shape-prop,profile{{backward=true repeats=9}},build-dag,linearize,"
             f"split{{stages={STAGES} cost=time}},emit,verify")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class Variant:
    """Where the loss is computed: inside the model (a plan sees it) or after its last stage."""

    model: Callable[..., nn.Module]
    inputs: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]  # (ids, targets) -> args
    loss_fn: Callable[..., torch.Tensor]


VARIANTS = {
    "inside": Variant(GPTStyleLMWithLoss, lambda ids, targets: (ids, targets), model_loss),
    "after": Variant(GPTStyleLM, lambda ids, targets: (ids,), lm_loss),
}


def wide_vocab_lm(variant: str) -> nn.Module:
    torch.manual_seed(0)
    size = dict(vocab=VOCAB, width=WIDTH, heads=HEADS, layers=LAYERS, max_seq=SEQ, tied=False)
    return VARIANTS[variant].model(**size)


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


def planning_program(model: nn.Module, args: tuple[torch.Tensor, ...]):
    planning = Pipeline.parse("trace,shape-prop,build-dag")
    return run_pipeline(model, planning, ExampleInputs(args, {})).program


def layer_assignment(model: nn.Module, args: tuple[torch.Tensor, ...],
                     layer_stage: list[int]) -> dict[str, int]:
    """Every node of layer group i on ``layer_stage[i]``; glue between layers, and the loss after
    the head, goes with the layer before it (stages never decrease along the program)."""
    owner = {m: layer_stage[i] for i, group in enumerate(LAYER_GROUPS) for m in group}
    assignment, current = {}, 0
    for node, data in planning_program(model, args).dag.nodes(data=True):
        scopes = [path for path, _ in data.get("scopes", ())]
        current = max(current, next((owner[p] for p in scopes if p in owner), current))
        assignment[node] = current
    return assignment


@dataclass(frozen=True)
class Plan:
    variant: str
    assignment: dict[str, int]
    cut: str  # the first layer with work on the last stage, "(split)" if it also has some before


def where_cut(model: nn.Module, args: tuple[torch.Tensor, ...], assignment: dict[str, int]) -> str:
    dag = planning_program(model, args).dag

    def inside(data: dict, group: tuple[str, ...]) -> bool:
        return any(path == m or path.startswith(m + ".") for path, _ in data.get("scopes", ()) for m in group)

    for group in LAYER_GROUPS:
        stages = {assignment[node] for node, data in dag.nodes(data=True) if inside(data, group)}
        if STAGES - 1 in stages:
            return "/".join(group) + (" (split)" if len(stages) > 1 else "")
    return "the loss"


def plan_assignments(ids: torch.Tensor, targets: torch.Tensor) -> dict[str, Plan]:
    """Every plan, made once here and shipped to the workers, as one would ship a plan: a
    measured (``time``) plan differs from process to process."""
    torch.set_num_threads(1)  # profile as the workers run
    made: dict[str, tuple[str, dict[str, int]]] = {}
    args = VARIANTS["inside"].inputs(ids, targets)
    for cost in ("params", "flops", "time"):
        pipeline = TIME_PLAN if cost == "time" else None
        sharded = autoshard.shard_model(wide_vocab_lm("inside"), STAGES, example_inputs=args, cost=cost,
                                        pipeline=pipeline)
        made[f"autoshard cost={cost}"] = ("inside", dict(sharded.plan.assignment))
    after = autoshard.shard_model(wide_vocab_lm("after"), STAGES, example_inputs=(ids,), pipeline=TIME_PLAN)
    made["autoshard cost=time, loss after the model"] = ("after", dict(after.plan.assignment))
    for name, policy in (("equal layers", equal_layers), ("param greedy", param_greedy)):
        model = wide_vocab_lm("inside")
        made[name] = ("inside", layer_assignment(model, args, policy(model)))

    def plan(variant: str, assignment: dict[str, int]) -> Plan:
        example = VARIANTS[variant].inputs(ids, targets)
        return Plan(variant, assignment, where_cut(wide_vocab_lm(variant), example, assignment))

    return {name: plan(variant, assignment) for name, (variant, assignment) in made.items()}


def emit_plan(model: nn.Module, args: tuple[torch.Tensor, ...], assignment: dict[str, int]):
    program = planning_program(model, args)
    partition = Partition.from_assignment(program.dag, assignment, STAGES)
    return EmitPass().run(dataclasses.replace(program, partition=partition), PassContext()).sharded


def stage_loss(variant: str, out, targets: torch.Tensor) -> torch.Tensor:
    return VARIANTS[variant].loss_fn(out, targets)


def busy_seconds(variant: str, sharded, stage_index: int, ids: torch.Tensor, targets: torch.Tensor,
                 repeats: int = 5) -> float:
    """Forward and backward of this stage (and the loss, on the last) over one step's
    microbatches, timed alone (the least of ``repeats`` runs)."""
    micro_ids, micro_targets = ids.chunk(MICROBATCHES)[0], targets.chunk(MICROBATCHES)[0]
    values = VARIANTS[variant].inputs(micro_ids, micro_targets)
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
            stage_loss(variant, out, micro_targets).backward()
        else:
            outs = [o for o in out if o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        times.append(time.perf_counter() - start)
    return min(times) * MICROBATCHES


def timed_steps(variant: str, schedule, rank: int, ids: torch.Tensor, targets: torch.Tensor,
                steps: int) -> float:
    """Samples per second over ``steps`` GPipe steps, between barriers."""
    args = VARIANTS[variant].inputs(ids, targets) if rank == 0 else ()
    target = targets if rank == STAGES - 1 else None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        schedule.step(*args, target=target, return_outputs=False)
    dist.barrier()
    return steps * BATCH / (time.perf_counter() - start)


def worker(rank: int, world: int, plans: dict[str, Plan], steps: int, rounds: int) -> dict:
    """Build every plan's stage, then time the plans in turn, ``rounds`` times: background load
    on a shared machine then weighs on every plan alike. Medians over the rounds."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))
    built = {}
    for plan, made in plans.items():
        variant = made.variant
        example = VARIANTS[variant].inputs(ids[:MICROBATCH], targets[:MICROBATCH])
        sharded = emit_plan(wide_vocab_lm(variant), example, made.assignment)
        stage = pipeline_stage(sharded, rank, STAGES, "cpu")
        schedule = build_schedule(stage, "gpipe", MICROBATCHES, loss_fn=VARIANTS[variant].loss_fn)
        timed_steps(variant, schedule, rank, ids, targets, 1)  # warm-up: metadata exchange, allocator
        built[plan] = (variant, sharded, stage, schedule)
    samples: dict[str, list[float]] = {plan: [] for plan in plans}
    busy: dict[str, list[float]] = {plan: [] for plan in plans}
    for _ in range(rounds):
        for plan, (variant, sharded, _, schedule) in built.items():
            samples[plan].append(timed_steps(variant, schedule, rank, ids, targets, steps))
            for turn in range(world):  # one rank at a time, so the ranks do not slow each other
                dist.barrier()
                if turn == rank:
                    busy[plan].append(busy_seconds(variant, sharded, rank, ids, targets))
    return {plan: {"params": sum(p.numel() for p in built[plan][2].submod.parameters()),
                   "busy": statistics.median(busy[plan]),
                   "samples_per_s": statistics.median(samples[plan])} for plan in plans}


def ideal_samples_per_s(busiest: float) -> float:
    """GPipe's rate when each stage has a core of its own: the busiest stage works through the
    microbatches, and the pipeline fills and drains once per step (S - 1 extra microbatch times)."""
    return BATCH / (busiest * (MICROBATCHES + STAGES - 1) / MICROBATCHES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="GPipe steps per plan per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all plans (medians are reported)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(1)
    plans = plan_assignments(*(torch.randint(0, VOCAB, (MICROBATCH, SEQ), generator=gen) for _ in range(2)))
    per_rank = run_local(worker, STAGES, args=(plans, args.steps, args.rounds), timeout=3600)
    print(f"GPT-style LM computing its loss, untied head, vocab={VOCAB} width={WIDTH} layers={LAYERS} "
          f"seq={SEQ}; batch {BATCH} in {MICROBATCHES} microbatches; GPipe on {STAGES} gloo processes, "
          "1 thread each")
    print("| plan | stage 1 starts in | params per stage (M) | busy per stage (ms/step) | busiest / idlest "
          "| samples/s | with a free core each |")
    print("|---|---|---|---|---|---|---|")
    for plan in plans:
        rows = [r[plan] for r in per_rank]
        params = " / ".join(f"{r['params'] / 1e6:.2f}" for r in rows)
        busy = [r["busy"] * 1e3 for r in rows]
        print(f"| {plan} | {plans[plan].cut} | {params} | {' / '.join(f'{b:.1f}' for b in busy)} "
              f"| {max(busy) / min(busy):.2f} | {min(r['samples_per_s'] for r in rows):.1f} "
              f"| {ideal_samples_per_s(max(busy) / 1e3):.1f} |")


if __name__ == "__main__":
    main()
