"""Train a model split by autoshard on PyTorch's own pipeline engine, torch.distributed.pipelining.

    torchrun --nproc-per-node 2 examples/train_pipeline.py
    torchrun --nproc-per-node 2 examples/train_pipeline.py --model residual-mlp --schedule 1f1b
    torchrun --nproc-per-node 2 examples/train_pipeline.py --stages 4 --schedule interleaved-1f1b
    torchrun --nproc-per-node 2 examples/train_pipeline.py --model hf-gpt2   # needs transformers
    torchrun --nproc-per-node 4 examples/train_pipeline.py --dp 2            # 2 pipeline x 2 FSDP
    torchrun --nproc-per-node 4 examples/train_pipeline.py --dp 2 --ddp      # 2 pipeline x 2 replicas

On CPUs the processes talk over gloo; where CUDA is available the same command uses NCCL and
GPU ``LOCAL_RANK``. Every rank builds the same model from the same seed, shards it, and runs only
its own stages (stage i on pipeline rank i % pipeline size). The last stage's rank prints the loss.

With ``--dp N`` the processes form a (world / N) x N mesh (``autoshard.runtime.parallelize``): N
copies of the pipeline, each training on its own rows of every batch, their weights sharded by
FSDP2 (``--fsdp``, the default) or replicated (``--ddp``). The ranks of one copy of a stage are
consecutive, so with ``torchrun --nnodes`` they share a node (the data-parallel collectives move
the most bytes) while the pipeline spans the nodes.

The default model is a small GPT-2-style LM whose head reuses the embedding weight: the two land
on different ranks, and ``parallel.sync_gradients()`` (``TiedGradients``) sums their gradients so
training matches the unsplit model. It computes its own loss, the pattern worth following:

* Let the model compute the loss (``GPTStyleLMWithLoss(ids, targets)``; a Hugging Face model
  called with ``labels=``) and shard it with the targets among the example inputs. The loss is
  then part of the plan, so the cost models (``flops``, ``time``) see the last stage's whole
  work; a loss computed after the last stage is invisible to them and makes that stage the
  bottleneck. The targets cross the stage boundaries as a small integer tensor.
* Build the schedule with ``loss_fn=autoshard.runtime.model_loss``: it returns the loss the last
  stage computed (the first tensor of a ``ModelOutput``, which the last stage returns as a tuple).
* Rank 0 passes the model's inputs, targets included; the last rank passes ``target=`` too (PyTorch's
  schedules require one there, ``model_loss`` ignores it) and steps with ``return_outputs=False``
  (per-microbatch losses are scalars that cannot be concatenated into a batch output); read the
  losses from ``losses=[]``.

For Hugging Face models also pass ``use_cache=False`` (a cache is not a tensor a stage can return).
A model whose loss is computed outside it (``--model residual-mlp``) uses its loss as ``loss_fn``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.examples import GPTStyleLMWithLoss, ResidualMLP
from torch.distributed.device_mesh import init_device_mesh

from autoshard.runtime import SCHEDULES, leave_process_group, model_loss, parallelize

Batch = tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], torch.Tensor]  # args, kwargs, target


@dataclass(frozen=True)
class Workload:
    """A model, how to make a batch for it, and the ``loss_fn`` of the schedule (applied to the
    model's output it gives the unsplit model's loss too)."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Batch]
    loss_fn: Callable[..., torch.Tensor]


def _token_batch(vocab: int) -> Callable[[int, torch.Generator], Batch]:
    def make(batch: int, gen: torch.Generator) -> Batch:
        ids, targets = (torch.randint(0, vocab, (batch, 8), generator=gen) for _ in range(2))
        return (ids, targets), {}, targets
    return make


def _vector_batch(batch: int, gen: torch.Generator) -> Batch:
    return (torch.randn(batch, 16, generator=gen),), {}, torch.randn(batch, 16, generator=gen)


def hf_gpt2() -> nn.Module:
    """Hugging Face's GPT-2, 4 blocks of width 64, random weights, LM head tied to the embedding."""
    import transformers  # only this model needs it

    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=2,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _labels_batch(batch: int, gen: torch.Generator) -> Batch:
    ids = torch.randint(0, 256, (batch, 8), generator=gen)
    return (ids,), {"labels": ids}, ids


WORKLOADS: dict[str, Workload] = {
    "gpt": Workload(lambda: GPTStyleLMWithLoss(layers=4), _token_batch(100), model_loss),
    "hf-gpt2": Workload(hf_gpt2, _labels_batch, model_loss),
    "residual-mlp": Workload(ResidualMLP, _vector_batch, F.mse_loss),
}


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return WORKLOADS[name].build()


def make_batch(name: str, step: int, batch: int) -> Batch:
    """``(args, kwargs, target)`` for ``step``: the same on every rank and in an unsplit run."""
    return WORKLOADS[name].batch(batch, torch.Generator().manual_seed(1000 + step))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="gpt")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--stages", type=int, default=None,
                        help="number of stages (default: one per process)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel copies of the pipeline (the world size must be a multiple)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--fsdp", dest="data_parallel", action="store_const", const="fsdp",
                      help="shard each stage's weights over the copies (FSDP2; the default)")
    kind.add_argument("--ddp", dest="data_parallel", action="store_const", const="ddp",
                      help="replicate each stage's weights over the copies")
    parser.set_defaults(data_parallel="fsdp")
    return parser.parse_args(argv)


def _to(device: torch.device, batch: Batch) -> Batch:
    args, kwargs, target = batch
    return tuple(a.to(device) for a in args), {k: v.to(device) for k, v in kwargs.items()}, target.to(device)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    world = dist.get_world_size()
    if args.dp < 1 or world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the {world} processes into equal pipelines")
    if args.dp == 1:  # pipelining alone: a one-dimensional mesh
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("pp",))
    else:
        mesh = init_device_mesh(device.type, (world // args.dp, args.dp), mesh_dim_names=("pp", "dp"))

    model = make_model(args.model)
    # one microbatch of one pipeline's rows: what the plan's memory and step-time predictions count as one
    rows = max(1, args.batch // (args.dp * args.microbatches))
    example_args, example_kwargs, _ = make_batch(args.model, 0, rows)
    sharded = autoshard.shard_model(model, args.stages or world // args.dp, example_inputs=example_args,
                                    example_kwargs=example_kwargs)
    parallel = parallelize(sharded, mesh, data_parallel=args.data_parallel, schedule=args.schedule,
                           microbatches=args.microbatches, loss_fn=WORKLOADS[args.model].loss_fn)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=args.lr)
    # the data-parallel group of the last stage's ranks, to average their losses for the printout
    last_copies = mesh.get_group("dp") if args.dp > 1 and parallel.is_last else None

    for step in range(args.steps):
        inputs, keywords, target = parallel.local_rows(_to(device, make_batch(args.model, step, args.batch)))
        optimizer.zero_grad()
        losses: list[torch.Tensor] | None = [] if parallel.is_last else None
        parallel.schedule.step(*(inputs if parallel.is_first else ()), **(keywords if parallel.is_first else {}),
                               target=target if parallel.is_last else None, losses=losses, return_outputs=False)
        parallel.sync_gradients()
        optimizer.step()
        if parallel.is_last:
            loss = torch.stack(losses).mean().detach()
            if last_copies is not None:
                dist.all_reduce(loss, group=last_copies)
                loss /= args.dp
            if parallel.dp_rank == 0:
                print(f"step {step} loss {loss.item():.8e}", flush=True)
    leave_process_group()  # (returning instead can abort in gloo's teardown: see its docstring)


if __name__ == "__main__":
    main()
