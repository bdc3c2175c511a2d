"""Rebuilding the stages a plan file describes: the plan's own pipeline, its split replaced."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from torch import nn

from autoshard.errors import InvalidArgumentTypeError, PlanError, SpecError, user_stacklevel
from autoshard.plan_format.files import read_plan
from autoshard.plan_format.fits import StalePlanWarning, weight_size_changes
from autoshard.plan_format.model import SavedPlan
from autoshard.plan_origin import PlanOrigin
from autoshard.specialize import MAX_SPECIALIZATIONS

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.costs.memory_model import MemoryModel
    from autoshard.passes.pipeline import Pipeline
    from autoshard.sharded import ShardedModel


def rebuild_pipeline(plan: SavedPlan, path: str | Path, *, verify: bool = True) -> "Pipeline":
    """The plan's own pipeline with its split replaced by ``load-partition{path=...}``.

    The passes before the split capture the same graph; the ones after it (emit, verify) build and
    check the stages. Those that only instruct the split (``cut-before``, ``pin``, ``no-split``:
    constraints) are left out, as it is: the saved assignment met them. ``verify=False`` leaves out
    the passes that verify.
    """
    from autoshard.passes.base import ShardProgram
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
        elif step.provides and step.provides <= ShardProgram.INSTRUCTIONS:
            continue
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
    respecialize: bool = True,
    max_specializations: int = MAX_SPECIALIZATIONS,
) -> "ShardedModel":
    """Rebuild the stages a saved plan describes, for ``model``.

    Runs the plan's pipeline with its split replaced by the saved assignment, so the stages are
    the ones the plan was saved from; with example inputs they are verified against the model.
    ``load_plan(model, path, ...)`` works too.
    The plan keeps the memory model it was made for (optimizer bytes, microbatches in flight).
    With example inputs and ``respecialize``, calls the plan's guards refuse are captured again
    under its partition, as ``shard_model``'s are (``autoshard.specialize``), at most
    ``max_specializations`` times.
    """
    from autoshard.api import check_flags, check_model, example_inputs_of, run_pipeline, specializer_for
    from autoshard.arguments import whole_number
    from autoshard.passes.pipeline import Pipeline

    if isinstance(path, nn.Module) and isinstance(model, (str, os.PathLike)):
        path, model = model, path  # load_plan(model, path): the order is told apart by type
    if isinstance(path, nn.Module):
        raise InvalidArgumentTypeError(
            f"load_plan takes the plan file first, then the model: load_plan(path, model, example_inputs), "
            f"got the {type(path).__name__} first")
    check_model(model)
    check_flags(verify=verify, respecialize=respecialize)
    max_specializations = whole_number(max_specializations, "max_specializations", at_least=0)
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
    original = Pipeline.parse(saved.pipeline)  # (rebuild_pipeline checked that it parses)
    if respecialize and inputs is not None:
        program.sharded.specializer = specializer_for(model, saved.num_stages, original, saved.cost_model,
                                                      saved.memory_model, inputs, max_specializations,
                                                      program.sharded)
    if inputs is not None:
        plan = program.sharded.plan
        warn_over_saved_budget(plan.dag, plan.assignment, plan.num_stages, plan.memory_model, saved, path)
    return program.sharded


def saved_budgets(saved: SavedPlan) -> tuple[float, ...]:
    """The training-memory budgets ``saved``'s split was made under, as its pipeline gives them (one
    value: every stage's); none without any, or where they capped another cost (``memory-cost``).
    Read off the spec's text: a saved pipeline may name passes this process has not registered."""
    from autoshard.passes.spec import parse_spec

    for element in parse_spec(saved.pipeline):
        options = {option.key: option.values for option in element.options}
        if options.get("max-memory"):
            cost = options.get("memory-cost")
            return () if cost and cost[0].text != "memory" else tuple(float(v.text) for v in options["max-memory"])
    return ()


def warn_over_saved_budget(dag: Any, assignment: Mapping[str, int], num_stages: int, memory_model: "MemoryModel",
                           saved: SavedPlan, path: str | Path) -> None:
    """A plan made under ``max_memory`` and rebuilt with inputs of another size (a longer sequence, a
    bigger microbatch), or for other training settings (``--schedule``, ``--microbatches``), may hold
    more than the budget it was made for: say which stage, by how much (``load_plan``, ``--plan``)."""
    from autoshard.costs.memory import memory_shortfall, stage_memory
    from autoshard.costs.split_search.request import per_stage

    budgets = saved_budgets(saved)
    if not budgets:
        return
    short = memory_shortfall(stage_memory(dag, assignment, num_stages, memory_model), per_stage(budgets, num_stages))
    if short is not None:
        warnings.warn(StalePlanWarning(
            f"plan {path} was made under max_memory {', '.join(f'{b:,.0f}' for b in budgets)} bytes, and on these "
            f"example inputs and training settings {short}"), stacklevel=user_stacklevel())
