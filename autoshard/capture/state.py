"""Writes a forward makes to its module's state, which a captured graph cannot replay.

A graph records operations on values; it records no attribute assignment. A forward that rebinds
a buffer to a computed value (``self.steps += 1`` under fx) or keeps a tensor for its next call
(``self.previous = y``) would, captured, compute with the old value forever: a silently wrong
sharded model. While a front end traces, ``refusing_state_writes`` makes such an assignment
raise ``StateWrite``, so the module that makes it is kept whole (run as it is, state included),
like any other code the front end cannot capture.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

from torch import nn

from autoshard.capture.eager import swapped_attribute
from autoshard.capture.leaves import MACHINERY_DIRS

#: ``computed(module, name, value)``: whether assigning ``value`` stores something the trace computed.
Computed = Callable[[nn.Module, str, Any], bool]


class StateWrite(RuntimeError):
    """Model code stored a value it computed in a parameter, buffer or attribute of its module.
    Not a ``TraceError``: the code is kept whole like any other untraceable code."""


def kind_of(module: nn.Module, name: str) -> str:
    for kind in ("parameter", "buffer"):
        if name in module.__dict__.get(f"_{kind}s", {}):
            return kind
    return "attribute"


def current_value(module: nn.Module, name: str) -> Any:
    """What ``module.name`` holds now, without running ``__getattr__`` hooks (None if unset)."""
    kind = kind_of(module, name)
    return module.__dict__.get(name) if kind == "attribute" else module.__dict__[f"_{kind}s"][name]


@contextlib.contextmanager
def refusing_state_writes(computed: Computed) -> Iterator[None]:
    """``nn.Module.__setattr__`` raises ``StateWrite`` where ``computed`` says so, until exit."""
    original = nn.Module.__setattr__

    def guarded(module: nn.Module, name: str, value: Any) -> None:
        # torch's own writes (export lifting a constant onto the module) are not the model's state
        if computed(module, name, value) and \
                not sys._getframe(1).f_code.co_filename.startswith(MACHINERY_DIRS):
            raise StateWrite(f"the forward stores a value it computed in its {kind_of(module, name)} "
                             f"{name!r}, which a later call may read; a captured graph cannot replay that write")
        original(module, name, value)

    with swapped_attribute(nn.Module, "__setattr__", guarded):
        yield
