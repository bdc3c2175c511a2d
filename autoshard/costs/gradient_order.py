"""In what order autograd gives a node's weights and its inputs their gradients.

A stage adds a further gradient of an input into the one it already holds as a new buffer; whether
the node's weight gradients are still alive then depends on this order. A Linear on a 2-D input
(``addmm``) gives its input and weights their gradients at once, and autograd sums the input's
before it adds the weights' into theirs; one on a 3-D input hands the input's through the
reshape's backward, which autograd runs after adding the weights' gradients into theirs (freeing
them). Watched, not derived from op names: the priority autograd runs ready nodes in decides it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch.autograd.graph import get_gradient_edge


@contextlib.contextmanager
def gradient_order(sent: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   weights: Sequence[torch.Tensor]) -> Iterator[list[bool]]:
    """The list a backward from ``sent`` run inside fills, in the order autograd does it: True each
    time it adds a gradient into one of ``weights``' (their hooks fire as it runs their
    ``AccumulateGrad``), False each time it hands one of ``inputs`` a gradient (the autograd node
    feeding it has run: a sum with another gradient of it would be made then)."""
    given: list[bool] = []
    targets = {get_gradient_edge(t).node for t in inputs}
    stops = targets | {get_gradient_edge(t).node for t in weights}
    handles = [w.register_hook(lambda g: given.append(True)) for w in weights]
    seen: set = set()
    todo = [t.grad_fn for t in sent if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        following = [n for n, _ in node.next_functions if n is not None]
        if targets.intersection(following):
            handles.append(node.register_hook(lambda grad_inputs, grad_outputs: given.append(False)))
        todo.extend(following)
    try:
        yield given
    finally:
        for handle in handles:
            handle.remove()


def weights_given_first(given: Sequence[bool]) -> bool:
    """Whether ``gradient_order`` saw every weight's gradient added into its own before any input got one."""
    return True in given and False in given and given.index(False) > len(given) - 1 - given[::-1].index(True)
