"""Probing each distinct node once: the key of what decides a node's training facts, and the
facts themselves as an effect the probe can apply again.

A model repeats itself (twelve identical blocks of GPT-2 make the same 80 nodes twelve times), and
probing a node on fake tensors costs milliseconds, most of it ``MemTracker`` following a backward.
What a node saves, the bytes it allocates and the peak of its backward depend only on what it runs
(its function, method or module, with every setting the module holds) and on the layout of what it
receives (shapes, strides, dtypes, which arguments share a storage, which want gradients). ``key``
builds that as a hashable value; two nodes with the same key probe alike, so the probe runs the
first and applies its ``NodeEffect`` to the others. Anything the key cannot describe by value
(a container it does not know, an output that is not a tensor or a constant) makes the node
``Uncacheable``: it is probed on its own, as before, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

CONSTANTS = (int, float, bool, str, bytes, complex, type(None), type(Ellipsis),
             torch.dtype, torch.device, torch.layout, torch.memory_format)


class Uncacheable(Exception):
    """The node cannot be keyed or replayed by value: probe it on its own."""


def tensor_key(t: torch.Tensor, storages: dict[Any, int], storage_of: Any) -> tuple:
    """A tensor's layout, and which of the storages met so far (by ``storage_of(t)``) it lives in."""
    if t.layout != torch.strided:
        raise Uncacheable("a tensor that is not strided")
    group = storages.setdefault(storage_of(t), len(storages))
    return (group, type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            t.is_conj(), t.is_neg(), t.untyped_storage().nbytes())


def constant_key(value: Any, depth: int = 0) -> Hashable:
    """``value`` as a hashable key: constants by value, containers by their items, other objects
    by identity (the module graph keeps them alive while the probe runs, so an id is not reused)."""
    if isinstance(value, CONSTANTS):
        return (type(value), value)
    if isinstance(value, torch.Tensor):  # a module's unregistered tensor: what saves it charges it once, in
        raise Uncacheable("a tensor held outside the module's registries")  # the node that saves it first
    if depth > 4:
        return ("id", id(value))
    if isinstance(value, slice):
        return ("slice", *(constant_key(part, depth + 1) for part in (value.start, value.stop, value.step)))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(constant_key(item, depth + 1) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((constant_key(k, depth + 1), constant_key(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), tuple(sorted((constant_key(item, depth + 1) for item in value), key=repr)))
    return ("id", id(value))


def module_key(module: nn.Module) -> Hashable:
    """Everything of ``module`` and its submodules a call can read: classes, modes, every attribute
    (hooks by identity, so a module with hooks is probed on its own), and each parameter's and
    buffer's layout (strides too: a channels-last weight makes a channels-last output) with the
    pattern of tied ones. ``Uncacheable`` when it holds a tensor outside its registries."""
    tied: dict[int, int] = {}

    def layout(t: torch.Tensor | None) -> tuple | None:
        return None if t is None else (tied.setdefault(id(t), len(tied)), type(t), tuple(t.shape), t.stride(),
                                       t.storage_offset(), t.dtype, t.device, t.requires_grad)

    def weights(registry: dict[str, torch.Tensor | None]) -> tuple:
        return tuple((name, layout(t)) for name, t in registry.items())

    parts = []
    for path, sub in module.named_modules(remove_duplicate=False):
        state = []
        for name, value in sorted(vars(sub).items()):
            if name in ("_parameters", "_buffers"):
                state.append((name, weights(value)))
            elif name == "_modules":
                state.append((name, tuple(value.keys())))  # the submodules themselves come in their own parts
            else:
                state.append((name, constant_key(value)))
        parts.append((path, type(sub), tuple(state)))
    return tuple(parts)


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of a node's output: its layout, and where its storage came from — an argument's
    (``argument``: the flat index of the argument tensor) or a new one (``new``: its index among
    the new storages); ``base``: the layout (shape, strides, offset) of the tensor it is an autograd
    view of (a Linear on a 3-D input returns a view of its ``addmm``), None where it is none."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    argument: int | None
    new: int | None
    base: tuple[tuple[int, ...], tuple[int, ...], int] | None = None


@dataclass(frozen=True)
class NodeEffect:
    """What probing a node found, relative to its arguments, so it applies to another node of the same key.

    ``saved_arguments``: flat indices of the argument tensors whose storages autograd saved;
    ``saved_new``: for each new storage saved, its bytes and its index among the output's new
    storages (None: a temporary of the node's own); ``new_storages``: bytes and dtype of each
    new storage the output lives in; ``spec`` and ``leaves``: the output's structure, with an
    ``OutputTensor`` for each tensor and each constant as it is; ``input_grads``: for each argument
    tensor its backward gives a gradient, its index, whether that gradient is the output's own and
    the gradient's strides (None: its backward did not run); ``forward``: the most its forward
    held at once above what was alive before it (its output and what it saves included);
    ``weight_grads``: the positions, among the weights the node may read (``TrainingProbe.weight_leaves``),
    of those its backward gives a gradient (None: its backward did not run); ``weights_first``: its
    backward adds every weight's gradient into theirs before it hands any input its own;
    ``gradients_kept``: what its backward's peak adds where it keeps the weights' gradients it makes;
    ``gradient_copies``: the bytes of those not laid out as their weights are, which ``AccumulateGrad``
    copies into that layout to keep them; ``written``: the argument tensors it wrote into in place (their
    readers after it read what it wrote, so its backward starts from their gradient); ``backward_alone``:
    ``backward`` where autograd frees the gradient it starts from once its first function has run (None:
    the same); ``held_to_the_end``: the bytes among ``saved_new`` a custom ``autograd.Function`` keeps on
    its ``ctx`` (``ctx.mask = m``), which autograd frees with the graph, after the whole backward, not once
    the node's own backward has run."""

    saved_arguments: tuple[int, ...]
    saved_new: tuple[tuple[int, int | None], ...]
    new_storages: tuple[tuple[int, torch.dtype], ...]
    spec: TreeSpec
    leaves: tuple[Any, ...]
    grad: int
    backward: int
    input_grads: tuple[tuple[int, bool, tuple[int, ...]], ...] | None
    forward: int = 0
    weight_grads: tuple[int, ...] | None = ()
    weights_first: bool = False
    gradients_kept: int = 0
    gradient_copies: int = 0
    written: tuple[int, ...] = ()
    backward_alone: int | None = None
    held_to_the_end: int = 0
