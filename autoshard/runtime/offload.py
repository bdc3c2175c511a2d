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

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call

from autoshard.errors import InvalidArgumentTypeError, SpecializationMismatch
from autoshard.isolation import PLAIN_VALUES
from autoshard.runtime.devices import DeviceLike, resolve_device, retarget_devices
from autoshard.runtime.rebuild import like, replaced, stage_tensors
from autoshard.sharded import ShardedModel, moved_to


def _meta_placeholder(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return like(tensor, torch.empty_like(tensor, device="meta"))


class OffloadRunner:
    """Call it like the model: ``runner(*args, **kwargs)`` returns what the model returns.

    Inputs are moved to ``device`` and outputs stay there. Under ``torch.no_grad()`` it is
    inference only; otherwise ``loss.backward()`` fills the model's own parameters' ``.grad``.
    Buffers a stage updates (BatchNorm statistics) are written back to the model's buffers, and
    numbers and flags its modules keep on themselves (a step counter) to the model's modules.
    """

    def __init__(self, sharded: ShardedModel, device: DeviceLike) -> None:
        if not isinstance(sharded, ShardedModel):
            raise InvalidArgumentTypeError(
                "OffloadRunner needs the ShardedModel that shard_model returned, "
                f"got {type(sharded).__name__}")
        self.sharded = sharded
        self.device = resolve_device(device, "the offload runner")
        self._runners: dict[int, OffloadRunner] = {}  # by specialisation (each kept alive by its runner)
        self._shells = [replaced(stage, _meta_placeholder) for stage in sharded.stages]
        for shell in self._shells:
            retarget_devices(shell, self.device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        specializer = self.sharded.specializer
        if specializer is None:
            try:
                return self.run_stages(args, kwargs)
            except SpecializationMismatch as exc:
                raise exc.where_nothing_captures() from None
        return specializer.serve(self.sharded, args, kwargs, self._run_plan)

    def _run_plan(self, sharded: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``sharded`` (this plan or one of its specialisations) offloaded, each by a runner of its own."""
        if sharded is self.sharded:
            return self.run_stages(args, kwargs)
        runner = self._runners.get(id(sharded))
        if runner is None:
            runner = self._runners[id(sharded)] = OffloadRunner(sharded, self.device)
        return runner.run_stages(args, kwargs)

    def run_stages(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of this plan's stages, each offloaded in turn. A guard that refuses the call names its
        stage, as ``ShardedModel.run_stages`` does: the stages after it did not run, so the call can be
        served by a plan captured again where they update no buffer (``specialize.rerun_of``)."""
        args, kwargs = self.sharded.fit_call(args, kwargs)
        index = 0
        try:
            values = self._run(0, moved_to(self.device, args), moved_to(self.device, kwargs))
            for index in range(1, self.sharded.num_stages):
                values = self._run(index, values, {})
        except SpecializationMismatch as exc:
            exc.stage = self.sharded.stages[index]
            raise
        return values

    def _run(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = _StageCall()
        if torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(
                self._call_stage, index, call, *args, use_reentrant=False, **kwargs)
        else:
            out = self._call_stage(index, call, *args, **kwargs)
        self._write_back(index, call)
        call.buffers = {}  # written back; the checkpoint keeps ``call`` until the backward
        return out

    def _call_stage(self, index: int, call: _StageCall, *args: Any, **kwargs: Any) -> Any:
        """Run stage ``index`` on fresh device copies of its tensors.

        Parameters are copied differentiably, so their gradients flow back to the model's own.
        Buffers are always copies. The first run takes the state the model's modules hold now; a
        recomputation in the backward replays the first run's starting state (buffers, numbers,
        flags) so it computes what the forward did, and leaves no state behind.
        """
        homes, shells = self._module_pairs(index)
        recompute = call.started is not None
        if recompute:
            now = _attributes(shells)
            _set_attributes(shells, _attributes_copied(call.started.attributes, self.device))
        else:
            self._start(index, call, homes, shells)
        tensors = self._device_copies(index, call.started.buffers if recompute else {})
        out = functional_call(self._shells[index], tensors, args, kwargs, tie_weights=False, strict=True)
        if recompute:
            _set_attributes(shells, now)
        else:
            # a buffer the stage rebound (``self.steps = self.steps + 1``) is in ``tensors`` now
            call.buffers = {name: tensors[name] for name in dict(self.sharded.stages[index].named_buffers(
                remove_duplicate=False))}
        return out

    def _start(self, index: int, call: _StageCall, homes: list[nn.Module], shells: list[nn.Module]) -> None:
        """The first run's shell takes the modes and plain attributes the model's modules have now
        (the shell was copied once: ``model.train()`` and state written since must reach it); in
        training the starting state is kept for the recomputation to replay."""
        for home, shell in zip(homes, shells):
            shell.training = home.training
        placed = _attributes_copied(_attributes(homes), self.device)
        _set_attributes(shells, placed)
        call.placed = [{k: (id(v), v._version) for k, v in state.items() if isinstance(v, torch.Tensor)}
                       for state in placed]
        if not torch.is_grad_enabled():
            call.started = _Started([], {})
            return
        buffers = self.sharded.stages[index].named_buffers(remove_duplicate=False)
        call.started = _Started(_attributes_copied(placed, self.device),
                                {name: home.detach().clone() for name, home in buffers})

    def _device_copies(self, index: int, buffers_at: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor of stage ``index`` on the device, once per distinct tensor; buffers from
        ``buffers_at`` where it has them (the state a recomputation replays)."""
        copies: dict[int, torch.Tensor] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, home in stage_tensors(self.sharded.stages[index]).items():
            if id(home) not in copies:
                if isinstance(home, torch.nn.Parameter):
                    copies[id(home)] = home.to(self.device)
                else:
                    copies[id(home)] = buffers_at.get(name, home).detach().to(self.device, copy=True)
            tensors[name] = copies[id(home)]
        return tensors

    def _module_pairs(self, index: int) -> tuple[list[nn.Module], list[nn.Module]]:
        """The model's modules in stage ``index`` and their copies in its shell, in the same order."""
        return _modules_in(self.sharded.stages[index]), _modules_in(self._shells[index])

    def _write_back(self, index: int, call: _StageCall) -> None:
        """The first run's state goes back to the model: the numbers, flags and tensors its modules
    keep on themselves (a tensor only when the stage rebound or wrote to it), and
        every buffer, copied in place (kernels such as batch_norm update running statistics without
        leaving a trace, not even the tensor's version counter) or rebound when the stage replaced it
        by one of another shape or type."""
        homes, shells = self._module_pairs(index)
        for home, state, placed in zip(homes, _attributes(shells), call.placed):
            changed = {k: v for k, v in state.items()  # a tensor the stage neither rebound nor wrote to stays
                       if not (isinstance(v, torch.Tensor) and placed.get(k) == (id(v), v._version))}
            _set_attributes([home], _attributes_copied([changed], _home_devices(home)))
        stage = self.sharded.stages[index]
        with torch.no_grad():
            for name, value in call.buffers.items():
                home = stage.get_buffer(name)
                if home.shape == value.shape and home.dtype == value.dtype:
                    home.copy_(value)
                else:
                    owner, _, attribute = name.rpartition(".")
                    setattr(stage.get_submodule(owner), attribute, value.detach().to(home.device))


@dataclass
class _Started:
    """What a stage run started from, in training (for its recomputation): its modules' plain
    attributes and its buffers."""

    attributes: list[dict[str, Any]]
    buffers: dict[str, torch.Tensor]


@dataclass
class _StageCall:
    """One call of a stage: the state it started from, and its buffers when it ended."""

    started: _Started | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    #: per module, (id, version) of each tensor attribute the first run started with
    placed: list[dict[str, tuple[int, int]]] = field(default_factory=list)


def _modules_in(module: nn.Module) -> list[nn.Module]:
    """The modules ``module.named_modules(remove_duplicate=False)`` yields, in its order, without
    making their names (walked three times a stage a step, for the model's modules and the shell's:
    2.6k instructions a module, not 5.7k). A module that overrides ``named_modules`` is asked for its own."""
    if type(module).named_modules is not _NAMED_MODULES:
        return [m for _, m in module.named_modules(remove_duplicate=False)]
    found = [module]
    for child in module._modules.values():
        if child is not None:
            found += _modules_in(child)
    return found


_NAMED_MODULES = nn.Module.named_modules

#: The values ``_attributes`` keeps, as one tuple: built once, not per attribute read.
_KEPT_ON_MODULES = (*PLAIN_VALUES, torch.Tensor)
#: The types most of a module's ``__dict__`` holds (``nn.Module``'s registries and hook dicts),
#: none of them kept: told apart by their exact type before the ``isinstance`` test, which costs
#: more for a value that is none of ``_KEPT_ON_MODULES`` (``torch.Tensor``'s metaclass is not ``type``).
_NEVER_KEPT = frozenset({dict, OrderedDict, set})


def _attributes(modules: list[nn.Module]) -> list[dict[str, Any]]:
    """The plain state each model module keeps on itself: numbers, flags, strings, None and
    tensors (``self.calls``, ``self.ready``, ``self.previous = y``); a stage's generated code keeps
    none (its source text differs in the shell, retargeted to the runner's device)."""
    return [{} if isinstance(m, fx.GraphModule) else
            {k: v for k, v in vars(m).items()
             if type(v) not in _NEVER_KEPT and k != "training" and isinstance(v, _KEPT_ON_MODULES)}
            for m in modules]


def _attributes_copied(states: list[dict[str, Any]],
                       device: torch.device | dict[str, torch.device]) -> list[dict[str, Any]]:
    """``states`` with their tensors copied (to ``device``, or per name where it is a dict): a
    forward may update one in place, and the copy it started from is replayed."""
    def copied(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        where = device.get(name, value.device) if isinstance(device, dict) else device
        return value.detach().to(where, copy=True)

    return [{name: copied(name, value) for name, value in state.items()} for state in states]


def _home_devices(module: nn.Module) -> dict[str, torch.device]:
    """Where ``module`` keeps its tensor attributes now: state written back goes there."""
    return {name: value.device for name, value in vars(module).items() if isinstance(value, torch.Tensor)}


def _set_attributes(modules: list[nn.Module], values: list[dict[str, Any]]) -> None:
    for module, state in zip(modules, values):
        vars(module).update(state)
