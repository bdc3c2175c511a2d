"""The proxies of the meta tracer: fx proxies that carry their example value and answer from it.

Each node the tracer creates keeps the value it computed on the example (``EXAMPLE`` in its
meta) and whether that value was computed from sizes and constants alone (``DATA_FREE``). The
proxies answer from them what plain fx cannot: static tensor facts, unpacking and ``len`` of
sizes, ``math.ceil`` of a size. Where the code would turn a traced size into a Python number,
``MetaProxy`` refuses (``SizeToNumber``) and ``SizePinningProxy`` takes the example's number,
guarded by its tracer. Kept apart from the tracer (``meta``), which builds the graph.
"""

from __future__ import annotations

import bisect
import inspect
import math
import operator
import types
from typing import Any, Iterator

import torch
import torch.fx as fx

from autoshard.capture.layout_reads import LEAFNESS
from autoshard.capture.state import instructions

EXAMPLE = "autoshard_example"
DATA_FREE = "autoshard_data_free"
MISSING = object()

#: Tensor facts that do not change from one call to the next, answered from the example.
_STATIC_FACTS = frozenset({
    "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_quantized", "is_meta",
    "dim", "ndimension", "is_floating_point", "is_complex", "element_size", "is_nested",
})
_STATIC_FUNCTIONS = frozenset({torch.is_floating_point, torch.is_complex})
#: What numpy and other array libraries look up on an object (with every ``__array...`` name):
#: a proxy of a number offers none.
_FOREIGN_PROTOCOLS = frozenset({"__cuda_array_interface__", "__dlpack__"})


def example_of(proxy: fx.Proxy) -> Any:
    return proxy.node.meta.get(EXAMPLE, MISSING)


class MetaProxy(fx.Proxy):
    """A proxy that answers static tensor facts and iterates over sizes from its example."""

    @classmethod
    def __torch_function__(cls, orig_method: Any, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if orig_method in _STATIC_FUNCTIONS and args and isinstance(args[0], fx.Proxy):
            example = example_of(args[0])
            if isinstance(example, torch.Tensor):
                args[0].tracer.read_static_facts = True
                return orig_method(example)
        return super().__torch_function__(orig_method, types, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        example = example_of(self)
        if (name.startswith("__array") or name in _FOREIGN_PROTOCOLS) and isinstance(example, (int, float, torch.Size)):
            # a size: numpy then holds it as an object (``np.array(x.shape[2:]) % 32``), and its
            # arithmetic traces; a tensor still fails to convert, as its values are not known
            raise AttributeError(name)
        if isinstance(example, torch.Tensor) and name in _STATIC_FACTS:
            self.tracer.read_static_facts = True
            return getattr(example, name)
        if name in LEAFNESS and self.node.op == "placeholder":  # answered by the proxy: computed (not None)
            self.tracer.leafness_asked.add(str(self.node.target))
        return MetaAttribute(self, name)

    def __index__(self) -> int:
        if is_size(self):
            raise SizeToNumber("the code turns a traced size into a Python number (int(), range()), which "
                               "would fix it; tracing with pin_sizes takes the example's number, guarded")
        raise TypeError(f"'{type(self).__name__}' object cannot be interpreted as an integer")

    # math.ceil(n / w) and friends look these up on the type, so fx's __getattr__ never sees them
    def __ceil__(self) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", math.ceil, (self,), {})

    def __floor__(self) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", math.floor, (self,), {})

    def __trunc__(self) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", math.trunc, (self,), {})

    def __round__(self, ndigits: int | None = None) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", round, (self, ndigits), {})

    def __len__(self) -> int:
        example = example_of(self)
        if isinstance(example, torch.Size):  # a number of dimensions, as ``dim()``
            self.tracer.read_static_facts = True
            return len(example)
        if isinstance(example, (int, float)):  # as for the number: numpy then takes it for a scalar
            raise TypeError(f"object of type '{type(example).__name__}' has no len()")
        if isinstance(example, torch.Tensor) and example.dim() > 0:
            raise SizeToNumber("len() of a traced tensor is its first size as a Python number, which would fix "
                               "it; tracing with pin_sizes takes the example's number, guarded")
        return super().__len__()

    def __setitem__(self, key: Any, value: Any) -> None:
        """``x[mask] = v`` as an ``operator.setitem`` node: an in-place write, which build-dag
        orders against the tensor's other readers."""
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __iter__(self) -> Iterator[fx.Proxy]:
        # fx's own rule (``a, b = proxy`` unpacks as many as the code asks for), with the
        # disassembly cached: fx disassembles the whole caller on every unpacking.
        caller = inspect.currentframe().f_back  # type: ignore[union-attr]
        count = _unpack_count(caller.f_code, caller.f_lasti)  # type: ignore[union-attr]
        if count is not None:
            return (self[i] for i in range(count))
        return self.tracer.iter(self)


def is_size(proxy: fx.Proxy) -> bool:
    """Whether ``proxy`` is an integer computed from sizes and constants alone."""
    return type(example_of(proxy)) is int and proxy.node.meta.get(DATA_FREE, False)


class SizeToNumber(TypeError):
    """Model code turned a traced size into a Python number (``int(n)``, ``range(n)``); a trace
    with ``pin_sizes`` takes the example's number instead."""


class SizePinningProxy(MetaProxy):
    """A proxy that, where the code turns a size into a Python number, takes the example's number
    and guards it: the graph then serves that size only."""

    def __index__(self) -> int:
        return self.tracer.pinned(self)  # type: ignore[attr-defined]

    __int__ = __index__

    def __len__(self) -> int:
        example = example_of(self)
        if isinstance(example, torch.Tensor) and example.dim() > 0:
            return self.tracer.pinned(self.size(0))  # type: ignore[attr-defined]
        return super().__len__()


def _unpack_count(code: types.CodeType, last: int) -> int | None:
    """How many values the instruction running at offset ``last`` unpacks, if it unpacks."""
    found = instructions(code)
    index = bisect.bisect_left(found, last, key=lambda ins: ins.offset)
    if index < len(found) and found[index].opname == "UNPACK_SEQUENCE":
        return int(found[index].argval)
    return None


class MetaAttribute(fx.proxy.Attribute, MetaProxy):
    """``proxy.attr``: created lazily like fx's Attribute, with MetaProxy's answers."""
