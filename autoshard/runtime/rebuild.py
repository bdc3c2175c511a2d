"""Copy stage modules with their tensors replaced, never touching the user's modules.

A stage holds the model's own submodules and tensors. The runtime needs stages whose tensors
live elsewhere: on a device, loaded from a checkpoint, private to one stage, or only meta
placeholders. A deep copy whose memo maps every tensor to its replacement gives exactly that: a
fresh module tree, no tensor data copied beyond the replacements, and two names that shared one
tensor still share one.
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Callable, TypeVar

import torch
from torch import nn

from autoshard.sharded import ShardedModel

M = TypeVar("M", bound=nn.Module)
Replace = Callable[[str, torch.Tensor], torch.Tensor]


def stage_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by qualified name, each tied name listed."""
    return dict(chain(module.named_parameters(remove_duplicate=False),
                      module.named_buffers(remove_duplicate=False)))


def like(original: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as what ``original`` is: a Parameter with its ``requires_grad``, or a plain buffer."""
    if isinstance(original, nn.Parameter):
        return nn.Parameter(data, requires_grad=original.requires_grad)
    return data


def _memo(modules: list[nn.Module], replace: Replace) -> dict[int, object]:
    memo: dict[int, object] = {}
    for module in modules:
        for name, tensor in stage_tensors(module).items():
            if id(tensor) not in memo:
                memo[id(tensor)] = replace(name, tensor)
    return memo


def _keep_buffer_persistence(original: nn.Module, copied: nn.Module) -> None:
    """A GraphModule rebuilt by deepcopy registers every buffer as persistent; mark the ones the
    original keeps out of its ``state_dict`` again, so the copy's keys are the original's."""
    copies = dict(copied.named_modules(remove_duplicate=False))
    for name, module in original.named_modules(remove_duplicate=False):
        if module._non_persistent_buffers_set and name in copies:
            target = copies[name]
            target._non_persistent_buffers_set = module._non_persistent_buffers_set & set(target._buffers)


def replaced(module: M, replace: Replace) -> M:
    """A copy of ``module`` whose tensors are ``replace(name, tensor)``, once per distinct tensor."""
    copied = copy.deepcopy(module, _memo([module], replace))
    _keep_buffer_persistence(module, copied)
    return copied


def replaced_stages(sharded: ShardedModel, replace: Replace) -> ShardedModel:
    """A copy of every stage with one memo, so a tensor shared by two stages stays shared.

    The plan is shared, not copied: it describes the same split.
    """
    memo = _memo(list(sharded.stages), replace)
    memo[id(sharded.plan)] = sharded.plan
    copied = copy.deepcopy(sharded, memo)
    _keep_buffer_persistence(sharded, copied)
    return copied


def shared_across_stages(sharded: ShardedModel) -> dict[int, list[tuple[int, str]]]:
    """Tensors that more than one stage holds, by identity: ``id -> [(stage, name), ...]``."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for index, stage in enumerate(sharded.stages):
        for name, tensor in stage_tensors(stage).items():
            holders.setdefault(id(tensor), []).append((index, name))
    return {key: found for key, found in holders.items() if len({s for s, _ in found}) > 1}
