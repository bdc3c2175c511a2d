"""A stage's optimizer, stepped for real without changing the model: for measuring what its step
holds (``measure_stage_memory``) and how long it takes (``measure_stage_time``).

The real ``torch.optim`` class runs over stand-ins of the stage's weights: ``.data``, which shares a
weight's storage but not its version counter (a graph of the caller's that holds the weight stays
valid), with a learning rate of 0, state as after a first step (zeros) and gradients made
non-negative in place (``abs_``: real magnitudes, for a step that takes its real time; all zeros
ran Adam twice as slow): every update adds -0.0 times a non-negative number, -0.0, which leaves
every bit of a weight as it was (a -0.0 included; a positive update would turn it into 0.0).
Its state is what ``torch.optim`` keeps, ``zeros_like`` the weight (bf16 moments for a bf16 weight).
Under ``master_weights`` a weight narrower than fp32 is stepped through an fp32 copy, with fp32
state: a holder keeps both, not stepped (the fp32 gradient such a step needs is the training
loop's own, which the memory model does not count either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, suggest

#: State tensors per parameter, by optimizer name, each ``zeros_like`` what it steps (the state their
#: ``torch.optim`` class keeps; Adam's 4-byte step counter per parameter is left out, as the memory
#: model leaves it out).
OPTIMIZER_STATE: dict[str, tuple[str, ...]] = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "sgd-momentum": ("momentum_buffer",),
    "sgd": (),
    "none": (),
}

#: ``torch.optim`` class and options by optimizer name (the defaults the memory model counts).
_TORCH_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("Adam", {}), "adamw": ("AdamW", {}), "sgd-momentum": ("SGD", {"momentum": 0.9}), "sgd": ("SGD", {})}


def optimizer_state_names(optimizer: str) -> tuple[str, ...]:
    """The state tensors ``optimizer`` keeps per parameter; a typed error for a name it does not know."""
    if not isinstance(optimizer, str):
        raise InvalidArgumentTypeError(f"optimizer must be a name ({', '.join(OPTIMIZER_STATE)}), got {optimizer!r}")
    name = optimizer.lower()
    if name not in OPTIMIZER_STATE:
        raise InvalidArgumentError(
            f"unknown optimizer {optimizer!r}{suggest(name, OPTIMIZER_STATE)}; known: {', '.join(OPTIMIZER_STATE)} "
            "(for another optimizer, pick the one keeping as many fp32 tensors per parameter)")
    return OPTIMIZER_STATE[name]


@dataclass(frozen=True)
class StandIns:
    """A stage's optimizers: ``stepping``, the ``torch.optim`` class over stand-ins of ``weights``,
    and ``holder``, the fp32 state and master copies of the narrower weights under ``master_weights``,
    never stepped."""

    stepping: torch.optim.Optimizer | None
    weights: list[nn.Parameter]
    holder: torch.optim.Optimizer | None

    @property
    def all(self) -> list[torch.optim.Optimizer]:
        return [optimizer for optimizer in (self.stepping, self.holder) if optimizer is not None]

    def prepare(self) -> None:
        """Hand each stand-in its weight's gradient (a measurement's own, given back after it), made
        non-negative in place (a complex one's parts): updates of -0.0 only; none where the weight has none."""
        for stand_in, weight in zip(self.stepping.param_groups[0]["params"] if self.stepping else (), self.weights):
            grad = weight.grad
            if grad is not None:
                (torch.view_as_real(grad) if grad.is_complex() else grad).abs_()
            stand_in.grad = grad

    def step(self) -> None:
        """One step of the optimizer, as training runs it after the last backward."""
        self.prepare()
        if self.stepping is not None:
            self.stepping.step()


def stand_ins(params: list[nn.Parameter], optimizer: str, master_weights: bool, foreach: bool | None) -> StandIns:
    """``StandIns`` over the trainable ``params`` for ``optimizer`` (a known name, lower case), its state
    as after a first step; ``foreach`` as ``torch.optim`` takes it (None: its choice for the device)."""
    mastered = [p for p in params if master_weights and p.element_size() < 4]
    own = [p for p in params if not (master_weights and p.element_size() < 4)]
    stepping = None
    if own and optimizer in _TORCH_OPTIMIZERS:
        name, options = _TORCH_OPTIMIZERS[optimizer]
        aliases = [p.data.requires_grad_(True) for p in own]
        stepping = getattr(torch.optim, name)(aliases, lr=0.0, foreach=foreach, **options)
        for alias in aliases:
            stepping.state[alias] = _state_after_a_step(optimizer, alias)
    holder = torch.optim.SGD(mastered, lr=0.0) if mastered else None
    for p in mastered:
        holder.state[p] = {name: torch.zeros_like(p, dtype=torch.float32) for name in OPTIMIZER_STATE[optimizer]}
        holder.state[p]["master"] = p.detach().float()
    return StandIns(stepping, own if stepping is not None else [], holder)


def _state_after_a_step(optimizer: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state ``torch.optim`` keeps for ``param`` after one step, zeros (Adam's step count, a CPU
    scalar on any device, is 1: its bias correction divides by 1 - beta ** step)."""
    state = {name: torch.zeros_like(param, memory_format=torch.preserve_format) for name in OPTIMIZER_STATE[optimizer]}
    if optimizer in ("adam", "adamw"):
        state["step"] = torch.tensor(1.0)
    return state


__all__ = ["OPTIMIZER_STATE", "StandIns", "optimizer_state_names", "stand_ins"]
