"""torch's random generators, compared before and after running code: did it draw?

Shape propagation asks it per node (draws are ordered in the split); capture asks it of code it
runs for real while tracing (a draw there would be a constant of the graph).
"""

from __future__ import annotations

import torch


def generator_states() -> list[torch.Tensor]:
    """The state of every random generator in use: the CPU one and, once CUDA is up, each GPU's."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def same_states(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    """Compared past the ``__torch_function__`` modes (asked once per node run or traced, where they
    would make each comparison cost twice as much). Not past the dispatch modes too: excluding the
    Python dispatch keys here made the training probe's facts differ from process to process (an
    addition's backward read 256 bytes in some, 0 in others), which broke identical plans."""
    with torch._C.DisableTorchFunction():
        return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))
