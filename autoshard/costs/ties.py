"""Shared and tied weights: one parameter or buffer object read by several nodes.

An LM head tied to the embedding (``lm_head.weight = embed.weight``) or a module called twice
reads the same tensor from two places. Found by identity: ``build-dag`` gives every object one
canonical name, so two nodes share a weight exactly when they list the same name. When its
readers land in different stages, each of those stages holds a reference to the one object,
and in training their gradients must be summed between them (``needs_gradient_sync``).

The splitter adds per-node costs, so a cost that counts a weight once per stage holding it
(``params``, ``memory``) must pick which readers pay for it (``weight_payers``), and the split
tries a few such choices (``tie_placements``), keeping the plan whose true cost is lowest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import AbstractSet, Collection, Mapping, Sequence

import networkx as nx

EXHAUSTIVE_TIE_GROUPS = 3
"""Up to this many tie groups every together/apart combination is tried (2^n more splits)."""


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


@dataclass(frozen=True)
class TieGroup:
    """Shared weights with the same readers, which a split places as one: all together or apart.

    ``label`` is the first weight's name; ``weights`` are in program order.
    """

    label: str
    weights: tuple[str, ...]
    readers: frozenset[str]


def tie_groups(dag: nx.DiGraph) -> tuple[TieGroup, ...]:
    """Weights read by two nodes or more, grouped by their set of readers, in program order.

    A module called twice shares its weight and its bias between the same two nodes: one group.
    """
    by_readers: dict[frozenset[str], list[str]] = {}
    for name, nodes in weight_readers(dag).items():
        if len(nodes) > 1:
            by_readers.setdefault(frozenset(nodes), []).append(name)
    return tuple(TieGroup(names[0], tuple(names), readers) for readers, names in by_readers.items())


@dataclass(frozen=True)
class TiePlacement:
    """How one split treats the tied weights.

    The weights of ``apart`` are charged to every reader (exact if the readers take separate
    stages); the others to their first reader (exact if the readers share a stage), so the
    groups in ``together`` must share one and those in ``preferred`` do when the bound allows.
    """

    apart: frozenset[str] = frozenset()
    together: tuple[TieGroup, ...] = ()
    preferred: tuple[TieGroup, ...] = ()


def charged_apart(groups: Collection[TieGroup]) -> frozenset[str]:
    """The weights of ``groups``: a placement's ``apart`` that charges them to every reader."""
    return frozenset(w for group in groups for w in group.weights)


def tie_placements(groups: Sequence[TieGroup], separated: Collection[str]) -> list[TiePlacement]:
    """The placements worth a split once the first one separated the groups labelled ``separated``.

    With at most ``EXHAUSTIVE_TIE_GROUPS`` groups, every group either together or apart. Every
    placement charges each plan it allows at least its true cost, and the placement matching
    the optimal plan charges that plan exactly when each tie has two readers; so the best of
    these splits is optimal for the true cost whenever the strategy is optimal for the charged
    one. With more groups, two guesses: the separated groups apart, then all of them.
    """
    if len(groups) <= EXHAUSTIVE_TIE_GROUPS:
        combinations = itertools.product((False, True), repeat=len(groups))
        return [TiePlacement(charged_apart([g for g, a in zip(groups, apart) if a]),
                             together=tuple(g for g, a in zip(groups, apart) if not a),
                             preferred=tuple(g for g, a in zip(groups, apart) if a))
                for apart in combinations]
    split_up = [g for g in groups if g.label in separated]
    return [TiePlacement(charged_apart(split_up), preferred=tuple(groups)),
            TiePlacement(charged_apart(groups), preferred=tuple(groups))]


def weight_payers(
    dag: nx.DiGraph, apart: AbstractSet[str] = frozenset(), assignment: Mapping[str, int] | None = None,
    nodes: Sequence[str] | None = None,
) -> dict[str, tuple[str, ...]]:
    """Per node, in program order, the weights charged to it when costs are summed per stage.

    By default a weight is charged to its first reader: exact for a stage plan that keeps all
    its readers together, too little for one that does not. A weight in ``apart`` is charged to
    every reader: exact when each reader has its own stage, too much otherwise. With an
    ``assignment`` each weight is charged to its first reader in every stage that holds it,
    which is exactly once per stage, whatever the plan. With ``nodes`` (in the DAG's order), only
    those are walked: with an ``assignment``, one stage's nodes are charged as the whole walk charges
    them, without the other stages' (the exact search judges one stage at a time).
    """
    charged: set[tuple[str, object]] = set()
    payers = {}
    read = dag.nodes(data="weights", default=())
    for node, names in read if nodes is None else ((v, read[v]) for v in nodes):
        if assignment is not None and dag.nodes[node].get("tensor") is False:
            payers[node] = ()  # a weight's shape read: emit recomputes it in its readers' stages
            continue  # (``emit.recomputed_in_consumers``), wherever it was assigned
        paid = []
        for name in names:
            where = node if name in apart else None if assignment is None else assignment[node]
            if (name, where) not in charged:
                charged.add((name, where))
                paid.append(name)
        payers[node] = tuple(paid)
    return payers


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
