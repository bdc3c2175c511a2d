"""Per-rank memory of pipelining alone against pipelining x data parallelism (``parallelize``),
measured and as the memory model predicts it.

    python benchmarks/parallel_memory.py            # 2 and 4 gloo processes on this machine's CPUs
    python benchmarks/parallel_memory.py --quick    # a smaller model
    python benchmarks/parallel_memory.py --layouts fsdp,fsdp-bf16
    python benchmarks/parallel_memory.py --layouts pp --models residual-mlp,hf-gpt2 --k 2,3 \
        --microbatches 1,4 --optimizer adam,sgd-momentum --schedule 1f1b,gpipe   # a sweep

By default a GPT-style LM split into k = 2 stages trains under 1F1B with 4 microbatches (Adam), on 2
processes (pipelining alone, a 2 x 1 mesh) and on 4 (2 pipeline x 2 data-parallel ranks: FSDP,
replication, bf16 mixed precision, activation checkpointing). ``--models``, ``--k``,
``--microbatches``, ``--optimizer`` and ``--schedule`` take comma-separated lists and run every
combination, one table each. Each plan is made with one microbatch of one data-parallel rank as its
example and with ``MemoryModel(microbatches=..., optimizer=..., schedule=...)`` as the run has them,
so the prediction describes that run.

On every rank, after a first step (optimizer state made, pipeline buffers allocated):

* weight state: the storages of its parameters, gradients and Adam state after the step (each
  storage once, FSDP's padding included) against the stage's unsharded state / dp (FSDP target:
  within 10%);
* peak: the second step (schedule, tied-gradient sync, optimizer step, ``zero_grad``) under
  PyTorch's ``MemTracker``, which counts every live tensor storage: what the rank's stages,
  optimizer and pipeline held before the step, and every storage made during it (FSDP's gathered
  weights and reduce buffers included). The plan's own copy of the model, which the worker was
  handed, is left out where this rank's stages do not run on it, and so is the part of the batch
  it was handed but does not step with. Predicted:
  ``plan_report(sharded, memory=parallel.memory_model)``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import warnings
from typing import Collection

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

import autoshard
from autoshard.costs.memory_model import OPTIMIZER_STATE_TENSORS
from autoshard.costs.saved import without_cyclic_gc
from autoshard.examples import GPTStyleLMWithLoss, ResidualMLP
from autoshard.runtime import model_loss, parallelize, run_local

BATCH = 8
MB = 2 ** 20
#: the memory model's name for an optimizer -> (its name in words, the optimizer the run steps with)
OPTIMIZERS = {
    "adam": ("Adam", lambda params: torch.optim.Adam(params, lr=1e-3)),
    "sgd-momentum": ("SGD with momentum", lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)),
}
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe"}
MODELS = ("gpt-lm", "residual-mlp", "hf-gpt2")
#: name -> (dp, data_parallel, mixed_precision, activation_checkpointing)
LAYOUTS = {
    "pp": (1, None, None, False),
    "pp-ac": (1, None, None, True),
    "fsdp": (2, "fsdp", None, False),
    "fsdp-ac": (2, "fsdp", None, True),
    "fsdp-bf16": (2, "fsdp", torch.bfloat16, False),
    "ddp": (2, "ddp", None, False),
}


class StepTracker(MemTracker):
    """``MemTracker`` counting storages only: its per-module statistics refuse a module called once
    per microbatch (``NotImplementedError``: "multiple iterative calls"), which a pipeline does."""

    def _pre_fw_hook(self, *args: object) -> None:
        pass

    def _post_fw_hook(self, *args: object) -> None:
        pass

    def _pre_bw_hook(self, *args: object) -> None:
        pass

    def _post_bw_hook(self, *args: object) -> None:
        pass


class ResidualMLPWithLoss(torch.nn.Module):
    """A wide residual MLP whose forward returns its mean squared error, so the loss is in the plan
    (``wanted``: a parameter named ``target`` would clash with ``schedule.step(target=)``)."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.mlp = ResidualMLP(num_blocks=blocks, width=width)

    def forward(self, x: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.mlp(x), wanted)


