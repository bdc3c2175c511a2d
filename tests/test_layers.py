"""The layer rules, held by a short AST check.

Every ``import`` of an autoshard module is counted: at the top of a file, inside a
function, under ``if TYPE_CHECKING:``. No cycle may form among autoshard's files,
``autoshard/graph/`` (pure graph algorithms) may not import torch at all, and no module
imports one in a higher layer (``LAYERS``).
"""

import ast
import functools
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "autoshard"

LAYERS = (
    # Shared value types and helpers every layer may import; the package root imports its
    # subpackages lazily (importlib), so it holds nothing up. ``isolation`` runs the model or a graph
    # of it without leaving a trace on it, as the cost runs, capture, verify and the runtime all do.
    ("base", ("autoshard", "errors", "arguments", "inputs", "fx_helpers", "progress", "generators", "examples",
              "isolation")),
    ("graph", ("graph", "testing")),  # pure graph algorithms (no torch), and the splitter test kit over them
    ("costs", ("costs",)),  # values, FLOPs, memory, times, cost models
    ("lowering", ("lowering",)),  # fx graph -> DAG, in-place and randomness orderings; reads costs.facts
    ("capture", ("capture", "emit", "verify")),  # capture, stage emission and the check against eager
    ("sharded", ("sharded", "specialize")),  # the result type and its re-specialisation
    ("plan_format", ("plan_format",)),  # plan files as data, read and written; the load-partition pass reads them
    ("passes", ("passes",)),
    # shard_model, and plans made from a run (plan_origin: from the passes' costs, and the PlanOrigin
    # that shard_model hands the stages for save_plan)
    ("api", ("api", "plan_origin")),
    ("plan_io", ("plan_io",)),  # plan files' public face, and load_plan, which rebuilds stages through the api
    ("runtime", ("runtime",)),
    ("reporting", ("report", "plan_reporting", "render", "targets")),  # what cli shows, and what it loads
    ("cli", ("cli", "commands", "__main__")),  # the parser, and the commands it runs
)
"""Lowest first; a module may import its own layer and the ones below. The issue states the
order as graph <- costs <- capture <- passes <- api <- runtime, plan_io <- cli."""


def _module_name(path):
    """The dotted name of one file under autoshard/."""
    parts = ["autoshard", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules():
    """Each autoshard module's dotted name, with its file and parsed tree (parsed once per run)."""
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


def _layer(module):
    """The index in ``LAYERS`` of the layer holding ``module`` (by its top-level unit), or None."""
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else "autoshard"
    return next((i for i, (_, units) in enumerate(LAYERS) if unit in units), None)


def test_no_import_cycles():
    """No cycle among autoshard's modules, counting imports inside functions and TYPE_CHECKING."""
    graph = nx.DiGraph(_edges(_modules()))
    tangled = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not tangled, "import cycles among:\n" + "\n".join(", ".join(c) for c in tangled)


def test_every_module_sits_in_a_layer():
    """A new package or top-level module must be given its place in ``LAYERS``."""
    unplaced = sorted(name for name in _modules() if _layer(name) is None)
    assert not unplaced, "modules in no layer (add them to LAYERS):\n" + "\n".join(unplaced)


def test_no_module_imports_a_higher_layer():
    """The layer order holds for every import."""
    upward = sorted((a, b) for a, b in _edges(_modules()) if _layer(a) < _layer(b))
    assert not upward, "imports of a higher layer:\n" + "\n".join(
        f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})" for a, b in upward)


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
