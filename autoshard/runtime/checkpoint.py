"""Checkpoints under the original model's names, per stage or whole.

A stage's ``state_dict()`` keys are the model's own keys (stages hold the model's modules under
their qualified names), so stage checkpoints need no renaming: merging every stage's state gives
the model's checkpoint, and a stage loads its part of the model's checkpoint by picking its keys.
A file is opened memory-mapped, so reading one stage's part never pages in the rest.

Under ``parallelize`` a stage's weights may be sharded over data-parallel ranks: those stages save
and load with ``torch.distributed.checkpoint`` (``save_distributed``, ``load_distributed``), under
the same names, so a checkpoint moves between layouts and back to the unsplit model.
"""

from __future__ import annotations

import os
import pickle
from typing import Mapping, Sequence, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from autoshard.errors import CheckpointMismatchError, InvalidArgumentTypeError, shown

Checkpoint = Union[Mapping[str, torch.Tensor], str, "os.PathLike[str]"]


def open_checkpoint(checkpoint: Checkpoint) -> Mapping[str, torch.Tensor]:
    """A state dict: ``checkpoint`` itself, or the file loaded memory-mapped on the CPU."""
    if isinstance(checkpoint, Mapping):
        return checkpoint
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"a checkpoint is a state dict or the path of a file torch.save wrote, got {type(checkpoint).__name__}")
    try:
        state = torch.load(os.fspath(checkpoint), map_location="cpu", mmap=True, weights_only=True)
    except OSError as exc:
        raise CheckpointMismatchError(
            f"cannot read the checkpoint {os.fspath(checkpoint)!r}: {exc.strerror or exc}") from exc
    except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:  # not a file torch.save wrote, or cut short
        raise CheckpointMismatchError(
            f"cannot read the checkpoint {os.fspath(checkpoint)!r} ({str(exc).splitlines()[0]}): pass the path of a "
            "state dict torch.save wrote (its default zip format, read memory-mapped), whole") from exc
    if not isinstance(state, Mapping):
        raise CheckpointMismatchError(f"the checkpoint {os.fspath(checkpoint)!r} holds a {type(state).__name__}, not "
                                      "a state dict; save model.state_dict()")
    return state


def checked_entry(state: Mapping[str, torch.Tensor], name: str, expected: torch.Tensor,
                  where: str, aliases: Sequence[str] = ()) -> torch.Tensor:
    """``state[name]``, or the entry of the first of ``aliases`` (other names of the same tied
    tensor) that ``state`` holds; refusing a missing entry, or one whose shape or kind of dtype (``_kind``)
    differs from ``expected``'s."""
    found = next((n for n in (name, *aliases) if n in state), None)
    if found is None:
        also = f" (nor its tied names {', '.join(repr(a) for a in aliases)})" if aliases else ""
        raise CheckpointMismatchError(
            f"{where} needs '{name}'{also}, which the checkpoint does not hold; pass the original model's "
            "state_dict or this stage's own (a non-persistent buffer is never saved: build it on a "
            "real device rather than on meta)")
    name, value = found, state[found]
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise CheckpointMismatchError(
            f"the checkpoint's '{name}' is on the meta device and holds no values; pass the state_dict of "
            "a model with real weights, or the file it was saved to")
    if tuple(value.shape) != tuple(expected.shape):
        raise CheckpointMismatchError(
            f"{where} needs '{name}' of shape {tuple(expected.shape)}, the checkpoint holds "
            f"{tuple(value.shape)}; the checkpoint is of another model or configuration")
    if _kind(value.dtype) != _kind(expected.dtype):
        raise CheckpointMismatchError(
            f"{where} needs '{name}' as {_kind(expected.dtype)} ({expected.dtype}), the checkpoint holds "
            f"{value.dtype}; the checkpoint is of another model or configuration")
    return value


def _kind(dtype: torch.dtype) -> str:
    """What a tensor of ``dtype`` holds. Floats of another width are copied into the stage's dtype
    (as ``load_state_dict`` copies them: a bf16 checkpoint into the float32 stages a plan was made
    for); integers for floats, or the reverse, are another model's values."""
    if dtype.is_complex:
        return "complex numbers"
    return "floats" if dtype.is_floating_point else "booleans" if dtype == torch.bool else "integers"


def stage_part(stage: nn.Module, checkpoint: Checkpoint, where: str = "the stage") -> dict[str, torch.Tensor]:
    """The entries of ``checkpoint`` that ``stage`` holds, by the same names."""
    state = open_checkpoint(checkpoint)
    return {name: checked_entry(state, name, tensor, where) for name, tensor in stage.state_dict().items()}


def load_stage_state(stage: nn.Module, checkpoint: Checkpoint) -> None:
    """Load ``stage``'s part of a model (or stage) checkpoint into its tensors, in place."""
    stage.load_state_dict(stage_part(stage, checkpoint))