class GPT2WithLoss(torch.nn.Module):
    """Hugging Face's GPT-2 LM (tied head, dropout on) given ``labels``: its forward returns the loss."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=64, vocab_size=8192,
                                         bos_token_id=0, eos_token_id=0)
        self.lm = transformers.GPT2LMHeadModel(config).train()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels, use_cache=False).loss


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 8192, (BATCH, 32), generator=torch.Generator().manual_seed(1))
    return ids, ids.roll(-1, dims=1)


def build(name: str, quick: bool) -> tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """``name``'s model (seed 0), its inputs and targets for a batch of ``BATCH`` rows, and its name in words."""
    torch.manual_seed(0)
    if name == "gpt-lm":
        width, layers = (128, 4) if quick else (512, 8)
        return "GPT-style LM", GPTStyleLMWithLoss(vocab=8192, width=width, layers=layers, heads=8), *_tokens()
    if name == "residual-mlp":
        width = 256 if quick else 1024
        generator = torch.Generator().manual_seed(1)
        x, wanted = (torch.randn(BATCH, 32, width, generator=generator) for _ in range(2))  # two storages
        return f"residual MLP (width {width})", ResidualMLPWithLoss(width, 8), x, wanted
    if name == "hf-gpt2":
        width, layers = (128, 4) if quick else (256, 6)
        ids, _ = _tokens()
        return "Hugging Face GPT-2", GPT2WithLoss(width, layers), ids, ids
    raise SystemExit(f"unknown model {name!r}; use one of {', '.join(MODELS)}")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard if it is a DTensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard's)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def live_tensors(left_out: set[int]) -> list[torch.Tensor]:
    """Every tensor alive in this process but those whose storage is in ``left_out``."""
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return [tensor for tensor in tensors if _local(tensor).untyped_storage().data_ptr() not in left_out
            or not _local(tensor).untyped_storage().nbytes()]


def plan_copy_elsewhere(sharded: autoshard.ShardedModel, parallel) -> set[int]:
    """The storages of the plan's copy of the model that this rank's stages do not run on: under
    pipelining alone a stage runs on the plan's own parameters, which, left out too, were counted
    only once an operator returned them (Adam's in-place update), so a peak before it (the tied
    gradients' sync) missed the weights not read that way (stage 0's 4 MiB embedding)."""
    running = {_local(t).untyped_storage().data_ptr() for stage in parallel.stages
               for t in [*stage.submod.parameters(), *stage.submod.buffers()]}
    return {t.untyped_storage().data_ptr() for t in [*sharded.parameters(), *sharded.buffers()]} - running


def unused_batch(batch: tuple[torch.Tensor, ...], stepped_with: list[torch.Tensor]) -> set[int]:
    """The storages of the batch this process was handed but does not step with: every rank gets
    the whole batch, a float one (the residual MLP's) as big as a stage's activations, and a middle
    stage steps with none of it."""
    return ({t.untyped_storage().data_ptr() for t in batch}
            - {t.untyped_storage().data_ptr() for t in stepped_with})


def _total(tracker: MemTracker, kind: str) -> int:
    return sum(size for snapshot in tracker.get_tracker_snapshot(kind).values()
               for key, size in snapshot.items() if str(key) == "Total")


