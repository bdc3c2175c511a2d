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


_PYTHON_DISPATCH = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)


def same_states(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    """Compared past every Python mode and subclass (straight to the CPU kernel): asked once per node
    run or traced, where the modes active then would make each comparison cost three times as much."""
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(_PYTHON_DISPATCH):
        return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))
