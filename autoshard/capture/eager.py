"""Running the user's model (or pieces of it) for real without leaving a trace on it.

Capture runs the model on the example to learn shapes, and verify runs it to compare; both must
leave the model as it was. ``isolated`` replays randomness from one seed and restores every buffer
(BatchNorm statistics) and every plain attribute of every module afterwards: a forward that
sets one (Swin stores its window size) would otherwise keep a value from the example, or during
a trace a Proxy that fails the model's next call.
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


_REGISTRIES = ("_parameters", "_buffers", "_modules")


@contextlib.contextmanager
def attributes_restored(model: nn.Module) -> Iterator[None]:
    """Every module's plain attributes as they were on entry: changed ones set back, new ones
    removed. Parameters, buffers and submodules keep their own registries (see ``buffers_restored``)."""
    saved = [(module, {k: v for k, v in vars(module).items() if k not in _REGISTRIES}) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            current = vars(module)
            for key in [k for k in current if k not in attributes and k not in _REGISTRIES]:
                del current[key]
            current.update(attributes)


@contextlib.contextmanager
def isolated(model: nn.Module, seed: int = 0) -> Iterator[None]:
    """Seeded randomness, and the model's buffers and attributes restored on exit."""
    with torch.random.fork_rng(devices=[]), buffers_restored(model), attributes_restored(model):
        torch.manual_seed(seed)
        yield


def cloned(value: Any) -> Any:
    """A copy of every tensor in ``value``, so running a capture never writes to the user's inputs."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)
