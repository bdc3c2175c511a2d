"""Run a model too big for one device: its stages in turn, each stage's weights on the device only
while that stage runs.

Weights stay where the model keeps them (usually the CPU). For each stage the runner copies the
stage's parameters and buffers to the compute device, runs the stage on a weightless shell of it,
and lets the copies go. In training each stage runs under non-reentrant activation checkpointing:
the forward keeps only the stage's inputs, and the backward copies the weights in again, recomputes
the stage (replaying its random numbers) and sends the weight gradients back through the copy,
so they accumulate in the model's own ``.grad`` on its device. Peak device memory is about the
largest stage's weights plus its activations, plus the values passed between stages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch.func import functional_call
from torch.utils._pytree import tree_map

from autoshard.errors import InvalidArgumentTypeError
from autoshard.runtime.devices import DeviceLike, resolve_device, retarget_devices
from autoshard.runtime.rebuild import like, replaced, stage_tensors
from autoshard.sharded import ShardedModel


def _meta_placeholder(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return like(tensor, torch.empty_like(tensor, device="meta"))


class OffloadRunner:
    """Call it like the model: ``runner(*args, **kwargs)`` returns what the model returns.

    Inputs are moved to ``device`` and outputs stay there. Under ``torch.no_grad()`` it is
    inference only; otherwise ``loss.backward()`` fills the model's own parameters' ``.grad``.
    Buffers a stage updates (BatchNorm statistics) are written back to the model's buffers.
    """

    def __init__(self, sharded: ShardedModel, device: DeviceLike) -> None:
        if not isinstance(sharded, ShardedModel):
            raise InvalidArgumentTypeError(
                "OffloadRunner needs the ShardedModel that shard_model returned, "
                f"got {type(sharded).__name__}")
        self.sharded = sharded
        self.device = resolve_device(device, "the offload runner")
        self._shells = [replaced(stage, _meta_placeholder) for stage in sharded.stages]
        for shell in self._shells:
            retarget_devices(shell, self.device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = self._run(0, tree_map(self._to_device, args), tree_map(self._to_device, kwargs))
        for index in range(1, self.sharded.num_stages):
            values = self._run(index, values, {})
        return values

    def _to_device(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    def _run(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        written: list[dict[str, torch.Tensor]] = []
        if torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(
                self._call_stage, index, written, *args, use_reentrant=False, **kwargs)
        else:
            out = self._call_stage(index, written, *args, **kwargs)
        self._write_back_buffers(index, written[0])
        return out

    def _call_stage(self, index: int, written: list[dict[str, torch.Tensor]],
                    *args: Any, **kwargs: Any) -> Any:
        """Run stage ``index`` on fresh device copies of its tensors.

        Parameters are copied differentiably, so their gradients flow back to the model's own.
        Buffers are always copies; the first run's are kept in ``written`` to be stored back
        (a recomputation in the backward must not update them twice).
        """
        copies: dict[int, torch.Tensor] = {}
        tensors: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for name, home in stage_tensors(self.sharded.stages[index]).items():
            if id(home) not in copies:
                is_param = isinstance(home, torch.nn.Parameter)
                copies[id(home)] = (home.to(self.device) if is_param
                                    else home.detach().to(self.device, copy=True))
                if not is_param:
                    buffers[name] = copies[id(home)]
            tensors[name] = copies[id(home)]
        written.append(buffers)
        self._follow_modes(index)
        return functional_call(self._shells[index], tensors, args, kwargs, tie_weights=False, strict=True)

    def _follow_modes(self, index: int) -> None:
        """The shell's modules take the modes the model's modules have now (the shell was copied
        once; ``model.train()`` since then must reach it, and its stage's mode guard)."""
        homes = self.sharded.stages[index].named_modules(remove_duplicate=False)
        shells = self._shells[index].named_modules(remove_duplicate=False)
        for (_, home), (_, shell) in zip(homes, shells):
            shell.training = home.training

    def _write_back_buffers(self, index: int, buffers: dict[str, torch.Tensor]) -> None:
        """Copy every buffer back: kernels such as batch_norm update running statistics in place
        without leaving a trace (not even the tensor's version counter)."""
        homes = dict(self.sharded.stages[index].named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, value in buffers.items():
                homes[name].copy_(value)
