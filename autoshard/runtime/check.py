"""``check_pipeline_step``: one pipeline step against the unsplit model, loss and every gradient.

The comparison every user of a pipeline writes by hand before trusting it: run one schedule step,
run the whole model on the same batch, and compare the loss and each parameter's gradient. Every
rank calls it with the same batch; each compares the stages it runs with its own run of the model
(on a copy, so neither run's gradients reach the other's), and the rows are gathered so that every
rank returns, or raises, the same verdict: a mismatch cannot leave one rank waiting for another.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, VerificationError
from autoshard.runtime.schedule import _model_loss_at, model_loss
from autoshard.runtime.ties import TiedGradients
from autoshard.runtime.wire import OutputTensors


@dataclass(frozen=True)
class GradientDifference:
    """How far one parameter's gradient in the pipeline is from the unsplit model's: the largest
    absolute and relative differences over the stages holding it. ``problem`` says why it
    cannot be compared (no gradient where the model has one), or is empty."""

    name: str
    stages: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool
    problem: str = ""

    def __str__(self) -> str:
        where = f"{self.name} (stage{'s' if len(self.stages) > 1 else ''} {', '.join(map(str, self.stages))})"
        return f"{where}: {self.problem}" if self.problem else \
            f"{where}: max abs difference {self.max_abs:.3g}, max relative {self.max_rel:.3g}"


@dataclass(frozen=True)
class StepCheck:
    """The verdict of ``check_pipeline_step``, the same on every rank."""

    loss: float
    """The pipeline's loss: the mean of its microbatches' losses."""
    expected_loss: float
    """The unsplit model's loss on the whole batch."""
    loss_ok: bool
    gradients: tuple[GradientDifference, ...]
    rtol: float
    atol: float

    @property
    def loss_difference(self) -> float:
        return abs(self.loss - self.expected_loss)

    @property
    def failing(self) -> tuple[GradientDifference, ...]:
        return tuple(g for g in self.gradients if not g.ok)

    @property
    def ok(self) -> bool:
        return self.loss_ok and not self.failing

    def __str__(self) -> str:
        lines = [f"loss {self.loss:.6g}, unsplit {self.expected_loss:.6g} (difference {self.loss_difference:.3g}"
                 f"{'' if self.loss_ok else ', beyond the tolerance'}); {len(self.gradients)} gradients compared, "
                 f"{len(self.failing)} beyond rtol={self.rtol:g}, atol={self.atol:g}"]
        lines += [f"  {g}" for g in self.failing]
        return "\n".join(lines)


def check_pipeline_step(
    schedule: Any,
    stages: PipelineStage | Sequence[PipelineStage],
    model: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    target: Any = None,
    loss_fn: Callable[..., torch.Tensor],
    ties: TiedGradients | None = None,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    raise_on_mismatch: bool = True,
) -> StepCheck:
    """Run one step of ``schedule`` and the unsplit ``model`` on the same batch; compare the loss
    and every parameter's gradient. A collective: call it on every rank of the pipeline, with the
    stages that rank runs and the same ``model``, ``args``, ``kwargs`` and ``target`` everywhere
    (the first stage's rank steps with the inputs, the last one's with the target).

    ``loss_fn`` is the schedule's: it is given the model's output as the last stage returns it
    (its tensors, ``None`` fields dropped), and ``model_loss`` reads the model's own loss. The
    pipeline's loss is the mean over microbatches, as PyTorch's schedules scale gradients, so
    ``loss_fn`` must average over the batch. ``ties`` (the ``TiedGradients`` of these stages) is
    synced after the step, as a training step does. The stages' gradients are this step's alone
    afterwards (they are cleared first); ``model`` (the whole model, with its weights: not one made
    on the ``meta`` device) is run on a copy and left as it was. It must be deterministic on this
    batch (no dropout) for the two runs to agree.

    Returns a ``StepCheck`` (largest differences per parameter, the loss difference); a gradient or
    loss beyond ``atol + rtol * |expected|`` raises ``VerificationError`` on every rank, with the
    check as its ``check`` attribute, unless ``raise_on_mismatch=False``.
    """
    local = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not local or not all(isinstance(s, PipelineStage) for s in local):
        raise InvalidArgumentTypeError("check_pipeline_step needs the PipelineStage(s) this rank runs, "
                                       "as given to build_schedule")
    if not isinstance(model, nn.Module):
        raise InvalidArgumentTypeError(f"check_pipeline_step compares with the unsplit model (an nn.Module), "
                                       f"got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    expected_loss, expected = _unsplit_step(model, args, kwargs, target, loss_fn)
    if not math.isfinite(expected_loss):  # every rank ran the model: all refuse before any collective
        raise InvalidArgumentError(
            f"the unsplit model's loss is {expected_loss} on this batch, so there is nothing to compare the step "
            "with; check with a batch whose loss is finite")
    losses = _pipeline_step(schedule, local, args, kwargs, target, ties)
    rows = [(stage.stage_index, name, param.grad) for stage in local
            for name, param in stage.submod.named_parameters(remove_duplicate=False)]
    mine = [_difference(stage, name, grad, expected.get(name), rtol, atol) for stage, name, grad in rows]
    gathered: list[Any] = [None] * dist.get_world_size(local[0].group)
    dist.all_gather_object(gathered, (mine, None if losses is None else torch.stack(losses).mean().item()),
                           group=local[0].group)
    loss = next(value for _, value in gathered if value is not None)
    held = [row for rank_rows, _ in gathered for row in rank_rows]
    check = StepCheck(loss, expected_loss, _close(loss, expected_loss, rtol, atol),
                      _by_parameter(held, expected), rtol, atol)
    if raise_on_mismatch and not check.ok:
        shared = any(len(g.stages) > 1 or g.name in _tied_names(model) for g in check.failing)
        hint = ("; parameters several stages hold need their gradients summed: pass ties=TiedGradients(sharded, "
                "stages)" if shared and ties is None else "")
        error = VerificationError(f"the pipeline step differs from the unsplit model's: {check}{hint}")
        error.check = check
        raise error
    return check


def _unsplit_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                  loss_fn: Callable[..., torch.Tensor]) -> tuple[float, dict[str, torch.Tensor | None]]:
    """The whole model's loss and gradients (by every parameter name, tied names too), on a copy."""
    unsplit = copy.deepcopy(model)
    unsplit.zero_grad(set_to_none=True)
    flat = OutputTensors()
    output = flat(unsplit(*args, **kwargs))
    loss = (functools.partial(_model_loss_at, flat) if loss_fn is model_loss else loss_fn)(output, target)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in unsplit.named_parameters(remove_duplicate=False)}


