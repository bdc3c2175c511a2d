"""Model code that asks for the grad mode while a front end traces it.

``nn.TransformerEncoder`` (and any code like it) takes a fused fast path when grad is off, with
other values at padded positions. A front end traces one path; the plan must not serve the
other mode as if it were the same. ``GradModeReader`` stands in for ``torch.is_grad_enabled``:
it answers the grad mode ``shard_model`` was called in and reports where it was asked, and the
front end puts a ``check_grad_mode`` guard in the graph there.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from autoshard.capture.leaves import MACHINERY_DIRS, TORCH_DIR
from autoshard.capture.state import is_real_run

#: Code that asks for the grad mode without choosing values by it: grad-mode context managers,
#: the checkpoint (which only skips recomputing), torch's tracing machinery, autoshard itself.
_NEUTRAL = MACHINERY_DIRS + (os.path.join(TORCH_DIR, "autograd"),
                             os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GradModeReader:
    """``torch.is_grad_enabled`` while tracing: ``caller_grad`` for model code (``on_read(site)``
    told where), the real answer elsewhere and in runs for real (``running()``). With another ``real``
    function, the reader of that mode (``torch.is_inference_mode_enabled``)."""

    def __init__(self, caller_grad: bool, on_read: Callable[[str], None],
                 running: Callable[[], bool] = is_real_run,
                 real: Callable[[], bool] = torch._C.is_grad_enabled) -> None:
        self.caller_grad = caller_grad
        self.on_read = on_read
        self.running = running
        self.real = real

    def __call__(self) -> bool:
        caller = sys._getframe(1)
        if self.running() or caller.f_code.co_filename.startswith(_NEUTRAL):
            return self.real()
        self.on_read(f"the code at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        return self.caller_grad
