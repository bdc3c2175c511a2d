"""Running the user's model (or pieces of it) for real without leaving a trace on it.

Capture runs the model on the example to learn shapes, and verify runs it to compare; both must
leave the model as it was. ``isolated`` replays randomness from one seed, turns off autograd, and
restores every buffer (BatchNorm statistics) afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map


@contextlib.contextmanager
def buffers_restored(model: nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@contextlib.contextmanager
def isolated(model: nn.Module, seed: int = 0) -> Iterator[None]:
    """Seeded randomness and the model's buffers restored on exit."""
    with torch.random.fork_rng(devices=[]), buffers_restored(model):
        torch.manual_seed(seed)
        yield


def cloned(value: Any) -> Any:
    """A copy of every tensor in ``value``, so running a capture never writes to the user's inputs."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)
