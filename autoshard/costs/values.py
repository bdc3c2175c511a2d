"""What a value of the traced graph looks like: tensors (shape, dtype, bytes) nested in
tuples, lists and dicts, or a plain Python constant.

Only the structure is kept, never the data, so it is the same for real, fake and meta tensors
and can be stored on the DAG, printed in a plan and written to JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's shape, dtype and size in bytes."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def has_tensor(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "tensor", "shape": list(self.shape), "dtype": self.dtype, "bytes": self.nbytes}


@dataclass(frozen=True)
class StructureMeta:
    """A tuple, list or dict of values; ``keys`` are indices for tuples and lists."""

    kind: Literal["tuple", "list", "dict"]
    keys: tuple[Any, ...]
    items: tuple["ValueMeta", ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def has_tensor(self) -> bool:
        return any(item.has_tensor for item in self.items)

    def __str__(self) -> str:
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(self.keys, self.items)) + "}"
        inner = ", ".join(map(str, self.items))
        return f"({inner},)" if self.kind == "tuple" and len(self.items) == 1 else (
            f"({inner})" if self.kind == "tuple" else f"[{inner}]")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "keys": [str(k) for k in self.keys], "items": [i.to_dict() for i in self.items]}


@dataclass(frozen=True)
class ConstantMeta:
    """A non-tensor value (int, bool, None, str, dtype, device, torch.Size, ...): type and text."""

    type_name: str
    text: str

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def has_tensor(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "constant", "type": self.type_name, "value": self.text}


ValueMeta = Union[TensorMeta, StructureMeta, ConstantMeta]

_MAX_TEXT = 80


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


def describe_value(value: Any) -> ValueMeta:
    """The structure of ``value``; works for real, fake and meta tensors alike (no data is read)."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(d) for d in value.shape), dtype_name(value.dtype),
                          value.numel() * value.element_size())
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return StructureMeta(kind, tuple(range(len(value))), tuple(describe_value(v) for v in value))
    if isinstance(value, dict):
        return StructureMeta("dict", tuple(value), tuple(describe_value(v) for v in value.values()))
    text = repr(value)
    if len(text) > _MAX_TEXT:
        text = text[: _MAX_TEXT - 3] + "..."
    return ConstantMeta(type(value).__name__, text)


def dense_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors holding ``tensor``'s data: itself, or a sparse tensor's indices and values."""
    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return [tensor]


#: Tensor types no pytree flattens further: one is its own only leaf.
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter, FakeTensor)


def flat_leaves(value: Any) -> list[Any]:
    """``tree_flatten(value)[0]``, a lone tensor answered without the walk (most values are one)."""
    return [value] if type(value) in _TENSOR_TYPES else tree_flatten(value)[0]


def _storages(value: Any) -> dict[StorageWeakRef, int]:
    flat = flat_leaves(value)
    parts = [part for t in flat if isinstance(t, torch.Tensor) for part in dense_parts(t)]
    return {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in parts}


def shares_memory(value: Any, other: Any) -> bool:
    """Whether a tensor of ``value`` and one of ``other`` share storage (a view, a value passed
    through). Works for fake and meta tensors."""
    return not _storages(value).keys().isdisjoint(_storages(other))


def allocated_bytes(output: Any, inputs: Any) -> int:
    """Bytes of the storages ``output`` holds that ``inputs`` do not: what computing it allocated.

    A view, a reshape or a value passed through shares its input's memory and allocates nothing;
    several outputs viewing one new storage count it once. Works for fake and meta tensors.
    """
    known = _storages(inputs)
    return sum(nbytes for ref, nbytes in _storages(output).items() if ref not in known)
