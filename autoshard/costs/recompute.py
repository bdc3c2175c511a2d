"""What a stage keeps when ``runtime.parallelize(..., activation_checkpointing=True)`` recomputes
its blocks: the memory model's side of ``runtime.recompute``.

The runtime calls each run of consecutive nodes of one block (``blocks.3``: the outermost module
on a node's scope whose path ends in an index) through non-reentrant ``torch.utils.checkpoint``.
Its saved-tensor hooks drop what the block's nodes save; the region's inputs stay referenced by
the checkpoint until its backward (the recompute function holds them), and its outputs live as
long as a node that reads them saves them (or a further block's checkpoint holds them). At
backward the block's forward runs again as the first of its nodes unpacks what it saved, so what
its own nodes make and save exists once more, until each node's backward has used it: one block at
a time, from the start of its backward to its end.

So per microbatch a stage keeps what the nodes outside blocks save, plus the storages entering
and leaving each block (``checkpointed_kept``), and its backward walk adds each block's recompute
while that block's backward runs (``recomputed_backward``). Torch-free, like the rest of the memory
model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Callable, Iterable, Mapping, Sequence, TypeVar

import networkx as nx

_COMPUTING = ("call_module", "call_function", "call_method")
T = TypeVar("T")


def block_path(scopes: Iterable[str]) -> str | None:
    """The block a node computes part of, from its module scopes outermost first: the first path
    whose last part is an index (``nn.ModuleList`` and ``nn.Sequential`` items), else None."""
    for path in scopes:
        if path.rpartition(".")[2].isdigit():
            return path
    return None


def _block(dag: nx.DiGraph, node: str) -> str | None:
    data = dag.nodes[node]
    if data.get("op") not in _COMPUTING:
        return None
    return block_path(path for path, _ in data.get("scopes") or ())


def block_runs(items: Iterable[T], block: Callable[[T], str | None], skip: Callable[[T], bool]) -> list[list[T]]:
    """Maximal runs of consecutive ``items`` of one block (``block``: None outside any); the
    ``skip`` ones (reads of attributes) neither join nor break a run. ``runtime.recompute`` cuts a
    stage's graph by it, and the memory model its nodes."""
    runs: list[list[T]] = []
    current: str | None = None
    for item in items:
        if skip(item):
            continue
        found = block(item)
        if found is not None and found == current:
            runs[-1].append(item)
        elif found is not None:
            runs.append([item])
        current = found
    return runs


def checkpoint_regions(dag: nx.DiGraph, nodes: Sequence[str]) -> list[list[str]]:
    """The runs of ``nodes`` (a stage's, in program order) that ``runtime.recompute`` recomputes."""
    return block_runs(nodes, lambda node: _block(dag, node), lambda node: dag.nodes[node].get("op") == "get_attr")


def _crossings(
    dag: nx.DiGraph, nodes: Sequence[str], regions: Sequence[Sequence[str]], owners: Callable[[str], AbstractSet[str]],
) -> tuple[dict[str, set[int]], set[str]]:
    """The storages entering regions, each with the regions (by index) whose checkpoint holds it, and
    those leaving one. ``owners`` names the storages a value keeps alive: all of a container's (a tuple
    of values two nodes made), not only its widest."""
    here = set(nodes)
    entering: dict[str, set[int]] = {}
    leaving: set[str] = set()
    for index, run in enumerate(regions):
        members = set(run)
        for node in run:
            for value in dag.predecessors(node):
                if value not in members and value in here:
                    for storage in owners(value):
                        entering.setdefault(storage, set()).add(index)
            if any(w not in members for w in dag.successors(node)):
                leaving.update(owners(node))
    return entering, leaving


