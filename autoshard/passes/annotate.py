"""A copy of a traced ``GraphModule`` with measurements on its nodes, for passes that measure.

Artifacts are immutable, so a pass that learns something about the nodes (shapes, FLOPs, times)
returns a new graph module instead of writing into the one it was given. The copy has its own
graph but holds the same Parameter, buffer and leaf-module objects as the original.
"""

from __future__ import annotations

import copy
from typing import Mapping

import torch.fx as fx
from torch import nn

from autoshard.costs.facts import NodeFacts, record_facts, record_seconds
from autoshard.emit import copy_buffer_persistence


def annotated_copy(
    gm: fx.GraphModule, model: nn.Module, *, facts: Mapping[str, NodeFacts] | None = None,
    seconds: Mapping[str, float] | None = None, backward: bool = False,
) -> fx.GraphModule:
    """``gm`` with ``facts`` and ``seconds`` (by node name; ``backward``: each is the node's forward
    and backward) recorded on its nodes (``costs.facts``); what ``gm``'s nodes already carry is kept.

    Buffer persistence is taken from ``model``, the user's module, so buffers that are not
    persistent there stay out of ``state_dict`` here and in every stage emitted from the copy.
    """
    graph = copy.deepcopy(gm.graph)
    if facts is not None:
        record_facts(graph, facts)
    if seconds is not None:
        record_seconds(graph, seconds, backward)
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy_buffer_persistence(model, copied)
    return copied