def _pipeline_step(schedule: Any, local: list[PipelineStage], args: tuple[Any, ...], kwargs: dict[str, Any],
                   target: Any, ties: TiedGradients | None) -> list[torch.Tensor] | None:
    """One step from cleared gradients; the microbatch losses on the rank of the last stage."""
    for stage in local:
        stage.submod.zero_grad(set_to_none=True)
    first = any(stage.is_first for stage in local)
    last = any(stage.is_last for stage in local)
    losses: list[torch.Tensor] | None = [] if last else None
    schedule.step(*(args if first else ()), **(kwargs if first else {}), target=target if last else None,
                  losses=losses, return_outputs=False)
    if ties is not None:
        ties.sync()
    return losses


def _tied_names(model: nn.Module) -> set[str]:
    """Names of parameters the model holds under several names (an LM head tied to the embedding):
    stages holding it under different names must sum its gradient too."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {name for group in names.values() if len(group) > 1 for name in group}


def _close(actual: float, expected: float, rtol: float, atol: float) -> bool:
    return math.isfinite(actual) and abs(actual - expected) <= atol + rtol * abs(expected)


def _difference(stage: int, name: str, grad: torch.Tensor | None, expected: torch.Tensor | None,
                rtol: float, atol: float) -> GradientDifference:
    """One holder's gradient against the model's (a parameter the model left without a gradient
    must get none or zeros)."""
    if grad is None:
        ok = expected is None or not expected.any()
        return GradientDifference(name, (stage,), 0.0, 0.0, ok, "" if ok else "no gradient in the pipeline")
    reference = torch.zeros_like(grad) if expected is None else expected.to(grad.device, grad.dtype)
    gap = (grad.detach() - reference).abs()
    size = reference.abs()
    relative = torch.where(size > 0, gap / size, torch.where(gap > 0, torch.inf, 0.0))
    ok = bool((gap <= atol + rtol * size).all())
    return GradientDifference(name, (stage,), _largest(gap), _largest(relative), ok)


def _largest(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0


def _by_parameter(rows: list[GradientDifference], expected: Mapping[str, torch.Tensor | None]
                  ) -> tuple[GradientDifference, ...]:
    """One entry per parameter name, over every stage holding it, in the model's order; a
    parameter the model gives a gradient but no stage holds is an entry of its own."""
    merged: dict[str, GradientDifference] = {}
    for row in rows:
        seen = merged.get(row.name)
        merged[row.name] = row if seen is None else GradientDifference(
            row.name, tuple(sorted({*seen.stages, *row.stages})), max(seen.max_abs, row.max_abs),
            max(seen.max_rel, row.max_rel), seen.ok and row.ok, "; ".join(p for p in (seen.problem, row.problem) if p))
    for name, grad in expected.items():
        if name not in merged and grad is not None:
            merged[name] = GradientDifference(name, (), 0.0, 0.0, False, "held by no stage")
    order = {name: i for i, name in enumerate(expected)}
    return tuple(sorted(merged.values(), key=lambda g: order.get(g.name, len(order))))