def boundary_storages(
    dag: nx.DiGraph, nodes: Sequence[str], region_of: Mapping[str, int],
    crossings: tuple[dict[str, set[int]], set[str]], counted: AbstractSet[str],
) -> dict[str, float]:
    """The storages one microbatch keeps because they enter or leave a region (``crossings``, from
    ``_crossings``), with their bytes, once.
    A storage leaving a block that no node outside it saves (read by an addition, say) and that enters
    no block is not kept: only a checkpoint or a saver holds it, and the checkpoint drops what the
    block's own nodes save. A storage already counted (``counted``: received or sent values) or kept
    by its maker outside the regions (``region_of``: each region's nodes; ``kept_bytes`` counts it) is
    not counted here."""
    entering, leaving = crossings
    saved_beyond = _saved_beyond_their_region(dag, nodes, region_of)
    found: dict[str, float] = {}
    for storage in entering.keys() | leaving:
        data = dag.nodes[storage]
        facts = data.get("training")
        kept_by_maker = storage not in region_of and facts is not None and facts.saved_output
        # a storage leaving a block that no checkpoint holds and no node outside it saves is freed once read
        saved = facts is not None and (facts.saved_output if saved_beyond is None else storage in saved_beyond)
        unsaved = storage not in entering and facts is not None and not saved
        if data.get("input") or storage in counted or kept_by_maker or unsaved:
            continue
        found[storage] = float(data.get("allocated") or 0)
    return found


def _saved_beyond_their_region(dag: nx.DiGraph, nodes: Sequence[str], region_of: Mapping[str, int],
                               ) -> AbstractSet[str] | None:
    """The storages a node of ``nodes`` saves from outside the region that made them (what a region's
    own nodes save, its checkpoint drops); None without every node's ``saves_from`` facts (facts
    recorded before them), and then the caller falls back on whether any node saves it."""
    found: set[str] = set()
    for node in nodes:
        if dag.nodes[node].get("op") not in _COMPUTING:
            continue
        facts = dag.nodes[node].get("training")
        if facts is None or facts.saves_from is None:
            return None
        found.update(m for m in facts.saves_from if not _same_region(region_of, node, m))
    return found


@dataclass(frozen=True)
class RecomputedBackward:
    """How a stage's backward holds and frees what its checkpointed regions keep and recompute, for
    the backward walk (``costs.memory``), node by node in reverse. A region's forward runs again when
    its backward starts (its last node unpacks what it saved): ``recomputed_at``, per region's last
    node, the storages its own nodes make and save again, which each node's own release frees as it
    runs (``is_copy``). A storage entering or leaving a region (``boundary``: those kept for that
    alone, with their bytes, ``boundary_storages``; ``deferred``: those and the ones their makers
    outside the regions keep that a checkpoint holds too) is freed once the last of its holders is done
    (``released_after``, per node): a region's checkpoint, at the end of that region's backward; a
    node outside the regions that saves it, after its backward. Their releases elsewhere free nothing."""

    region_of: Mapping[str, int]
    recomputed_at: Mapping[str, float]
    released_after: Mapping[str, float]
    boundary: Mapping[str, float]
    deferred: AbstractSet[str]

    def is_copy(self, node: str, maker: str) -> bool:
        """Whether ``node``'s release of ``maker``'s storage frees the copy the recompute made."""
        return _same_region(self.region_of, node, maker)

    def held_elsewhere(self, node: str, maker: str) -> bool:
        """Whether ``node``'s release of ``maker``'s storage frees nothing: a region's node made it
        and ``node`` is outside that region, or its holders free it (``released_after``)."""
        return not self.is_copy(node, maker) and (maker in self.region_of or maker in self.deferred)