def merge_stage_states(states: Sequence[Mapping[str, torch.Tensor]],
                       base: Checkpoint | None = None) -> dict[str, torch.Tensor]:
    """One model checkpoint from every stage's ``state_dict()``, stage 0 first.

    A key two stages hold (a parameter both read) must hold equal values in both; different values
    mean the copies drifted apart (tied gradients not synchronised), which a merge cannot repair.

    A key of the model's that no stage holds (a weight only a branch the capture did not take reads,
    a buffer no forward reads, a second name of a tied weight, BERT's ``cls.predictions.bias``) is in
    no stage's state, and the process merging may hold no model to take it from: without ``base`` the
    merge holds the stages' keys only, in stage order. ``base``, the checkpoint the stages were loaded
    from (the model's ``state_dict()``, or its file), completes it: the merge is then keyed and ordered
    as ``base``, each entry from the stages where one holds it (a second name of a tensor ``base``
    holds under several, from the stages' entry of another: the trained value, not the stale one),
    the rest from ``base`` (nothing trains them), and a stage key ``base`` lacks is kept after them.
    """
    if isinstance(states, Mapping) or not isinstance(states, Sequence) or not all(
            isinstance(state, Mapping) for state in states):
        raise InvalidArgumentTypeError(f"merge_stage_states takes a list of every stage's state_dict(), stage 0 "
                                       f"first, got {shown(states)}")
    merged = _merged(states)
    return merged if base is None else _keyed_as(open_checkpoint(base), merged)


def _merged(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every stage's entries, a key several hold once (refused where their values differ)."""
    merged: dict[str, torch.Tensor] = {}
    first_holder: dict[str, int] = {}
    for index, state in enumerate(states):
        for name, value in state.items():
            if name in merged and not torch.equal(merged[name].cpu(), value.cpu()):
                raise CheckpointMismatchError(
                    f"stages {first_holder[name]} and {index} hold different values for '{name}'; "
                    "synchronise shared parameters' gradients (TiedGradients.sync) before each "
                    "optimizer step")
            merged.setdefault(name, value)
            first_holder.setdefault(name, index)
    return merged


def _keyed_as(base: Mapping[str, torch.Tensor], merged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``merged`` keyed and ordered as ``base``: the stages' entry of each key, or of another name of the
    same tensor in ``base``, else ``base``'s own; the stages' keys ``base`` lacks after them."""
    tied = _names_of_one_tensor(base)
    result: dict[str, torch.Tensor] = {}
    for name, value in base.items():
        source = next((n for n in (name, *tied.get(name, ())) if n in merged), None)
        result[name] = merged[source] if source is not None else value
    result.update((name, value) for name, value in merged.items() if name not in result)
    return result


def _names_of_one_tensor(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """Each name of ``state`` -> its other names holding the very same tensor (a tied weight: the model's
    ``state_dict()``, and a file ``torch.save`` wrote, keep one tensor under each of its names)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and not value.is_meta and value.numel():
            where = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.stride())
            groups.setdefault((*where, tuple(value.shape), value.dtype), []).append(name)
    return {name: tuple(other for other in group if other != name) for group in groups.values() for name in group}


Stages = Sequence[Union[PipelineStage, nn.Module]]


def _modules(stages: Stages) -> list[nn.Module]:
    return [stage.submod if isinstance(stage, PipelineStage) else stage for stage in stages]


def _local_state(stages: Stages) -> dict[str, torch.Tensor]:
    """The state of this rank's stage modules under the model's names (a key two of them hold,
    a weight shared by two stages, is the same weight after ``TiedGradients.sync``: kept once)."""
    state: dict[str, torch.Tensor] = {}
    for stage in _modules(stages):
        for name, value in stage.state_dict().items():
            state.setdefault(name, value)
    return state


def save_distributed(stages: Stages, path: Union[str, "os.PathLike[str]"]) -> None:
    """Save the state of this rank's stages (``parallel.stages``, or their modules) with
    ``torch.distributed.checkpoint``, every rank at once (a collective over the default group).

    The keys are the model's own and sharded weights are saved as their shards, so the checkpoint
    loads into any other layout (``load_distributed``), or into the unsplit model after
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.
    """
    dcp.save(_local_state(stages), checkpoint_id=os.fspath(path))


def load_distributed(stages: Stages, path: Union[str, "os.PathLike[str]"]) -> None:
    """Load a checkpoint ``save_distributed`` wrote, in whatever layout, into this rank's stage
    modules in place (each takes its own keys and, when sharded, its own shards). A collective."""
    state = _local_state(stages)
    try:
        dcp.load(state, checkpoint_id=os.fspath(path))
    except dcp.CheckpointException as exc:
        raise CheckpointMismatchError(
            f"cannot load the distributed checkpoint {os.fspath(path)!r} into this rank's stages: {exc}; save it "
            "from the same model (save_distributed) with the same configuration") from exc
    for stage in _modules(stages):
        stage.load_state_dict({name: state[name] for name in stage.state_dict()})
