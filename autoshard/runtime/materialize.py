"""Give one stage of a plan made on the ``meta`` device its real weights, and no other stage.

A model built under ``torch.device("meta")`` costs no memory and can still be traced and split.
Each rank then loads only the tensors of its own stages from the model's checkpoint (or a
per-stage one). The checkpoint is memory-mapped and its tensors are used in place on the CPU, so
a rank's resident memory grows by its stage's size, not the model's.
"""

from __future__ import annotations

from typing import Sequence

import torch

from autoshard.arguments import whole_number
from autoshard.errors import InvalidArgumentError
from autoshard.runtime.checkpoint import Checkpoint, checked_entry, open_checkpoint
from autoshard.runtime.devices import DeviceLike, resolve_device
from autoshard.runtime.rebuild import like, replaced_stages, stage_tensors
from autoshard.sharded import ShardedModel


def materialize_stage(
    sharded: ShardedModel,
    stage_index: int | Sequence[int],
    checkpoint: Checkpoint,
    device: DeviceLike = "cpu",
) -> ShardedModel:
    """A copy of ``sharded`` whose stage(s) ``stage_index`` hold real tensors from ``checkpoint``.

    Other stages keep their tensors (meta placeholders cost nothing); a tensor a materialised stage
    shares with another stage becomes real in both, so shared parameters stay shared. Neither
    ``sharded`` nor the model it was made from is modified, nor a state dict given as ``checkpoint``:
    its tensors are copied (a file's, memory-mapped, are the copy's own). Run the stages materialised
    (``copy.stages[i]``, ``pipeline_stage(copy, i)``): the copy called whole, with a stage still on
    meta, is refused (``PlanError``).
    """
    indices = stage_index if isinstance(stage_index, Sequence) and not isinstance(stage_index, str) else [stage_index]
    wanted = [whole_number(index, "stage_index", at_least=0) for index in indices]
    for index in wanted:
        if index >= sharded.num_stages:
            raise InvalidArgumentError(
                f"stage {index} is outside the plan's stages 0..{sharded.num_stages - 1}")
    resolved = resolve_device(device, "the materialised stage")
    state = open_checkpoint(checkpoint)
    given = state is checkpoint  # a state dict: training the copy must not train the model it came from
    tied = _tied_names(sharded)
    loaded: dict[int, torch.Tensor] = {}
    for index in wanted:
        for name, tensor in stage_tensors(sharded.stages[index]).items():
            if id(tensor) not in loaded:
                aliases = tied.get(name, ())
                if tensor.numel() == 0 and not any(n in state for n in (name, *aliases)):
                    value = torch.empty_like(tensor, device="cpu")  # no data to load (T5's fresh cache)
                else:
                    value = checked_entry(state, name, tensor, f"stage {index}", aliases)
                loaded[id(tensor)] = like(tensor, value.to(resolved, dtype=tensor.dtype, copy=given))
    return replaced_stages(sharded, lambda name, tensor: loaded.get(id(tensor), tensor))


def _tied_names(sharded: ShardedModel) -> dict[str, tuple[str, ...]]:
    """Every name of a tied weight -> its other names in the model (a checkpoint saved by Hugging
    Face holds a tied weight under one of them only, which may belong to no stage)."""
    infos = sharded.plan.dag.graph.get("weights", {})
    return {name: tuple(n for n in info.names if n != name) for info in infos.values() for name in info.names}
