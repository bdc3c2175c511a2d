"""torch's random generators, compared before and after running code: did it draw?

Shape propagation asks it per node (draws are ordered in the split); capture asks it of code it
runs for real while tracing (a draw there would be a constant of the graph).
"""

from __future__ import annotations

import torch


def generator_states() -> list[bytes]:
    """The state of every random generator in use: the CPU one and, once CUDA is up, each GPU's,
    as bytes (read through numpy, which dispatches nothing; asked around every node run or torch
    function traced)."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    with torch._C.DisableTorchFunction():
        return [state.numpy().tobytes() for state in states]
