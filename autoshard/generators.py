"""torch's random generators, compared before and after running code: did it draw?

Shape propagation asks it per node (draws are ordered in the split); capture asks it of code it
runs for real while tracing (a draw there would be a constant of the graph). A plan tried on a call
and refused by a guard after some stages drew is rewound (``rewind``) before the next is tried.
"""

from __future__ import annotations

import torch


def generator_snapshot() -> list[torch.Tensor]:
    """The state of every random generator in use: the CPU one and, once CUDA is up, each GPU's
    (``rewind`` sets them back to it; 1-2 us on a CPU)."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def rewind(snapshot: list[torch.Tensor]) -> None:
    """Set the generators back to ``snapshot``: draws made since are drawn again."""
    torch.random.set_rng_state(snapshot[0])
    if len(snapshot) > 1:
        torch.cuda.set_rng_state_all(snapshot[1:])


def generator_states() -> list[bytes]:
    """``generator_snapshot`` as bytes (read through numpy, which dispatches nothing; asked around every
    node run or torch function traced)."""
    with torch._C.DisableTorchFunction():
        return [state.numpy().tobytes() for state in generator_snapshot()]
