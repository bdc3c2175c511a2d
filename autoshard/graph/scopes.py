"""Module-level split constraints resolved to node sets, from the DAG's ``scopes`` and ``weights``.

``build_dag`` records on each node the modules it runs inside (``scopes``: ``(path, class
name)`` pairs, outermost first) and the canonical names of the weights it reads (``weights``;
tied weights share a name). A module path stands for the module and its descendants; a class
name for every module of that class. A path no node runs under may have a stand-in (the DAG's
``module_stand_ins``, from the model): another name of the same module, or the module kept
whole that holds it. torch-free: it only reads node and graph attributes.
"""

from __future__ import annotations

import difflib
from functools import cached_property
from typing import AbstractSet, Iterable, Iterator, Sequence

import networkx as nx

from autoshard.errors import InfeasibleSplitError, InvalidArgumentError
from autoshard.graph.indexed import Node


def _inside(path: str, module: str) -> bool:
    """Whether ``path`` is ``module`` or one of its descendants."""
    return path == module or path.startswith(module + ".")


def _scopes(dag: nx.DiGraph, node: Node) -> tuple[tuple[str, str], ...]:
    return tuple(dag.nodes[node].get("scopes", ()))


def _unknown(option: str, entry: str, known: Iterable[str], what: str) -> InvalidArgumentError:
    names = sorted(set(known))
    # A path written for a wrapper of this model (``transformer.h.1`` of GPT2LMHeadModel on a GPT2Model)
    # ends with a known path, which difflib finds too far off to suggest.
    tail = sorted((p for p in names if entry.endswith("." + p)), key=len, reverse=True)[:1]
    close = tail or difflib.get_close_matches(entry, names, n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return InvalidArgumentError(f"{option}: no {what} is called {entry!r}{hint}")


def _stand_in(dag: nx.DiGraph, option: str, path: str) -> tuple[str, str] | None:
    """What stands in for module ``path`` if no node runs under it; raises if the forward never runs it."""
    stand_in = dag.graph.get("module_stand_ins", {}).get(path)
    if stand_in and stand_in[1] == "unused":
        used = [alias for info in dag.graph.get("weights", {}).values() if any(_inside(n, path) for n in info.names)
                for alias in info.names if not _inside(alias, path)]
        also = f" (its weights are used as {', '.join(map(repr, used))})" if used else ""
        raise InvalidArgumentError(f"{option}: the forward never runs module {path!r}{also}; name a module it runs")
    return stand_in


def cut_before_nodes(dag: nx.DiGraph, order: Sequence[Node], paths: Sequence[str],
                     optional: AbstractSet[str] = frozenset()) -> list[tuple[str, Node]]:
    """For each module path, the path and the first node of ``order`` that runs inside that module
    (or under another name of it). A module inside one kept whole cannot start a stage: refused,
    naming the module that can. A path in ``optional`` the graph does not run is left out."""
    found = []
    for path in paths:
        try:
            found.append((path, _first_node_inside(dag, order, path)))
        except InvalidArgumentError:
            if path not in optional:
                raise
    return found


def _first_node_inside(dag: nx.DiGraph, order: Sequence[Node], path: str) -> Node:
    """The first node of ``order`` inside module ``path`` (see ``cut_before_nodes``)."""
    stand_in = _stand_in(dag, "cut-before", path)
    if stand_in and stand_in[1] == "inside":
        raise InvalidArgumentError(
            f"cut-before: {path!r} runs inside {stand_in[0]!r}, which the capture keeps whole (see the "
            f"plan's wrapped modules for why), so no stage can start inside it; cut before {stand_in[0]!r}")
    if stand_in:
        path = stand_in[0]
    first = next((v for v in order if any(_inside(p, path) for p, _ in _scopes(dag, v))), None)
    if first is None:
        known = (p for v in order for p, _ in _scopes(dag, v))
        raise _unknown("cut-before", path, known, "module with nodes in the graph")
    return first


def no_split_modules(dag: nx.DiGraph, entries: Sequence[str],
                     optional: AbstractSet[str] = frozenset()) -> dict[str, tuple[str, frozenset[Node]]]:
    """One group per module path entry, and per module of each class-name entry, with the module
    path each group keeps whole, so that errors can say where a stage may start instead. A path
    matches the module and its descendants; an entry that is no path is taken as a class name.
    Labels read ``no-split ENTRY`` or ``no-split CLASS (PATH)``. ``<root>`` (or the model's class
    name, where no submodule has that class) names the whole model: one group of every node,
    which only one stage holds. An entry in ``optional`` the graph does not run is left out."""
    return {f"no-split {label}": kept for _, resolved in _resolved(_ScopeIndex(dag), "no-split", entries, optional)
            for label, kept in resolved.items()}


def pinned_nodes(dag: nx.DiGraph, entries: Sequence[str],
                 optional: AbstractSet[str] = frozenset()) -> dict[str, frozenset[Node]]:
    """The nodes each ``pin`` entry holds: those inside a module path or every module of a class,
    or those reading a weight (a parameter or buffer name, any of its aliases). An entry in
    ``optional`` that the graph does not run or read is left out; others are refused. The graph
    is read once for all entries (a re-specialisation pins every weight of the model)."""
    return {entry: frozenset().union(*(nodes for _, nodes in resolved.values()))
            for entry, resolved in _resolved(_ScopeIndex(dag), "pin", entries, optional, weights=True)}


def _resolved(index: _ScopeIndex, option: str, entries: Sequence[str], optional: AbstractSet[str],
              weights: bool = False) -> Iterator[tuple[str, dict[str, tuple[str, frozenset[Node]]]]]:
    """Each entry with what it names; one in ``optional`` the graph does not run or read is left out."""
    for entry in entries:
        try:
            yield entry, index.resolve(option, entry, weights=weights)
        except InvalidArgumentError:
            if entry not in optional:
                raise


class _ScopeIndex:
    """The nodes inside each module path and of each module class, read once from the DAG."""

    def __init__(self, dag: nx.DiGraph) -> None:
        self.dag = dag
        self.members: dict[str, set[Node]] = {}
        self.by_class: dict[str, dict[str, set[Node]]] = {}
        for v in dag.nodes:
            for path, kind in _scopes(dag, v):
                self.members.setdefault(path, set()).add(v)
                self.by_class.setdefault(kind, {}).setdefault(path, set()).add(v)

    @cached_property
    def weight_readers(self) -> dict[str, frozenset[Node]]:
        """The nodes reading each weight, under every name the weight has."""
        readers: dict[str, set[Node]] = {}
        for v, read in self.dag.nodes(data="weights", default=()):
            for canonical in read:
                readers.setdefault(canonical, set()).add(v)
        return {alias: frozenset(readers[key]) for key, info in self.dag.graph.get("weights", {}).items()
                if key in readers for alias in info.names}

    def resolve(self, option: str, entry: str, weights: bool = False) -> dict[str, tuple[str, frozenset[Node]]]:
        """``{label: (module path, nodes)}`` for a module path, a class name (one per module of it),
        the whole model, or (``weights``) the readers of a weight; raises naming what is known."""
        dag = self.dag
        stand_in = _stand_in(dag, option, entry)  # a module kept whole holds it, or it has another name
        module = stand_in[0] if stand_in else entry
        paths = [p for p in self.members if _inside(p, module)]
        root = ("<root>", dag.graph.get("root_class"))
        if paths:
            return {entry: (module, frozenset().union(*(self.members[p] for p in paths)))}
        if entry in self.by_class:
            return {f"{entry} ({path})": (path, frozenset(nodes)) for path, nodes in self.by_class[entry].items()}
        if entry in root:
            return {f"{entry} (the whole model)": (
                "<root>", frozenset(v for v, is_input in dag.nodes(data="input", default=False) if not is_input))}
        readers = self.weight_readers.get(entry) if weights else None
        if readers:
            return {entry: (entry, readers)}
        what = "module path, class or weight" if weights else "module path or class"
        raise _unknown(option, entry, [*self.members, *self.by_class, *filter(None, root)], what)


def check_cuts_outside_no_split(
    order: Sequence[Node], cuts: Sequence[tuple[str, Node]], groups: dict[str, tuple[str, frozenset[Node]]],
) -> None:
    """Refuse a cut-before whose first node falls inside a no-split module's span of ``order``, in
    the user's module paths (the splitter knows only node names), naming where a stage can start."""
    position = {v: i for i, v in enumerate(order)}
    for path, node in cuts:
        for label, (module, nodes) in groups.items():
            at = [position[v] for v in nodes if v in position]
            if at and min(at) < position[node] <= max(at):
                where, advice = ((f" (module {module!r})", f"cut before {module!r} instead, or drop one of the two")
                                 if module != "<root>" else ("", "drop one of the two"))
                raise InfeasibleSplitError(
                    f"cut-before {path!r} falls inside {label}{where}, which stays whole in one stage, so no stage "
                    f"can start there; {advice}")


def tied_groups(dag: nx.DiGraph) -> dict[str, frozenset[Node]]:
    """Nodes that read the same weight, per canonical weight name read by two nodes or more."""
    readers: dict[str, set[Node]] = {}
    for v, names in dag.nodes(data="weights", default=()):
        for name in names:
            readers.setdefault(name, set()).add(v)
    return {name: frozenset(nodes) for name, nodes in readers.items() if len(nodes) > 1}
