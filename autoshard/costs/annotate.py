"""A copy of a traced ``GraphModule`` with extra per-node metadata, for passes that measure.

Artifacts are immutable, so a pass that learns something about the nodes (shapes, FLOPs, times)
returns a new graph module instead of writing into the one it was given. The copy has its own
graph but holds the same Parameter, buffer and leaf-module objects as the original.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch.fx as fx
from torch import nn

from autoshard.emit import copy_buffer_persistence


def annotated_copy(gm: fx.GraphModule, model: nn.Module, meta: Mapping[str, Mapping[str, Any]]) -> fx.GraphModule:
    """``gm`` with ``node.meta[key] = meta[key][node.name]`` for every key and listed node.

    Buffer persistence is taken from ``model``, the user's module, so buffers that are not
    persistent there stay out of ``state_dict`` here and in every stage emitted from the copy.
    """
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        for key, values in meta.items():
            if node.name in values:
                node.meta[key] = values[node.name]
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy_buffer_persistence(model, copied)
    return copied
