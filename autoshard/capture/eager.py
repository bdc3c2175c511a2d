"""Running the user's model (or pieces of it) for real without leaving a trace on it.

Capture runs the model on the example to learn shapes, and verify runs it to compare; both must
leave the model as it was. ``isolated`` replays randomness from one seed, restores every buffer
(BatchNorm statistics) afterwards, and takes off the modules whatever a trace left on them: a
forward that stores a value on itself (Swin's window size) would keep a Proxy, and fail the
model's next call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
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


def holds(value: Any, kinds: type | tuple[type, ...]) -> bool:
    """Whether an instance of ``kinds`` hides anywhere in ``value`` (containers, dataclass fields, slices)."""
    if isinstance(value, kinds):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(holds(v, kinds) for v in value)
    if isinstance(value, dict):
        return any(holds(v, kinds) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds(getattr(value, f.name, None), kinds) for f in dataclasses.fields(value))
    if isinstance(value, slice):
        return any(holds(v, kinds) for v in (value.start, value.stop, value.step))
    return False


#: Values only a trace makes; left on a module, they break its next real call.
TRACE_VALUES = (fx.Proxy, torch.SymInt, torch.SymFloat, torch.SymBool, FakeTensor)


#: Where a trace can leave a value besides plain attributes: ``self.count += 1`` on a buffer
#: sets the buffer to the Proxy of the addition.
_TENSOR_REGISTRIES = ("_parameters", "_buffers")


def trace_values_on(module: nn.Module) -> list[str]:
    """The attributes of ``module`` (plain ones, parameters and buffers; not its children) holding
    a trace value."""
    plain = [key for key, value in vars(module).items() if key not in _REGISTRIES and holds(value, TRACE_VALUES)]
    return plain + [key for registry in _TENSOR_REGISTRIES for key, value in getattr(module, registry).items()
                    if holds(value, TRACE_VALUES)]


@contextlib.contextmanager
def trace_values_cleared(model: nn.Module) -> Iterator[None]:
    """On exit, every plain module attribute that holds a trace value is set back (or removed,
    if the run added it). Real values a forward stores on itself are its own business, as on any
    call; they may be tied to hooks it installed (Hugging Face's output recorders)."""
    saved = [(module, [dict(vars(module))] + [dict(getattr(module, r)) for r in _TENSOR_REGISTRIES])
             for module in model.modules()]
    try:
        yield
    finally:
        for module, befores in saved:
            for current, before in zip([vars(module)] + [getattr(module, r) for r in _TENSOR_REGISTRIES], befores):
                for key in [k for k, value in current.items() if k not in _REGISTRIES and holds(value, TRACE_VALUES)]:
                    if key in before:
                        current[key] = before[key]
                    else:
                        del current[key]


@contextlib.contextmanager
def isolated(model: nn.Module, seed: int = 0) -> Iterator[None]:
    """Seeded randomness, the model's buffers restored and trace values cleared on exit."""
    with torch.random.fork_rng(devices=[]), buffers_restored(model), trace_values_cleared(model):
        torch.manual_seed(seed)
        yield


def cloned(value: Any) -> Any:
    """A copy of every tensor in ``value``, so running a capture never writes to the user's inputs."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)