def recomputed_backward(
    dag: nx.DiGraph, nodes: Sequence[str], regions: Sequence[Sequence[str]], kept: Callable[[str], float],
    releases: Callable[[str], Sequence[tuple[str, float]] | None], owners: Callable[[str], AbstractSet[str]],
    counted: AbstractSet[str],
) -> RecomputedBackward:
    """The ``RecomputedBackward`` of ``nodes`` (a stage's, in program order) recomputing ``regions``.
    ``releases``: per node, the makers and bytes its backward frees (it first saves them), None
    without the probe's facts (then ``kept``: all it saves is recomputed and held to the end). No
    regions: ``NOT_RECOMPUTED``, without walking the stage."""
    if not regions:
        return NOT_RECOMPUTED
    region_of = {n: index for index, run in enumerate(regions) for n in run}
    position = {n: i for i, n in enumerate(nodes)}
    crossings = _crossings(dag, nodes, regions, owners)
    entering = crossings[0]
    boundary = boundary_storages(dag, nodes, region_of, crossings, counted)
    original, copied = _saver_releases(nodes, region_of, releases)

    def done(node: str) -> int:
        """Where, in program order, a holder lets go: a region's first node (its backward's end)."""
        region = region_of.get(node)
        return position[node] if region is None else position[regions[region][0]]

    # made outside the regions, kept by its maker (``kept_bytes``) and held by a checkpoint too
    held_too = {storage for storage in entering if storage not in region_of and storage in original
                and storage not in counted and not dag.nodes[storage].get("input")}
    released_after: dict[str, float] = {}
    for storage in boundary.keys() | held_too:
        holders = [position[regions[index][0]] for index in entering.get(storage, ())]
        holders += [done(node) for node, _ in original.get(storage, ())]
        if storage in copied:  # a node after its region may save it too: the releases name only the first
            holders.append(position[regions[region_of[storage]][-1]] + 1)
        if not holders:  # no saver the probe saw: kept to the end
            continue
        last = nodes[min(min(holders), len(nodes) - 1)]
        nbytes = boundary.get(storage, sum(b for _, b in original.get(storage, ())))
        released_after[last] = released_after.get(last, 0.0) + nbytes
    made_again = {run[-1]: _saved_again(run, kept, releases) for run in regions}
    return RecomputedBackward(region_of, made_again, released_after, boundary, frozenset(boundary.keys() | held_too))


NOT_RECOMPUTED = RecomputedBackward({}, {}, {}, {}, frozenset())
"""A stage without checkpointed regions: its backward walk frees and holds as it would anyway."""


def checkpointed_kept(nodes: Sequence[str], recomputed: RecomputedBackward, kept: Callable[[str], float]) -> float:
    """Bytes one microbatch keeps when ``recomputed``'s regions are recomputed: ``kept`` of the nodes
    outside them, plus each storage that enters or leaves a region, once (``boundary_storages``)."""
    return (sum(kept(n) for n in nodes if n not in recomputed.region_of)
            + sum(recomputed.boundary.values()))


def _same_region(region_of: Mapping[str, int], node: str, maker: str) -> bool:
    region = region_of.get(node)
    return region is not None and region_of.get(maker) == region


def _saver_releases(
    nodes: Sequence[str], region_of: Mapping[str, int],
    releases: Callable[[str], Sequence[tuple[str, float]] | None],
) -> tuple[dict[str, list[tuple[str, float]]], set[str]]:
    """Per maker, the releases that free its original storage (by a node outside its maker's region,
    with their bytes), and the makers a node of their own region saves first (that release frees the
    recompute's copy)."""
    here = set(nodes)
    original: dict[str, list[tuple[str, float]]] = {}
    copied: set[str] = set()
    for node in nodes:
        for maker, nbytes in releases(node) or ():
            if maker not in here:
                continue
            if _same_region(region_of, node, maker):
                copied.add(maker)
            else:
                original.setdefault(maker, []).append((node, float(nbytes)))
    return original, copied


def _saved_again(run: Sequence[str], kept: Callable[[str], float],
                 releases: Callable[[str], Sequence[tuple[str, float]] | None]) -> float:
    """What ``run``'s recomputed forward saves again: the storages its own nodes make and one of them
    saves first. What it saves of the region's inputs is no new memory (the checkpoint holds them),
    nor is an output only a node after it saves (kept since the forward)."""
    members = set(run)
    total = 0.0
    for node in run:
        freed = releases(node)
        total += kept(node) if freed is None else sum(float(b) for m, b in freed if m in members)
    return total
