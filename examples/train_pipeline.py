"""Train a model split by autoshard on PyTorch's own pipeline engine, torch.distributed.pipelining.

    torchrun --nproc-per-node 2 examples/train_pipeline.py
    torchrun --nproc-per-node 2 examples/train_pipeline.py --model residual-mlp --schedule 1f1b
    torchrun --nproc-per-node 2 examples/train_pipeline.py --stages 4 --schedule interleaved-1f1b

On CPUs the processes talk over gloo; where CUDA is available the same command uses NCCL and
GPU ``LOCAL_RANK``. Every rank builds the same model from the same seed, shards it, and runs only
its own stages (stage i on rank i % world size). The default model is a tiny GPT-2-style LM whose
head reuses the embedding weight: the two land on different ranks, and ``TiedGradients`` sums
their gradients so training matches the unsplit model. The last stage's rank prints the loss.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.examples import ResidualMLP
from autoshard.runtime import (
    SCHEDULES,
    TiedGradients,
    build_schedule,
    check_world_size,
    local_stage_indices,
    pipeline_stage,
)


class Block(nn.Module):
    """A GPT-2 block: causal self-attention and an MLP, each with a pre-norm and a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        q, k, v = (lin(h).unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).flatten(2))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-style LM; the causal mask is made once and read by every block, and the LM head
    reuses the token embedding's weight unless ``tied`` is False."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 2, layers: int = 4, max_len: int = 16,
                 tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())
        self.register_buffer("positions", torch.arange(max_len))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.size(1)
        mask = self.causal[:length, :length]
        x = self.wte(ids) + self.wpe(self.positions[:length])
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


#: name -> (build the model, make one batch from a generator, loss)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], tuple], Callable]] = {
    "tiny-gpt": (
        TinyGPT,
        lambda batch, gen: tuple(torch.randint(0, 64, (batch, 8), generator=gen) for _ in range(2)),
        lm_loss,
    ),
    "residual-mlp": (
        ResidualMLP,
        lambda batch, gen: (torch.randn(batch, 16, generator=gen), torch.randn(batch, 16, generator=gen)),
        F.mse_loss,
    ),
}


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def make_batch(name: str, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, target)`` for ``step``: the same on every rank and in an unsplit run."""
    return MODELS[name][1](batch, torch.Generator().manual_seed(1000 + step))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-gpt")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--stages", type=int, default=None,
                        help="number of stages (default: one per process)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_stages = args.stages or world
    check_world_size(num_stages, world, args.schedule)

    model = make_model(args.model)
    example, _ = make_batch(args.model, 0, args.batch)
    sharded = autoshard.shard_model(model, num_stages, example_inputs=(example,))
    mine = local_stage_indices(num_stages, rank, world)
    stages = [pipeline_stage(sharded, index, num_stages, device) for index in mine]
    schedule = build_schedule(stages, args.schedule, args.microbatches, loss_fn=MODELS[args.model][2])
    ties = TiedGradients(sharded, stages)
    params = list({id(p): p for stage in stages for p in stage.submod.parameters()}.values())
    optimizer = torch.optim.SGD(params, lr=args.lr)

    first, last = 0 in mine, num_stages - 1 in mine
    for step in range(args.steps):
        inputs, target = (t.to(device) for t in make_batch(args.model, step, args.batch))
        optimizer.zero_grad()
        losses: list[torch.Tensor] | None = [] if last else None
        schedule.step(*((inputs,) if first else ()), target=target if last else None, losses=losses)
        ties.sync()
        optimizer.step()
        if last:
            print(f"step {step} loss {torch.stack(losses).mean().item():.8e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
