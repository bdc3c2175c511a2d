"""What a pipeline's passes need, checked before any of them runs (``Pipeline.validate``).

Each pass needs its ``requires`` and what its options call for (``Pass.needs``); the inputs and
the passes before it provide them. Two kinds of artifact follow extra rules:

* measurements (``ShardProgram.MEASUREMENTS``: ``facts``, ``times``) describe the traced graph's
  nodes. ``build-dag`` copies them onto the DAG, so a pass that needs one and the DAG needs a DAG
  built after the pass that measured it; a new capture (a pass that provides ``traced`` without
  requiring it) has none of them until they are measured again;
* instructions (``ShardProgram.INSTRUCTIONS``: ``constraints``) must be read by a later pass.

The user's order is the order: errors say what to add or move, nothing is inserted or reordered.
"""

from __future__ import annotations

from typing import Sequence

from autoshard.errors import PipelineValidationError
from autoshard.passes.base import Pass, ShardProgram
from autoshard.passes.registry import PassRegistry, default_registry

__all__ = ["INPUT_ARTIFACTS", "Availability", "check_instructions_read", "dropped_by"]

INPUT_ARTIFACTS: dict[str, str] = {
    "model": "pass the model",
    "example_inputs": "pass example inputs (shard_model(model, k, example_inputs=...); on the command line, a "
                      "factory returning (model, args) or (model, args, kwargs); to Pipeline.run, "
                      "ShardProgram(model, example_inputs=ExampleInputs(args, kwargs)))",
}
"""Artifacts that come from the caller rather than from a pass, with what to tell the user."""


def captures(step: Pass | type[Pass]) -> bool:
    """Whether ``step`` makes the traced graph afresh (``trace``, ``capture``, ``export``) rather than
    rewriting the one it is given (``shape-prop``, ``profile``, which keep what the nodes carry)."""
    return "traced" in step.provides and "traced" not in step.requires


def dropped_by(step: Pass) -> frozenset[str]:
    """The measurements ``step`` makes stale: those of the graph it replaces by a new capture."""
    return ShardProgram.MEASUREMENTS - step.provides if captures(step) else frozenset()


