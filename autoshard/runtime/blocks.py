"""The repeated blocks of a model (``blocks.3``, ``transformer.h.0``) as a stage's graph meets them.

Data parallelism shards weights per block and activation checkpointing recomputes per block, as
torchtitan and DeepSpeed do for transformer layers. A stage's graph calls the leaf modules
(``blocks.3.qkv``), never the block itself, so a block is found from each node's
``nn_module_stack``: the outermost module on it that is an item of a container (a path ending
in an index, as ``nn.ModuleList`` and ``nn.Sequential`` name their items).
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from autoshard.costs.recompute import block_path
from autoshard.runtime.rebuild import stage_tensors
from autoshard.sharded import ShardedModel


def block_of(node: fx.Node) -> str | None:
    """The path of the block ``node`` computes part of, or None outside any block (the memory
    model finds blocks by the same rule, ``costs.recompute.block_path``)."""
    stack = (node.meta.get("nn_module_stack") or {}).values()
    return block_path(value[0] if isinstance(value, tuple) else str(value) for value in stack)


def _under(name: str, block: str) -> bool:
    return name.startswith(block + ".")


def whole_blocks(sharded: ShardedModel, stage_index: int, module: fx.GraphModule) -> dict[str, list[nn.Module]]:
    """The blocks of stage ``stage_index`` (whose copy is ``module``) that can be a data-parallel
    unit of their own: ``block -> the leaf modules the graph calls in it``.

    A block qualifies when this stage holds all of its weights (no other stage holds a tensor
    under it), every one of them inside a leaf the graph calls exactly once (FSDP gathers a unit's
    weights when the first of its leaves runs and frees them after the last), and the graph reads
    none of them directly (``get_attr``: no hook would gather it first).
    """
    elsewhere = {name for index, stage in enumerate(sharded.stages) if index != stage_index
                 for name in stage_tensors(stage)}
    nodes = list(module.graph.nodes)
    read = [str(n.target) for n in nodes if n.op == "get_attr"]
    calls: dict[str, int] = {}
    for node in nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    held = dict(module.named_parameters(remove_duplicate=False))
    found: dict[str, list[nn.Module]] = {}
    for block in dict.fromkeys(b for b in map(block_of, nodes) if b is not None):
        leaves = [path for path in calls if _under(path, block)]
        weights = {name for name in held if _under(name, block)}
        in_leaves = {name for name in weights if any(_under(name, leaf) for leaf in leaves)}
        if (not weights or weights != in_leaves or any(calls[leaf] != 1 for leaf in leaves)
                or any(_under(name, block) for name in elsewhere) or any(_under(t, block) for t in read)):
            continue
        found[block] = [module.get_submodule(leaf) for leaf in leaves]
    return found
