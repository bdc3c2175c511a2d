"""The memory model against real two-process steps of ``torch.distributed.pipelining`` (gloo), measured
as ``benchmarks/parallel_memory.py`` measures them: every storage a rank holds during its second step.

Where a stage sends back more than a backward frees (it receives a wide value and reduces it), what
torch's schedules hold of the sends decides the peak: GPipe holds every backward's sent-back gradient
to its last backward, and ``Schedule1F1B``'s warm-up keeps one sent output past its backward."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.runtime import run_local

LAUNCH_DEADLINE_S = 300
BENCHMARK = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "parallel_memory.py"


class Reduce(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(-1, keepdim=True)


class WideThenReduced(nn.Module):
    """A 4096-wide value cut before its reduction: the second stage receives it, saves nothing of
    it, and sends back a gradient as wide (a contiguous copy of the sum's expanded one)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide, self.reduce = nn.Linear(16, 4096), Reduce()
        self.narrow, self.out = nn.Linear(1, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.relu(self.narrow(self.reduce(self.wide(x))))), wanted)


def measured_step(rank: int, world: int, *args: object) -> dict:
    """The benchmark's own measurement of one rank (``parallel_memory.measure``), loaded from its file."""
    spec = importlib.util.spec_from_file_location("benchmark_parallel_memory", BENCHMARK)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(rank, world, *args)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_sending_back_more_than_it_frees_holds_what_the_model_predicts(schedule):
    """GPipe's second stage held 0.75x of the prediction more (every sent-back gradient to the last
    backward, counted for the second only); 1F1B's first stage 0.87x (the warm-up's held send)."""
    torch.manual_seed(0)
    model, microbatches = WideThenReduced(), 4
    x, wanted = torch.randn(8, 64, 16), torch.randn(8, 64, 16)
    memory = autoshard.MemoryModel(microbatches=microbatches, optimizer="sgd-momentum", schedule=schedule)
    rows = len(x) // microbatches
    sharded = autoshard.shard_model(model, 2, (x[:rows], wanted[:rows]), memory_model=memory, cut_before=["reduce"])
    results = run_local(measured_step, 2, args=(sharded, x, wanted, "pp", microbatches, "sgd-momentum", schedule),
                        timeout=LAUNCH_DEADLINE_S)
    ratios = [autoshard.plan_report(sharded, memory=row["model"]).stages[row["stage"]].memory.total / row["peak"]
              for row in results]
    assert all(0.97 <= ratio <= 1.03 for ratio in ratios), ratios
