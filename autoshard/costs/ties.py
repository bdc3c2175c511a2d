"""Shared and tied weights: one parameter or buffer object read by several nodes.

An LM head tied to the embedding (``lm_head.weight = embed.weight``) or a module called twice
reads the same tensor from two places. Found by identity: ``build-dag`` gives every object one
canonical name, so two nodes share a weight exactly when they list the same name. When its
readers land in different stages, each of those stages holds a reference to the one object,
and in training their gradients must be summed between them (``needs_gradient_sync``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import networkx as nx


@dataclass(frozen=True)
class SharedWeight:
    """A weight read by several nodes or known under several names, and where its readers are."""

    name: str
    aliases: tuple[str, ...]
    kind: str
    trainable: bool
    nbytes: int
    nodes: tuple[str, ...]
    stages: tuple[int, ...] = ()

    @property
    def needs_gradient_sync(self) -> bool:
        """A trainable parameter held by several stages: they must sum its gradient."""
        return self.trainable and len(self.stages) > 1

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "aliases": list(self.aliases), "kind": self.kind, "trainable": self.trainable,
                "bytes": self.nbytes, "nodes": list(self.nodes), "stages": list(self.stages),
                "needs_gradient_sync": self.needs_gradient_sync}


def weight_readers(dag: nx.DiGraph) -> dict[str, list[str]]:
    """Canonical weight name -> the DAG nodes that read it, in program order."""
    readers: dict[str, list[str]] = {}
    for node, data in dag.nodes(data=True):
        for name in data.get("weights", ()):
            readers.setdefault(name, []).append(node)
    return readers


def shared_weights(dag: nx.DiGraph, assignment: Mapping[str, int] | None = None) -> tuple[SharedWeight, ...]:
    """Every weight read by two or more nodes or tied under two or more names, in program order.

    With an ``assignment``, each entry also lists the stages holding the weight.
    """
    infos = dag.graph.get("weights", {})
    shared = []
    for name, nodes in weight_readers(dag).items():
        info = infos.get(name)
        aliases = info.names if info else (name,)
        if len(nodes) < 2 and len(aliases) < 2:
            continue
        stages = tuple(sorted({assignment[n] for n in nodes})) if assignment is not None else ()
        shared.append(SharedWeight(name, aliases, info.kind if info else "parameter",
                                   bool(info.trainable) if info else True, info.nbytes if info else 0,
                                   tuple(nodes), stages))
    return tuple(shared)
