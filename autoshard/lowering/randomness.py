"""Random draws: the order they impose beyond data flow.

Every dropout, ``torch.rand`` or ``bernoulli_`` takes the next numbers from one generator, so
the stages reproduce the model's values (and pass verification) only if they draw in the
model's order. Draws on one path (a transformer's dropouts) are ordered by their data already;
draws on parallel branches (GoogLeNet's auxiliary heads, a mixture of experts) are not, and a
splitter free to reorder nodes could put a later draw in an earlier stage. ``order_random_draws``
adds the missing edges: for each draw not already an ancestor of the next one, an edge to it from
the cheapest value computed from the first that the model computes before the second, so that
the order costs as few boundary bytes as it can.

Which nodes draw comes from two sources: ``shape-prop`` saw the generator move (this catches
dropout inside a module kept whole), and the operator itself says so (aten tags every random
operator ``nondeterministic_seeded``), for graphs that ran on fake tensors or not at all.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Hashable

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from autoshard.costs.facts import node_facts

#: Random functions without an aten namesake of the same name.
_RANDOM_FUNCTIONS = frozenset({
    torch.nn.functional.dropout1d, torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
    torch.nn.functional.feature_alpha_dropout, torch.nn.functional.gumbel_softmax,
})
#: Modules of torch's functions (``torch.arange``, ``F.dropout``): an aten namesake tells what such a function does.
TORCH_MODULES = frozenset({"torch", "torch.nn.functional", "torch._C._nn", "torch._C._VariableFunctions",
                           "torch.functional", "torch._C._linalg", "torch._C._fft", "torch._C._special"})


@functools.lru_cache(maxsize=None)
def _aten_is_random(name: str) -> bool:
    """Whether an aten operator of this name is tagged as drawing from a generator (cached: the
    tags of an operator do not change, and each node of a large graph asks)."""
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags for overload in packet.overloads())


def _module_is_random(module: nn.Module) -> bool:
    return any(sub.training and isinstance(sub, (nn.modules.dropout._DropoutNd, nn.RReLU))
               and getattr(sub, "p", 1.0) > 0 for sub in module.modules())


def draws_random(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may take numbers from a random generator."""
    facts = node_facts(node)
    if facts is not None and facts.draws_random:
        return True
    target: Any = node.target
    if node.op == "call_module":
        return _module_is_random(gm.get_submodule(str(target)))
    if node.op == "call_method":
        return isinstance(target, str) and _aten_is_random(target)
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):  # torch.export's graphs
        return torch.Tag.nondeterministic_seeded in target.tags
    if target in _RANDOM_FUNCTIONS:
        return True
    return getattr(target, "__module__", None) in TORCH_MODULES and _aten_is_random(getattr(target, "__name__", ""))


def order_random_draws(gm: fx.GraphModule, dag: nx.DiGraph) -> None:
    """Add to ``dag`` the edges that keep its random draws in the model's order."""
    position = {node: index for index, node in enumerate(dag.nodes)}
    draws = [n.name for n in gm.graph.nodes if n.name in position and draws_random(gm, n)]
    for first, second in zip(draws, draws[1:]):
        source = _cheapest_carrier(dag, position, first, second)
        if source is not None:
            dag.add_edge(source, second, value=source)


def _cheapest_carrier(dag: nx.DiGraph, position: dict[Hashable, int], first: Hashable,
                      second: Hashable) -> Hashable | None:
    """The value computed from ``first`` (or ``first`` itself), before ``second`` in program order,
    whose edge to ``second`` adds the fewest boundary bytes; None when ``first`` is already an
    ancestor of ``second``. A value that is a model output or that something after ``second``
    reads crosses to ``second``'s stage anyway, and adds nothing."""
    limit = position[second]
    best: tuple[float, int, Hashable] | None = None
    seen = {first}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        data = dag.nodes[node]
        if data.get("tensor") is not False:  # a non-tensor value is recomputed, never sent
            read_later = data.get("output") or any(position[r] > limit for r in dag.successors(node))
            candidate = (0.0 if read_later else float(data.get("bytes", 1.0)), position[node], node)
            best = candidate if best is None or candidate < best else best
        for reader in dag.successors(node):
            if reader == second:
                return None
            if reader not in seen and position[reader] < limit:
                seen.add(reader)
                queue.append(reader)
    return best[2] if best is not None else None
