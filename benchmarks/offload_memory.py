"""Peak GPU memory of the offload runner against the largest stage and the whole model.

    python benchmarks/offload_memory.py              # needs a CUDA device
    python benchmarks/offload_memory.py --stages 8

The weights live on the CPU; ``OffloadRunner`` copies one stage at a time to the GPU. For
inference and for one training step (forward and backward) it prints the peak allocated GPU
memory beside the largest stage's weights and the whole model's weights.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import autoshard
from autoshard.runtime import OffloadRunner

WIDTH, DEPTH, BATCH = 4096, 16, 64


def deep_mlp() -> nn.Module:
    """16 x 4096^2 float32 linears: 1.07 GB of weights."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)))


def weight_bytes(module: nn.Module) -> int:
    return sum(t.nbytes for t in module.state_dict().values())


def peak_bytes(run) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the offload runner's device memory can only be measured on a GPU")
        return
    torch.manual_seed(0)
    model = deep_mlp()
    x = torch.randn(BATCH, WIDTH)
    sharded = autoshard.shard_model(model, args.stages, example_inputs=(x[:2],))
    runner = OffloadRunner(sharded, "cuda")
    largest = max(weight_bytes(stage) for stage in sharded.stages)

    def infer() -> None:
        with torch.no_grad():
            runner(x)

    def train() -> None:
        runner(x).pow(2).mean().backward()

    print(f"{DEPTH} x Linear({WIDTH}, {WIDTH}), batch {BATCH}, {args.stages} stages "
          f"on {torch.cuda.get_device_name()}")
    print("| run | peak GPU MB | largest stage MB | whole model MB |")
    print("|---|---|---|---|")
    for name, run in (("inference", infer), ("training step", train)):
        megabytes = [peak_bytes(run) / 1e6, largest / 1e6, weight_bytes(model) / 1e6]
        print(f"| {name} | " + " | ".join(f"{mb:.0f}" for mb in megabytes) + " |")


if __name__ == "__main__":
    main()
