"""Activation checkpointing per block inside a stage's graph.

``checkpoint_wrapper`` wraps a module whose forward is called, but a stage's graph calls a block's
leaves (``blocks.3.qkv``, then the attention's functions, ...), never the block. So each run of
consecutive nodes computing one block (``runtime.blocks.block_of``) becomes a graph of its own,
called through ``torch.utils.checkpoint``: its activations are recomputed in backward instead of
kept. The region graphs call the stage's own leaf modules and are kept in a plain tuple, not
registered as submodules, so the stage's parameter names, ``state_dict`` keys and hooks (FSDP's)
are unchanged. Recomputation restores the random generators (dropout draws the same numbers), so
gradients are exactly those of the plain stage.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from autoshard.costs.recompute import block_runs
from autoshard.runtime.blocks import block_of

#: The stage attribute holding its region graphs (a tuple: not submodules).
REGIONS = "_autoshard_recomputed"


def run_recomputed(regions: tuple[fx.GraphModule, ...], index: int, *inputs: Any) -> Any:
    """Region ``index`` under non-reentrant checkpointing (the graph's call of it), through its
    ``forward``: the region is no module of the model, and called as one, a global module hook
    (``MemTracker``'s module tracker) hooked its inputs, the weights a graph reads by ``get_attr``
    among them, and held each one's gradient until the last had one."""
    return checkpoint(regions[index].forward, *inputs, use_reentrant=False)


def _runs(graph: fx.Graph) -> list[list[fx.Node]]:
    """Maximal runs of consecutive computing nodes of one block; reads of attributes between them
    do not break a run (they stay outside it, as its inputs)."""
    computing = ("call_module", "call_function", "call_method")
    return block_runs(graph.nodes, lambda node: block_of(node) if node.op in computing else None,
                      lambda node: node.op == "get_attr")


def _region(module: fx.GraphModule, run: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """``run`` as a graph module of its own, with the outside nodes it reads and those read after it."""
    inside = set(run)
    inputs = list(dict.fromkeys(arg for node in run for arg in node.all_input_nodes if arg not in inside))
    outputs = [node for node in run if any(user not in inside for user in node.users)]
    graph = fx.Graph()
    env = {node: graph.placeholder(node.name) for node in inputs}
    for node in run:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    return fx.GraphModule(module, graph), inputs, outputs


def checkpoint_blocks(module: fx.GraphModule) -> list[str]:
    """Rewrite ``module`` (a stage's copy) in place so that each block's activations are recomputed
    in backward; the blocks, in order."""
    runs = _runs(module.graph)
    if not runs:
        return []
    graph = module.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        held = graph.create_node("get_attr", REGIONS)  # not a tensor or module: get_attr() would warn
    regions = []
    for index, run in enumerate(runs):
        region, inputs, outputs = _region(module, run)
        regions.append(region)
        with graph.inserting_after(run[-1]):
            call = graph.call_function(run_recomputed, (held, index, *inputs))
        for position, node in enumerate(outputs):
            with graph.inserting_after(call):
                item = graph.call_function(operator.getitem, (call, position))
            node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item and user not in run)
        for node in reversed(run):
            graph.erase_node(node)
    setattr(module, REGIONS, tuple(regions))
    graph.lint()
    module.recompile()
    return [block_of(run[0]) or "" for run in runs]
