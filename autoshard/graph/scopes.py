"""Module-level split constraints resolved to node sets, from the DAG's ``scopes`` and ``weights``.

``build_dag`` records on each node the modules it runs inside (``scopes``: ``(path, class
name)`` pairs, outermost first) and the canonical names of the weights it reads (``weights``;
tied weights share a name). A module path stands for the module and its descendants; a class
name for every module of that class. torch-free: it only reads node attributes.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Sequence

import networkx as nx

from autoshard.errors import InvalidArgumentError
from autoshard.graph.indexed import Node


def _inside(path: str, module: str) -> bool:
    """Whether ``path`` is ``module`` or one of its descendants."""
    return path == module or path.startswith(module + ".")


def _scopes(dag: nx.DiGraph, node: Node) -> tuple[tuple[str, str], ...]:
    return tuple(dag.nodes[node].get("scopes", ()))


def _unknown(option: str, entry: str, known: Iterable[str], what: str) -> InvalidArgumentError:
    close = difflib.get_close_matches(entry, sorted(set(known)), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return InvalidArgumentError(f"{option}: no {what} is called {entry!r}{hint}")


def cut_before_nodes(dag: nx.DiGraph, order: Sequence[Node], paths: Sequence[str]) -> list[Node]:
    """For each module path, the first node of ``order`` that runs inside that module."""
    found = []
    for path in paths:
        first = next((v for v in order if any(_inside(p, path) for p, _ in _scopes(dag, v))), None)
        if first is None:
            known = (p for v in order for p, _ in _scopes(dag, v))
            raise _unknown("cut-before", path, known, "module with nodes in the graph")
        found.append(first)
    return found


def no_split_groups(dag: nx.DiGraph, entries: Sequence[str]) -> dict[str, frozenset[Node]]:
    """One group per module path entry, and per module of each class-name entry.

    A path matches the module and its descendants; an entry that is no path is taken as a
    class name. Labels read ``no-split ENTRY`` or ``no-split CLASS (PATH)``.
    """
    members: dict[str, set[Node]] = {}
    by_class: dict[str, dict[str, set[Node]]] = {}
    for v in dag.nodes:
        for path, kind in _scopes(dag, v):
            members.setdefault(path, set()).add(v)
            by_class.setdefault(kind, {}).setdefault(path, set()).add(v)
    groups: dict[str, frozenset[Node]] = {}
    for entry in entries:
        paths = [p for p in members if _inside(p, entry)]
        if paths:
            groups[f"no-split {entry}"] = frozenset().union(*(members[p] for p in paths))
        elif entry in by_class:
            for path, nodes in by_class[entry].items():
                groups[f"no-split {entry} ({path})"] = frozenset(nodes)
        else:
            raise _unknown("no-split", entry, [*members, *by_class], "module path or class")
    return groups


def tied_groups(dag: nx.DiGraph) -> dict[str, frozenset[Node]]:
    """Nodes that read the same weight, per canonical weight name read by two nodes or more."""
    readers: dict[str, set[Node]] = {}
    for v, names in dag.nodes(data="weights", default=()):
        for name in names:
            readers.setdefault(name, set()).add(v)
    return {name: frozenset(nodes) for name, nodes in readers.items() if len(nodes) > 1}
