"""How a tensor lies in its storage, as far as a stage and autograd care: whether a stage sends a
value as it is, as a contiguous copy (``sent_as_copy``) or permuted (``dense_order``), whether a
gradient goes back uncopied (``grad_contiguous``, ``contiguous_in_its_order``), and whether
``AccumulateGrad`` keeps a weight's first gradient as it is (``obeys_layout_contract``). Strides are
asked of torch on meta tensors, not re-derived (its rules for size-1 and overlapping dimensions are
subtle)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


def new_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides ``torch.empty_like`` gives a new tensor laid out as ``t``."""
    return _empty_like_strides(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=4096)
def _empty_like_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """Asked of torch, not re-derived (its rules for size-1 and overlapping dimensions are subtle);
    cached, as every node of a model asks it of a few layouts (a meta tensor costs ~0.1 ms)."""
    with _disable_current_modes():
        return torch.empty_like(torch.empty_strided(shape, strides, device="meta")).stride()


def grad_contiguous(t: torch.Tensor, strides: tuple[int, ...] | None) -> bool:
    """Whether a gradient of ``t``'s shape with ``strides`` (None: not strided) is contiguous, as the
    gradient a stage sends back must be (``runtime.wire.contiguous_grad`` copies any other)."""
    return strides is None or _is_contiguous(tuple(t.shape), tuple(strides))


@functools.lru_cache(maxsize=4096)
def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    with _disable_current_modes():
        return torch.empty_strided(shape, strides, device="meta").is_contiguous()


def contiguous_in_its_order(t: torch.Tensor, strides: tuple[int, ...] | None) -> bool:
    """``grad_contiguous``, where ``t`` fills its storage in another order (a transpose) in that order: the
    wire receives such a value as that order's contiguous buffer (``dense_order``), so a gradient laid out
    as ``t`` goes back uncopied, and a plainly contiguous one is copied."""
    if dense_order(t) is None:
        return grad_contiguous(t, strides)
    return strides is None or tuple(strides) == new_strides(t)


def sent_as_copy(value: Any) -> bool:
    """Whether ``value`` is one tensor with gaps or overlaps in its storage (a slice, an expanded
    tensor), which a stage sends as a contiguous copy (``runtime.wire``)."""
    if isinstance(value, (tuple, list)) and value:  # ``chunk``'s, ``split``'s, ``unbind``'s views: each copied
        return all(sent_as_copy(item) for item in value)
    return (isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_contiguous()
            and not fills_storage(value))


def fills_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its storage without gaps or overlaps, in some order of its dimensions (as
    ``torch.empty_like`` lays out a new tensor; a dimension of size 1 may have any stride)."""
    return all(a == b for a, b, n in zip(new_strides(t), t.stride(), t.shape) if n != 1)


def dense_order(value: Any) -> tuple[int, ...] | None:
    """For one tensor that fills its storage in another order than contiguous (a transpose, a
    channels-last map), the order of its dimensions in storage, outermost first: the wire sends
    ``value.permute(order)``, contiguous, without a copy. None for any other value."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_contiguous() \
            or not fills_storage(value):
        return None
    return tuple(sorted(range(value.dim()), key=lambda d: (-value.stride(d), -value.shape[d], d)))


def order_undone(order: tuple[int, ...]) -> list[int]:
    """The permutation that undoes ``order``: ``t.permute(order).permute(order_undone(order))`` is ``t``
    (a value that crossed permuted, ``dense_order``, as the receiving stage reads it)."""
    return sorted(range(len(order)), key=order.__getitem__)


def obeys_layout_contract(grad: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``AccumulateGrad`` keeps ``grad`` as ``weight``'s first gradient as it is (torch's
    ``obeys_layout_contract``): laid out as a dense weight is, strides of dimensions of size 1 aside;
    else it keeps a copy in that layout (a convolution's weight gradient from a channels-last input)."""
    if grad.layout != torch.strided or weight.layout != torch.strided:
        return True  # (sparse: another path, not probed)
    if fills_storage(weight):
        return all(g == w if size != 1 else g != 0
                   for size, g, w in zip(grad.shape, grad.stride(), weight.stride()))
    return grad.is_contiguous()