def measure(rank: int, world: int, sharded: autoshard.ShardedModel, ids: torch.Tensor, targets: torch.Tensor,
            layout: str, microbatches: int, optimizer_name: str, schedule: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dp, kind, precision, recompute = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
    parallel = parallelize(sharded, mesh, microbatches=microbatches, loss_fn=model_loss, data_parallel=kind,
                           schedule=schedule, mixed_precision=precision, activation_checkpointing=recompute)
    params = list(parallel.parameters())
    optimizer = OPTIMIZERS[optimizer_name][1](params)
    my_ids, my_targets = parallel.local_rows((ids, targets))
    inputs = (my_ids, my_targets) if parallel.is_first else ()
    target = my_targets if parallel.is_last else None

    def step() -> None:
        parallel.schedule.step(*inputs, target=target, return_outputs=False)
        parallel.sync_gradients()
        optimizer.step()

    step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    weight_state = {"weights": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
                    "optimizer": storage_bytes(state)}
    optimizer.zero_grad()
    gc.collect()
    tracker = StepTracker()
    stepped_with = [*inputs, *([target] if target is not None else [])]
    tracker.track_external(*live_tensors(plan_copy_elsewhere(sharded, parallel) | unused_batch(
        (ids, targets, my_ids, my_targets), stepped_with)))
    before = _total(tracker, "current")
    with tracker, without_cyclic_gc():
        step()
        optimizer.zero_grad()
    unsharded = sum(sharded.stages[stage.stage_index].get_parameter(name).nbytes
                    for stage in parallel.stages for name, _ in stage.submod.named_parameters())
    return {"stage": parallel.stages[0].stage_index, **weight_state, "unsharded": unsharded, "before": before,
            "peak": _total(tracker, "peak"), "model": parallel.memory_model}


def _list(text: str, known: Collection[str]) -> list[str]:
    """``text``'s comma-separated names, each one of ``known``."""
    names = text.split(",")
    for name in names:
        if name not in known:
            raise SystemExit(f"unknown {name!r}; use one of {', '.join(map(str, known))}")
    return names


def run(name: str, quick: bool, k: int, microbatches: int, optimizer: str, schedule: str, layouts: list[str]) -> None:
    """One table: ``name`` split into ``k`` stages, planned for and run with these settings, per layout."""
    title, model, ids, targets = build(name, quick)
    params = sum(p.numel() for p in model.parameters())
    print(f"{title}, {params / 1e6:.1f} M parameters ({params * 4 / MB:.0f} MB fp32), k = {k}, "
          f"{SCHEDULES[schedule]}, {microbatches} microbatches, {OPTIMIZERS[optimizer][0]}; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {datetime.date.today()}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| layout | rank | stage | weight state (MB) | unsharded / dp (MB) | ratio | before step (MB) "
          "| predicted peak (MB) | measured peak (MB) | predicted / measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    memory = autoshard.MemoryModel(microbatches=microbatches, optimizer=optimizer, schedule=schedule)
    per_weight = 2 + OPTIMIZER_STATE_TENSORS[optimizer]  # weights, grads and the optimizer's state (fp32 models)
    for layout in layouts:
        dp = LAYOUTS[layout][0]
        rows = BATCH // dp // microbatches  # one microbatch of one data-parallel rank
        sharded = autoshard.shard_model(model, k, example_inputs=(ids[:rows], targets[:rows]), memory_model=memory)
        results = run_local(measure, k * dp, args=(sharded, ids, targets, layout, microbatches, optimizer, schedule),
                            timeout=1800)
        for rank, row in enumerate(results):
            report = autoshard.plan_report(sharded, memory=row["model"])
            predicted = report.stages[row["stage"]].memory.total
            state = row["weights"] + row["grads"] + row["optimizer"]
            target = per_weight * row["unsharded"] / (dp if LAYOUTS[layout][1] == "fsdp" else 1)
            print(f"| {layout} ({k} x {dp}) | {rank} | {row['stage']} | {state / MB:.2f} | {target / MB:.2f} "
                  f"| {state / target:.3f} | {row['before'] / MB:.2f} | {predicted / MB:.2f} | {row['peak'] / MB:.2f} "
                  f"| {predicted / row['peak']:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--models", default="gpt-lm", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--k", default="2", help="pipeline stages (processes along pp), comma-separated")
    parser.add_argument("--microbatches", default="4", help=f"comma-separated divisors of the batch ({BATCH} rows)")
    parser.add_argument("--optimizer", default="adam", help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--schedule", default="1f1b", help=f"comma-separated, of {', '.join(SCHEDULES)}")
    args = parser.parse_args()
    sys.setrecursionlimit(10_000)  # pickling a 3-stage Hugging Face plan for the workers nests deeper than 1000
    layouts = _list(args.layouts, LAYOUTS)
    for name in _list(args.models, MODELS):
        for k in map(int, args.k.split(",")):
            for microbatches in map(int, args.microbatches.split(",")):
                for optimizer in _list(args.optimizer, OPTIMIZERS):
                    for schedule in _list(args.schedule, SCHEDULES):
                        if schedule == "1f1b" and microbatches < k:  # Schedule1F1B refuses it
                            print(f"{name}, k = {k}, 1F1B, {microbatches} microbatches: skipped (1F1B needs at "
                                  f"least k)\n")
                            continue
                        run(name, args.quick, k, microbatches, optimizer, schedule, layouts)


if __name__ == "__main__":
    main()
