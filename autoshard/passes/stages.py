"""How many stages a run makes: the one place that reconciles the counts that may be given.

The caller asks for a count (``shard_model``'s ``num_stages``, the command line's ``--stages``);
a spec may write its own (``split{stages=N}``); a saved plan has one; and the partition a run
makes has one. ``bind_stages`` gives the asked count to every pass that takes ``stages`` and did
not write it, ``check_stages_made`` holds the result to it, and ``stages_conflict`` is the one
refusal when two counts disagree.
"""

from __future__ import annotations

from autoshard.arguments import whole_number
from autoshard.errors import InvalidArgumentError
from autoshard.passes.base import Pass
from autoshard.passes.pipeline import Pipeline

__all__ = ["bind_stages", "check_stages_made", "no_stage_count", "stages_conflict", "takes_stages"]


def takes_stages(step: Pass) -> bool:
    """Whether ``step`` has a ``stages`` option (the split passes)."""
    return any(f.name == "stages" for f in step.options())


def stages_conflict(asked: int, source: str, verb: str, count: int, fix: str,
                    error: type[InvalidArgumentError] = InvalidArgumentError) -> InvalidArgumentError:
    """The refusal when ``source`` ``verb`` (has, made) ``count`` stages and ``asked`` were asked for."""
    return error(f"{asked} stages were asked for but {source} {verb} {count} stages, not {asked}; {fix}")


def bind_stages(pipeline: Pipeline, asked: int, asker: str = "num_stages") -> Pipeline:
    """``pipeline`` with every pass that takes ``stages`` given ``asked``, unless its spec wrote the
    count; a spec that wrote another count is refused rather than guessed between. ``asker`` names
    where ``asked`` came from, for the errors."""
    asked = whole_number(asked, asker, at_least=1)
    for index, step in enumerate(pipeline):
        if not takes_stages(step):
            continue
        if not pipeline.sets_option(index, "stages"):
            pipeline = pipeline.with_options(index, stages=asked)
        elif step.stages != asked:
            raise stages_conflict(asked, f"the pipeline's `{pipeline.step_spec(index)}` (position {index})", "has",
                                  step.stages,
                                  f"make {asker} and the spec agree, or leave stages out of the spec")
    return pipeline


def check_stages_made(asked: int, made: int, pipeline: Pipeline) -> None:
    """Refuse a result with another number of stages than asked for: a pipeline whose partition
    does not come from a split given the count (a loaded plan, a user's pass) can make any."""
    if made != asked:
        raise stages_conflict(asked, f"the pipeline '{pipeline}'", "made", made,
                              "its partition does not come from a split given the stage count (a loaded plan, "
                              f"a pass of yours); ask for {made}")


def no_stage_count(step: Pass) -> InvalidArgumentError:
    """The refusal of a split run with no count: neither the caller nor the spec gave one."""
    return InvalidArgumentError(f"'{step.name}' needs a stage count: write {step.name}{{stages=K}}, or pass "
                                "the pipeline to shard_model(model, K, pipeline=...)")
