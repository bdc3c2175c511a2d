"""What a stage keeps when ``runtime.parallelize(..., activation_checkpointing=True)`` recomputes
its blocks: the memory model's side of ``runtime.recompute``.

The runtime calls each run of consecutive nodes of one block (``blocks.3``: the outermost module
on a node's scope whose path ends in an index) through non-reentrant ``torch.utils.checkpoint``.
Its saved-tensor hooks drop what the block's nodes save; the region's inputs stay referenced by
the checkpoint until its backward (the recompute function holds them), and its outputs live as
long as a node that reads them saves them (or a further block's checkpoint holds them). At
backward the block's forward runs again, so what its own nodes make and save exists once more,
for one block at a time.

So per microbatch a stage keeps what the nodes outside blocks save, plus the storages entering
and leaving each block (``checkpointed_kept``), and its backward adds the most one block saves
(``recompute_bytes``). Torch-free, like the rest of the memory model.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Iterable, Sequence, TypeVar

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


def checkpointed_kept(
    dag: nx.DiGraph, nodes: Sequence[str], regions: Sequence[Sequence[str]], kept: Callable[[str], float],
    owners: Callable[[str], AbstractSet[str]], counted: AbstractSet[str],
) -> float:
    """Bytes one microbatch keeps when ``regions`` are recomputed: ``kept`` of the nodes outside
    them, plus each storage that enters or leaves a region, once. ``owners`` names the storages a
    value keeps alive: all of a container's (a tuple of values two nodes made), not only its widest.
    A storage leaving a block that no node saves (read by an addition, say) and that enters no block
    is not kept: only a checkpoint or a saver holds it. A storage already counted (``counted``:
    received or sent values) or kept by its maker outside the regions is not counted again."""
    inside = {n for run in regions for n in run}
    here = set(nodes)
    total = sum(kept(n) for n in nodes if n not in inside)
    entering: set[str] = set()
    leaving: set[str] = set()
    for run in regions:
        members = set(run)
        for node in run:
            entering.update(u for u in dag.predecessors(node) if u not in members and u in here)
            if any(w not in members for w in dag.successors(node)):
                leaving.add(node)
    held = {o for v in entering for o in owners(v)}
    for storage in held | {o for v in leaving for o in owners(v)}:
        data = dag.nodes[storage]
        facts = data.get("training")
        kept_by_maker = storage not in inside and facts is not None and facts.saved_output
        # a storage leaving a block that no checkpoint holds and no node saves is freed once read
        unsaved = storage not in held and facts is not None and not facts.saved_output
        if data.get("input") or storage in counted or kept_by_maker or unsaved:
            continue
        total += float(data.get("allocated") or 0)
    return total


def recompute_bytes(regions: Sequence[Sequence[str]], kept: Callable[[str], float],
                    releases: Callable[[str], Iterable[tuple[str, float]] | None]) -> float:
    """The most one region's recomputed forward saves again at backward: the storages its own nodes
    make and one of them saves first (``releases``: per node, the makers and bytes its backward
    frees; None without the probe's facts, then ``kept``). What it saves of the region's inputs is
    no new memory (the checkpoint holds them, ``checkpointed_kept`` counts them), nor is an output
    only a node after it saves (kept since the forward): summing ``kept`` per maker charged both again."""
    def saved_again(run: Sequence[str]) -> float:
        members = set(run)
        total = 0.0
        for node in run:
            freed = releases(node)
            total += kept(node) if freed is None else sum(float(b) for m, b in freed if m in members)
        return total
    return max((saved_again(run) for run in regions), default=0.0)