class Availability:
    """What the inputs and the passes walked so far provide, and where each came from."""

    def __init__(self, initial: frozenset[str], passes: Sequence[Pass], spec: str, registry: PassRegistry) -> None:
        self.available = set(initial)
        self.made_at: dict[str, int] = {}
        self.dropped_at: dict[str, int] = {}
        # A DAG the caller gives may carry any measurement; only the cost models can tell.
        self.on_dag = set(ShardProgram.MEASUREMENTS) if "dag" in initial else set()
        self.dag_at: int | None = None
        self.passes, self.spec, self.registry = passes, spec, registry

    def missing(self, step: Pass) -> list[str]:
        """What ``step`` needs and does not have, in the order of the program's fields. A measurement
        needed together with the DAG counts only when the DAG was built after it."""
        needs = step.needs()
        have = (self.available - ShardProgram.MEASUREMENTS) | self.on_dag if "dag" in needs else self.available
        order = {n: i for i, n in enumerate(ShardProgram.artifact_names())}
        return sorted(needs - have, key=lambda a: (order.get(a, len(order)), a))

    def add(self, index: int, step: Pass) -> None:
        """Take in what the pass at ``index`` provides and drops."""
        for artifact in dropped_by(step):
            self.available.discard(artifact)
            self.dropped_at[artifact] = index
        for artifact in step.provides:
            self.available.add(artifact)
            self.made_at[artifact] = index
        if "dag" in step.provides:
            self.on_dag = self.available & ShardProgram.MEASUREMENTS
            self.dag_at = index

    def refuse(self, index: int, step: Pass, missing: list[str]) -> PipelineValidationError:
        """The error for the pass at ``index``: what it needs, and what to do about each."""
        needs = ", ".join(f"'{a}'" for a in missing)
        return PipelineValidationError(
            f"pass '{step.name}' (position {index} in pipeline `{self.spec}`) needs {needs}, which nothing "
            f"before it provides: " + "; ".join(self.hint(a, index) for a in missing))

    def hint(self, artifact: str, index: int) -> str:
        if artifact in INPUT_ARTIFACTS:
            return f"'{artifact}' comes from the inputs, not from a pass: {INPUT_ARTIFACTS[artifact]}"
        if artifact in ShardProgram.MEASUREMENTS:
            return self._measurement_hint(artifact, index)
        later = [(j, q.name) for j, q in enumerate(self.passes) if j > index and artifact in q.provides]
        if later:
            j, name = later[0]
            return f"'{artifact}' is provided by `{name}` at position {j}, after it: move `{name}` before it"
        return self._add_hint(artifact, "before it")

    def _measurement_hint(self, artifact: str, index: int) -> str:
        """Where the pass measuring ``artifact`` belongs: after the last capture, before the DAG is built."""
        builder = "`build-dag`" if self.dag_at is None else f"`{self.passes[self.dag_at].name}` ({_at(self.dag_at)})"
        made = self.made_at.get(artifact)
        if made is not None and self.dag_at is not None and made > self.dag_at:
            name = self.passes[made].name
            return (f"'{artifact}' is measured by `{name}` ({_at(made)}), after {builder} built the DAG that "
                    f"carries it to '{self.passes[index].name}': move `{name}` before {builder}")
        dropped = self.dropped_at.get(artifact)
        if made is not None and dropped is not None and dropped > made:
            name, capture = self.passes[made].name, self.passes[dropped].name
            return (f"`{capture}` ({_at(dropped)}) captures the graph again after `{name}` ({_at(made)}) measured "
                    f"'{artifact}', and a new graph has none: move `{name}` after `{capture}`")
        # A registry of a few passes (in tests, a plugin's) may lack the measuring pass: name the built-in one.
        registry = self.registry if self.registry.providers(artifact) else default_registry
        capturing = sorted(cls.name for cls in registry.loadable() if captures(cls))
        after = f"after the capture ({_alternatives(capturing)}) and " if capturing else ""
        return self._add_hint(artifact, f"{after}before {builder}", registry)

    def _add_hint(self, artifact: str, where: str, registry: PassRegistry | None = None) -> str:
        registry = registry or self.registry
        providers = registry.providers(artifact)
        if not providers:
            return f"no registered pass provides '{artifact}'"
        choice = f"`{providers[0]}`" if len(providers) == 1 else "one of " + ", ".join(f"`{n}`" for n in providers)
        measures = artifact in ShardProgram.MEASUREMENTS and any(
            "example_inputs" in cls.requires for cls in registry.loadable() if cls.name in providers)
        what = "measures it on the example inputs" if measures else f"provides '{artifact}'"
        if measures and "example_inputs" not in self.available:  # adding the pass alone would be refused next
            what += f", and none were given: {INPUT_ARTIFACTS['example_inputs']}"
        return f"add {choice} {where} (it {what})"


def _at(index: int) -> str:
    return f"position {index}"


def _alternatives(names: Sequence[str]) -> str:
    """The names as alternatives in a sentence: `a`, `b` or `c`."""
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def check_instructions_read(passes: Sequence[Pass], spec: str, registry: PassRegistry,
                            initial: frozenset[str]) -> None:
    """Refuse an instruction (``constraints``) that no pass after its provider reads:
    a ``pin`` after the split, or in a pipeline with none, would change nothing in silence."""
    given = [(-1, "the call", a) for a in initial & ShardProgram.INSTRUCTIONS]
    given += [(i, f"pass '{p.name}' (position {i})", a) for i, p in enumerate(passes)
              for a in p.provides & ShardProgram.INSTRUCTIONS]
    for index, who, artifact in given:
        if any(artifact in q.needs() | q.reads for q in passes[index + 1:]):
            continue
        readers = [f"'{q.name}' (position {j})" for j, q in enumerate(passes) if artifact in q.needs() | q.reads]
        readable = sorted(cls.name for cls in registry.loadable() if artifact in cls.reads)
        where = (f"only {', '.join(readers)} before it reads it: move it before {readers[0]}" if readers else
                 f"no pass of the pipeline reads it: add one that does ({', '.join(readable)})")
        raise PipelineValidationError(f"{who} provides '{artifact}' in pipeline `{spec}`, but {where}")
