"""The layer rules, held by a short AST check.

Every ``import`` of an autoshard module is counted: at the top of a file, inside a
function, under ``if TYPE_CHECKING:``. No cycle may form among autoshard's files,
and ``autoshard/graph/`` (pure graph algorithms) may not import torch at all.
"""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "autoshard"


def _module_name(path):
    """The dotted name of one file under autoshard/."""
    parts = ["autoshard", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    """Each autoshard module's dotted name, with its file and parsed tree."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found[_module_name(path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found


def _imported(name, path, tree):
    """Every dotted name one file imports, relative imports resolved, with its line.

    ``from x import y`` gives ``x.y``: a module when y is one, else a name in x.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _edges(modules):
    """(importer, imported module) for every import between autoshard's files.

    A name resolves to the longest autoshard module it starts with: ``from autoshard.x
    import y`` counts as an import of ``autoshard.x.y`` when y is a module, and of
    ``autoshard.x`` (its ``__init__`` for a package) otherwise.
    """
    edges = set()
    for name, (path, tree) in modules.items():
        for target, _ in _imported(name, path, tree):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("autoshard") and target != name:
                edges.add((name, target))
    return edges


def test_no_import_cycles():
    """No cycle among autoshard's modules, counting imports inside functions and TYPE_CHECKING."""
    graph = nx.DiGraph(_edges(_modules()))
    tangled = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not tangled, "import cycles among:\n" + "\n".join(", ".join(c) for c in tangled)


def test_graph_imports_no_torch():
    """autoshard/graph/ holds pure graph algorithms: no torch, anywhere in it."""
    found = []
    for name, (path, tree) in _modules().items():
        if name == "autoshard.graph" or name.startswith("autoshard.graph."):
            for target, line in _imported(name, path, tree):
                if target.split(".")[0] == "torch":
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    found = sorted(set(found))
    assert not found, "autoshard/graph/ imports torch:\n" + "\n".join(found)
