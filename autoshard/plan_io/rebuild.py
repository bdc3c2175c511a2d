"""Rebuilding the stages a plan file describes: the plan's own pipeline, its split replaced."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import networkx as nx
from torch import nn

from autoshard.errors import InvalidArgumentTypeError, PlanError, SpecError
from autoshard.plan_io.files import read_plan
from autoshard.plan_io.from_program import versions
from autoshard.plan_io.model import SavedPlan
from autoshard.plan_io.origin import PlanOrigin

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.passes.pipeline import Pipeline
    from autoshard.sharded import ShardedModel


def check_fits(plan: SavedPlan, dag: nx.DiGraph, source: str) -> None:
    """Raise ``PlanError`` unless ``dag`` (the model's graph today) is the graph the plan was made for."""
    problems = _differences("node", [n.name for n in plan.nodes], list(dag.nodes))
    problems += _differences("edge", [f"{u} -> {v}" for u, v in plan.edges], [f"{u} -> {v}" for u, v in dag.edges])
    if problems:
        here = versions()
        made = ", ".join(f"{k} {v}" for k, v in plan.versions.items()) or "unknown versions"
        raise PlanError(
            f"plan {source} was made for another graph ({'; '.join(problems)}). It was made for "
            f"{plan.model or 'a model'} with {made}; here: {', '.join(f'{k} {v}' for k, v in here.items())}. "
            "Make a new plan for this model with `autoshard split TARGET --stages K --out PLAN.json`"
        )


class StalePlanWarning(UserWarning):
    """A plan loaded into a model whose weights have other sizes than those it was made for."""


def weight_size_changes(plan: SavedPlan, dag: nx.DiGraph) -> list[str]:
    """The weights (by the plan's names) whose size in ``dag`` differs from the plan's: the same
    graph with other widths, whose split the plan's balance no longer describes."""
    now = dag.graph.get("weights", {})
    return [f"'{name}' has {now[name].numel:,} elements here, {info.numel:,} in the plan"
            for name, info in plan.weights.items() if name in now and now[name].numel != info.numel]


def _differences(kind: str, planned: Sequence[str], actual: Sequence[str]) -> list[str]:
    planned_set, actual_set = set(planned), set(actual)
    only_plan = [x for x in planned if x not in actual_set]
    only_graph = [x for x in actual if x not in planned_set]
    out = []
    if only_graph:
        out.append(f"{len(only_graph)} {kind}(s) of the model are not in the plan, e.g. {only_graph[0]!r}")
    if only_plan:
        out.append(f"{len(only_plan)} {kind}(s) of the plan are not in the model, e.g. {only_plan[0]!r}")
    return out


def rebuild_pipeline(plan: SavedPlan, path: str | Path, *, verify: bool = True) -> "Pipeline":
    """The plan's own pipeline with its split replaced by ``load-partition{path=...}``.

    The passes before the split capture the same graph; the ones after it (emit, verify) build and
    check the stages. ``verify=False`` leaves out the passes that verify.
    """
    from autoshard.passes.pipeline import Pipeline
    from autoshard.passes.plan import LoadPartitionPass

    try:
        original = Pipeline.parse(plan.pipeline)
    except SpecError as exc:
        raise PlanError(f"plan {path} was made with the pipeline {plan.pipeline!r}, "
                        f"which cannot run here: {exc}") from exc
    steps = []
    for step in original:
        if "partition" in step.provides:
            if not any(isinstance(s, LoadPartitionPass) for s in steps):
                steps.append(LoadPartitionPass(path=str(path)))
        elif verify or "verification" not in step.provides:
            steps.append(step)
    if not any(isinstance(s, LoadPartitionPass) for s in steps):
        raise PlanError(f"plan {path} has a pipeline with no split ({plan.pipeline!r}); nothing to replace")
    return Pipeline(steps)


def load_plan(
    path: str | Path,
    model: "nn.Module",
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    verify: bool = True,
    instruments: Iterable[Any] = (),
) -> "ShardedModel":
    """Rebuild the stages a saved plan describes, for ``model``.

    Runs the plan's pipeline with its split replaced by the saved assignment, so the stages are
    the ones the plan was saved from; with example inputs they are verified against the model.
    ``load_plan(model, path, ...)`` works too.
    The plan keeps the memory model it was made for (optimizer bytes, microbatches in flight).
    """
    from autoshard.api import check_model, example_inputs_of, run_pipeline

    if isinstance(path, nn.Module) and isinstance(model, (str, os.PathLike)):
        path, model = model, path  # load_plan(model, path): the order is told apart by type
    if isinstance(path, nn.Module):
        raise InvalidArgumentTypeError(
            f"load_plan takes the plan file first, then the model: load_plan(path, model, example_inputs), "
            f"got the {type(path).__name__} first")
    check_model(model)
    inputs = example_inputs_of(example_inputs, example_kwargs)
    saved = read_plan(path)
    pipeline = rebuild_pipeline(saved, path, verify=verify and inputs is not None)
    needing = [step.name for step in pipeline if "example_inputs" in step.requires]
    if inputs is None and needing:
        raise PlanError(f"plan {path} was made with example inputs (its pipeline runs {', '.join(needing)}, which "
                        "measures the graph on them); pass example inputs of the same kind to load_plan")
    program = run_pipeline(model, pipeline, inputs, instruments, memory_model=saved.memory_model).program
    if program.sharded is None:
        raise PlanError(f"plan {path}'s pipeline {pipeline} builds no stages; it must end with 'emit'")
    split = None if weight_size_changes(saved, program.dag) else saved.split
    program.sharded.plan_origin = PlanOrigin.rebuilt(saved, program, split)
    return program.sharded
