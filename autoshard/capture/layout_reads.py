"""Which inputs' strides, storage offsets and autograd nodes the model's code asked while torch.export
captured it.

torch.export (non-strict) runs the model's Python on fake tensors made from the example, which answer
``x.stride(-1)`` and ``x.storage_offset()`` as the example would, with no guard of their own; the
plan's input guard checks contiguity alone (``InputGuard.layouts``), so a column slice was served by
the plan made for a transposed input (both not contiguous, ``stride(-1)`` 1 against 4). The wrapper
the capture exports runs the model inside ``LayoutReads.watching``, a torch function mode that notes
those questions of the inputs; the guard then compares the strides and offsets asked
(``InputGuard.strides``, ``offsets``), and the binder whether an input asked ``x.grad_fn`` is a leaf
(``sharded.ExampleTensors``). torch's own code asks them too once the model's call is under way (a
kept-whole module's kernel does not: it runs in C++), so an input may be compared more often than
needed: another capture, never a wrong answer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import keystr, tree_flatten_with_path

#: What the mode notes, by the name of the function (a method of the tensor) or attribute (autograd's).
_ASKED = frozenset({"stride", "storage_offset", "grad_fn", "is_leaf"})
#: The questions whether an input is computed by autograd (``x.grad_fn is None``), which every plan's binder
#: compares where they were asked (``sharded.ExampleTensors``).
LEAFNESS = frozenset({"grad_fn", "is_leaf"})


class LayoutReads(TorchFunctionMode):
    """``read``: ``(input name, question)``, the question one of ``_ASKED``, for each the model's code asked
    of an input tensor (one in a container by its path, ``d['x']``) while ``watching`` it."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[tuple[str, str]] = set()
        self._names: dict[int, str] = {}

    @contextlib.contextmanager
    def watching(self, **inputs: Any) -> Iterator[None]:
        """Note the questions asked of ``inputs`` (the wrapper's arguments, by name) within."""
        self._names = {id(leaf): name + keystr(path) for name, value in inputs.items()
                       for path, leaf in tree_flatten_with_path(value)[0] if isinstance(leaf, torch.Tensor)}
        try:
            with self:
                yield
        finally:
            self._names = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute's getter (``Tensor.grad_fn.__get__``)
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if args and name in _ASKED and id(args[0]) in self._names:
            self.read.add((self._names[id(args[0])], name))
        return func(*args, **(kwargs or {}))
