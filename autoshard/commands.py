"""The autoshard command's work once its arguments parse: the commands, and their failures and
warnings shown as one message each.

Kept apart from the parser (``autoshard.cli``) because it imports the library, torch included
(seconds): ``--help``, ``--version`` and a usage error are answered without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autoshard import progress
from autoshard.api import (
    bind_pipeline, check_stages_made, default_pipeline, example_inputs_of, stage_limits, steps_at, without_verify,
)
from autoshard.arguments import byte_count, bytes_per_second, is_bare_number, whole_number
from autoshard.costs.estimate import DeviceModel, device_model
from autoshard.costs.memory import memory_shortfall
from autoshard.costs.memory_model import INTERLEAVED_STAGES_PER_RANK, OPTIMIZER_BYTES, SCHEDULES, MemoryModel
from autoshard.costs.split_search.request import per_stage
from autoshard.costs.step_time import StepTimeModel, run_of
from autoshard.errors import (
    AutoshardError,
    ExampleInputsError,
    InfeasibleSplitError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MissingDependencyError,
    PlanError,
    ShapePropagationError,
    plural,
    suggest,
)
from autoshard.examples import EXAMPLES
from autoshard.passes.analyses import memory_model, use_memory_model
from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram
from autoshard.passes.constrain import with_constraints
from autoshard.passes.instruments import DumpDir, Instrument, Timing
from autoshard.passes.pipeline import Pipeline
from autoshard.passes.registry import registered_passes
from autoshard.passes.stages import stages_conflict, takes_stages
from autoshard.passes.options import option_table
from autoshard.plan_io import (
    SavedPlan, plan_from_program, read_plan, rebuild_pipeline, report_costs, save_plan, weight_size_changes,
)
from autoshard.plan_io.rebuild import saved_budgets, warn_over_saved_budget
from autoshard.report import (PIPED_WIDTH, budget_lines, compare_tables, plan_renderables, served_line,
                              step_time_lines)
from autoshard.runtime.stage_time import TIMING_REPEATS
from autoshard.targets import FACTORY_WITH_INPUTS, TargetError, check_inputs_bind, load_target


class _ShowPasses(Instrument):
    """Names the pass under way on the progress bar and advances it when the pass ends."""

    def __init__(self, advance: progress.Advance) -> None:
        self.advance = advance

    def before_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        self.advance.describe(f"autoshard: {pass_.name}")

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        self.advance(1)


@dataclass(frozen=True)
class _Choice:
    """The pipeline to run, the spec to record, the split's cost model, and the plan it rebuilds."""

    pipeline: Pipeline
    spec: str
    cost_model: str
    saved: SavedPlan | None = None


class _Session:
    """One command's model, inputs and instruments; runs pipelines with progress, timing and dumps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = _device(args)
        model, ex_args, ex_kwargs = load_target(args.target)
        self.inputs = example_inputs_of(ex_args or None, ex_kwargs or None)
        if self.inputs is not None:
            check_inputs_bind(model, self.inputs.args, self.inputs.kwargs)
        self.program = ShardProgram(model=model, example_inputs=self.inputs)
        self.timing = Timing() if args.timing else None
        instruments: list[Instrument] = [self.timing] if self.timing else []
        if args.dump_dir:
            instruments.append(DumpDir(args.dump_dir))
        self.ctx = PassContext(instruments=instruments)
        self.args = args
        self.memory = _memory_model(args)
        if self.memory is not None:
            use_memory_model(self.ctx, self.memory)

    def run(self, pipeline: Pipeline, program: ShardProgram | None = None,
            whole: Pipeline | None = None) -> ShardProgram:
        """Run ``pipeline`` (a part of ``whole``, when given) on ``program`` or the model; a failure
        gets the command that reproduces it (``_reproduction``)."""
        with progress.task("autoshard", total=len(pipeline)) as advance:
            shown = _ShowPasses(advance)
            self.ctx.instruments.append(shown)
            try:
                return pipeline.run(program or self.program, self.ctx).program
            except AutoshardError as exc:
                command = _reproduction(self.args, whole or pipeline, self.memory)
                if command is not None:
                    exc.add_note(f"reproduce on the command line: {command}")
                if isinstance(exc, InfeasibleSplitError) and _bare_numbers(getattr(self.args, "max_memory", None)):
                    exc.add_note(f"--max-memory {self.args.max_memory} is in bytes: give a unit for more, such as "
                                 "40GiB or 512MB")
                raise
            finally:
                self.ctx.instruments.remove(shown)

    def plan(self, program: ShardProgram, choice: _Choice) -> tuple[SavedPlan, Sequence[str]]:
        """The plan of ``program``; a rebuilt plan keeps the saved one's record of its split (unless the
        model's weights have other sizes now) and, unless a device was given, its device model, so the
        same plan file comes out again."""
        saved = choice.saved
        device = self.device or (saved.time_estimate if saved is not None else None)
        reported = report_costs(program, self.ctx, choice.cost_model, device)
        split = saved.split if saved is not None and not weight_size_changes(saved, program.dag) else None
        plan = plan_from_program(program, choice.spec, choice.cost_model, reported.costs,
                                 time_estimate=reported.time_estimate, time_backward=reported.time_backward,
                                 split=split, memory_model=memory_model(self.ctx))
        return plan, reported.notes if self.inputs is not None else (self.without_inputs(),)

    def without_inputs(self) -> str:
        """What a factory that returned no example inputs costs the plan, and what to return instead:
        one line in place of the library's notes on each cost it could not measure."""
        return (f"no example inputs: {self.args.target} returned the model alone, so value sizes, FLOPs and times "
                f"are not measured and the stages are not verified; make it return {FACTORY_WITH_INPUTS}")

    def keep_saved_memory_model(self, saved: SavedPlan) -> None:
        """A rebuilt plan reports training memory with the model it was made for; a memory flag the
        command gave replaces that value only, not the other one the plan saved."""
        self.memory = _memory_model(self.args, saved.memory_model)
        use_memory_model(self.ctx, self.memory)


def _device(args: argparse.Namespace) -> DeviceModel | None:
    """The device the user described with --device-tflops / --device-bandwidth; None: not described."""
    if args.device_tflops is not None and not (math.isfinite(args.device_tflops) and args.device_tflops > 0):
        raise InvalidArgumentError(f"--device-tflops must be a number > 0, got {args.device_tflops!r}")
    if args.device_tflops is None and args.device_bandwidth is None:
        return None
    bandwidth = None if args.device_bandwidth is None else \
        bytes_per_second(args.device_bandwidth, "--device-bandwidth", "GB/s") / 1e9
    return device_model(args.device_tflops, bandwidth)


def _memory_model(args: argparse.Namespace, saved: MemoryModel | None = None) -> MemoryModel | None:
    """``saved`` (a rebuilt plan's memory model, else the default) with the values given by the memory
    flags (--optimizer, --optimizer-bytes, --schedule, --stages-per-rank, --microbatches,
    --master-weights, --optimizer-foreach, --keep-gradients): a flag left out keeps the saved value
    rather than resetting it. None when no flag is given and nothing is saved."""
    given: dict[str, object] = {}
    if args.optimizer is not None:
        given["optimizer"] = _named(args.optimizer, "--optimizer", tuple(OPTIMIZER_BYTES))
        given["optimizer_bytes_per_param"] = None  # the named optimizer's own state, unless given below
    if args.optimizer_bytes is not None:
        given["optimizer_bytes_per_param"] = args.optimizer_bytes
    given.update(_schedule_given(args, saved))
    if args.microbatches is not None:
        given["microbatches"] = whole_number(args.microbatches, "--microbatches", at_least=1)
    if args.master_weights is not None:
        given["master_weights"] = args.master_weights
    if args.optimizer_foreach is not None:
        given["optimizer_foreach"] = args.optimizer_foreach
    if args.keep_gradients is not None:
        given["keep_gradients"] = args.keep_gradients
    if not given:
        return saved
    return dataclasses.replace(saved or MemoryModel(), **given)


def _schedule_given(args: argparse.Namespace, saved: MemoryModel | None) -> dict[str, object]:
    """--schedule and --stages-per-rank as memory-model fields. A schedule other than the saved one
    runs its own stages per rank unless the flag sets them, which only interleaved 1F1B runs several
    of: refused for another schedule (with --plan, once the saved schedule is known)."""
    schedule = (saved or MemoryModel()).schedule
    given: dict[str, object] = {}
    if args.schedule is not None:
        given["schedule"] = _named(args.schedule, "--schedule", SCHEDULES)
        if given["schedule"] != schedule:
            given["stages_per_rank"] = None
        schedule = given["schedule"]
    if args.stages_per_rank is None:
        return given
    per_rank = whole_number(args.stages_per_rank, "--stages-per-rank", at_least=1)
    if schedule == "interleaved-1f1b":
        given["stages_per_rank"] = per_rank
    elif saved is not None or not args.plan:
        raise InvalidArgumentError(
            f"--stages-per-rank sets how many stages each process runs under --schedule interleaved-1f1b, and "
            f"the schedule here is {schedule}, which runs one: add --schedule interleaved-1f1b, or drop "
            "--stages-per-rank")
    return given


def _reproduction(args: argparse.Namespace, pipeline: Pipeline, memory: MemoryModel | None) -> str | None:
    """The command that runs ``pipeline`` again with this run's memory flags, which its spec does not
    carry (the library's "reproduce with pipeline" alone would plan for Adam, 1F1B with stage j
    of k holding k - j microbatches); None without memory flags, where that spec is the whole story."""
    flags = _memory_flags(memory) if memory is not None else []
    if not flags:
        return None
    if args.plan:  # a rebuilt plan: its file, which keeps its own memory model too
        how = ["--plan", args.plan, *(["--no-verify"] if args.no_verify else [])]
    else:
        stages = next((step.stages for step in pipeline if takes_stages(step) and step.stages), args.stages)
        how = [*(["--stages", str(stages)] if stages else []), "--pipeline", str(pipeline)]
    return shlex.join(["autoshard", args.command, args.target, *how, *flags])


def _named(value: str, flag: str, known: Sequence[str]) -> str:
    """``value`` when it is one of ``known`` (any case), else a refusal naming the flag and the choices."""
    if value.lower() not in known:
        raise InvalidArgumentError(f"{flag} {value!r} is not one the memory model knows; "
                                   f"pick one of: {', '.join(known)}{suggest(value.lower(), known)}")
    return value.lower()


def _memory_flags(model: MemoryModel) -> list[str]:
    """The flags that set ``model``, for a command the user can copy; none for the default."""
    default = MemoryModel()
    flags = []
    if model.optimizer != default.optimizer:
        flags += ["--optimizer", model.optimizer]
    if model.optimizer_bytes_per_param is not None:
        flags += ["--optimizer-bytes", f"{model.optimizer_bytes_per_param:g}"]
    if model.schedule != default.schedule:
        flags += ["--schedule", model.schedule]
    if model.schedule == "interleaved-1f1b" and model.stages_per_rank != INTERLEAVED_STAGES_PER_RANK:
        flags += ["--stages-per-rank", str(model.stages_per_rank)]
    if model.microbatches is not None:
        flags += ["--microbatches", str(model.microbatches)]
    if model.master_weights:
        flags += ["--master-weights"]
    if model.optimizer_foreach is not None:
        flags += ["--optimizer-foreach" if model.optimizer_foreach else "--no-optimizer-foreach"]
    if model.keep_gradients:
        flags += ["--keep-gradients"]
    return flags


def _links(args: argparse.Namespace) -> dict[str, float]:
    """The link settings --link-bandwidth / --link-latency give, read and checked by ``StepTimeModel``
    (rates and times with units; a bare number is bytes/s or seconds) now rather than after the
    split (its messages name ``link_bandwidth``, which the errors show as the flag)."""
    given = {name: value for name, value in (("link_bandwidth", args.link_bandwidth),
                                             ("link_latency", args.link_latency)) if value is not None}
    read = StepTimeModel(**given)
    bare = args.link_bandwidth is not None and is_bare_number(args.link_bandwidth)
    if bare and read.link_bandwidth < 1e6:  # --device-bandwidth's bare number is GB/s: 25 meant as 25GB/s?
        warnings.warn(f"--link-bandwidth {args.link_bandwidth} is read as {read.link_bandwidth:g} bytes per second, "
                      "slower than any link; a bare number is bytes/s here (and GB/s for --device-bandwidth): give "
                      "the unit, as in --link-bandwidth 25GB/s or 200Gbit/s", UserWarning, stacklevel=2)
    return {name: getattr(read, name) for name in given}


def _step(links: dict[str, float], memory: MemoryModel) -> StepTimeModel | None:
    """The step the tables predict: the plan's schedule over the link given; None (the plan's
    schedule and the default link) when no link flag is given."""
    return dataclasses.replace(run_of(memory), **links) if links else None


def _timed_step_lines(program: ShardProgram, links: dict[str, float], memory: MemoryModel,
                      repeats: int) -> list[str]:
    """``--time-stages``: the step predicted from the stages timed whole on the example
    (``autoshard.runtime.predict_step``), over this machine's calibrated runtime (a link flag's values kept)."""
    from autoshard.runtime.predict import predict_step  # (it imports the pipelining runtime: seconds)

    step = dataclasses.replace(run_of(memory), **links)
    refused = step.refusal(len(program.sharded.stages))
    if refused is not None:
        return [f"step time (stages timed): not predicted: {refused}"]
    if program.example_inputs is None:
        raise InvalidArgumentError("--time-stages times the stages on the example inputs, and this TARGET gives none")
    inputs = program.example_inputs
    predicted = predict_step(program.sharded, inputs.args, inputs.kwargs, step=step, repeats=repeats)
    return step_time_lines(predicted, "stages timed")


def _bare_numbers(max_memory: str | None) -> bool:
    """Whether --max-memory was given as numbers without a unit (bytes), as in ``--max-memory 10``
    or ``1e3``: what ``float`` reads (``byte_count`` has refused anything else it would)."""
    if max_memory is None:
        return False
    try:
        [float(part) for part in max_memory.split(",")]
    except ValueError:
        return False
    return True


def _max_memory(args: argparse.Namespace) -> list[float] | float | None:
    """The per-stage budgets of --max-memory (one value: every stage); None when not given."""
    if args.max_memory is None:
        return None
    budgets = [byte_count(part, "--max-memory") for part in args.max_memory.split(",")]
    return budgets[0] if len(budgets) == 1 else budgets


# --------------------------------------------------------------------------------------------
# Choosing the pipeline
# --------------------------------------------------------------------------------------------
def _split_step(pipeline: Pipeline) -> tuple[int, Pass]:
    for index, step in enumerate(pipeline):
        if "partition" in step.provides:
            return index, step
    raise InvalidArgumentError(f"the pipeline '{pipeline}' has no split (no pass provides 'partition'); add 'split'")


def _stages(args: argparse.Namespace) -> int:
    if args.stages is None:
        raise InvalidArgumentError("say how many stages: --stages K (or rebuild a saved plan with --plan PLAN.json)")
    return whole_number(args.stages, "--stages", at_least=1)


def _chosen_pipeline(args: argparse.Namespace, inputs: ExampleInputs | None) -> _Choice:
    """The saved plan's pipeline with its split replaced (--plan), the user's spec, or the default one."""
    if args.plan:
        for flag, value in (("--pipeline", args.pipeline), ("--strategy", args.strategy), ("--cost", args.cost),
                            ("--tolerance", args.tolerance),
                            ("--time-profile", args.time_profile), ("--max-memory", args.max_memory),
                            ("--pin", args.pin), ("--no-split", args.no_split), ("--cut-before", args.cut_before)):
            if value is not None:
                check = (f"; to check the saved plan against a budget: autoshard inspect {args.plan} --max-memory "
                         f"{value}" if flag == "--max-memory" else "")
                raise InvalidArgumentError(f"{flag} cannot change a saved plan; drop it or drop --plan{check}")
        saved = read_plan(args.plan)
        if args.stages is not None and args.stages != saved.num_stages:
            raise stages_conflict(args.stages, f"plan {args.plan}", "has", saved.num_stages, "drop --stages", PlanError)
        verify = inputs is not None and not args.no_verify
        return _Choice(rebuild_pipeline(saved, args.plan, verify=verify), saved.pipeline, saved.cost_model, saved)
    cost = "params" if args.cost is None else args.cost  # (--cost '' is refused, not the default)
    if args.pipeline:
        if args.strategy is not None:
            raise InvalidArgumentError("with --pipeline, set the strategy in the spec: split{strategy=NAME}")
        if args.time_profile is not None:
            raise InvalidArgumentError("with --pipeline, write the profile in the spec: profile{path=FILE}")
        pipeline = bind_pipeline(args.pipeline, _stages(args), cost, max_memory=_max_memory(args),
                                 tolerance=args.tolerance or 0.0, asker="--stages")
    else:
        pipeline = default_pipeline(_stages(args), cost, verify=inputs is not None, time_profile=args.time_profile,
                                    max_memory=_max_memory(args), tolerance=args.tolerance or 0.0)
        if args.strategy is not None:
            pipeline = pipeline.with_options(_split_step(pipeline)[0], strategy=args.strategy)
    pipeline = with_constraints(pipeline, _pins(args), args.no_split, args.cut_before)
    if args.no_verify:
        pipeline = without_verify(pipeline)
    return _Choice(pipeline, str(pipeline), getattr(_split_step(pipeline)[1], "cost", "params"))


def _pins(args: argparse.Namespace) -> dict[str, int] | None:
    """``--pin NAME=STAGE`` flags as ``{name: stage}``."""
    if not args.pin:
        return None
    pins: dict[str, int] = {}
    for text in args.pin:
        name, _, stage = text.rpartition("=")
        if not name or not stage.strip().isdigit():
            raise InvalidArgumentError(f"--pin takes NAME=STAGE, such as encoder=0 or lm_head.weight=3; got {text!r}")
        if pins.setdefault(name.strip(), int(stage)) != int(stage):
            raise InvalidArgumentError(f"--pin {name.strip()} is given stage {pins[name.strip()]} and stage {stage}; "
                                       "give it once")
    return pins


# --------------------------------------------------------------------------------------------
# Showing and writing plans
# --------------------------------------------------------------------------------------------
def _show(plan: SavedPlan, title: str, console: Console, notes: Sequence[str] = (),
          step: StepTimeModel | None = None) -> None:
    for shown in plan_renderables(plan, title, notes, step):
        console.print(shown)


def _write(plan: SavedPlan, args: argparse.Namespace, console: Console) -> None:
    if args.out:
        written = save_plan(plan, args.out)
        _say(console, args, f"wrote the plan to {written}")
    for path in (args.svg, args.png):
        if path:
            from autoshard.render import draw_plan

            _say(console, args, f"wrote the picture {draw_plan(plan, path)}")


def _say(console: Console, args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        console.print(text, markup=False, highlight=False, soft_wrap=True)  # a path stays one line to copy


def _check_output_paths(args: argparse.Namespace) -> None:
    """Refuse a wrong suffix, a picture without matplotlib, or a file to write (a plan, a picture, a time
    profile not made yet) into a folder that does not exist, before the (slow) split rather than after it."""
    for flag, path in (("--svg", args.svg), ("--png", args.png)):
        if path and Path(path).suffix.lower() != "." + flag[2:]:
            raise InvalidArgumentError(f"{flag} writes a .{flag[2:]} file; got {path!r}")
    profile = getattr(args, "time_profile", None)
    written = [("--out", args.out), ("--svg", args.svg), ("--png", args.png),
               ("--time-profile", profile if profile and not Path(profile).exists() else None)]
    for flag, path in written:
        if path and not Path(path).parent.is_dir():
            raise InvalidArgumentError(f"{flag} writes {path!r}, but there is no folder {str(Path(path).parent)!r}: "
                                       "create it first, or give another path")
    if args.svg or args.png:
        from autoshard.render import import_matplotlib

        import_matplotlib()


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
def _compare(args: argparse.Namespace, session: _Session, choice: _Choice, console: Console) -> int:
    from autoshard.graph import strategies

    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    unknown = [f"{n!r}{suggest(n, strategies())}" for n in names if n not in strategies()]
    if unknown or not names:
        raise InvalidArgumentError(
            f"--compare takes strategy names separated by commas; unknown: {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(strategies())}")
    pipeline = choice.pipeline
    index, step = _split_step(pipeline)
    if "strategy" not in {f.name for f in step.options()}:
        raise InvalidArgumentError(f"--compare needs a split with a 'strategy' option; '{step.name}' has none")
    # Passes that only instruct the split (pin, no-split, cut-before) run with each split, after the rest.
    instructing = {i for i in range(index) if pipeline[i].provides & ShardProgram.INSTRUCTIONS}
    before = session.run(steps_at(pipeline, [i for i in range(index) if i not in instructing]), whole=pipeline)
    plans = {}
    for name in names:
        chosen = pipeline.with_options(index, strategy=name)
        chosen = chosen.with_options(index, **chosen[index].options_unused())  # a baseline drops the tolerance
        program = session.run(steps_at(chosen, [*sorted(instructing), index]), before, whole=chosen)
        plans[name], _ = session.plan(program, _Choice(chosen, str(chosen), choice.cost_model))
    if not args.quiet:
        for table in compare_tables(plans):
            console.print(table)
        _print_timing(session, console)
    return 0


def _compare_without_plan(args: argparse.Namespace) -> str:
    """Why --compare and --plan do not go together, and the command that compares strategies on the
    saved plan's pipeline and stage count (--strategy, which --plan refuses, is no way out)."""
    saved = read_plan(args.plan)
    memory = _memory_model(args, saved.memory_model)
    command = ["autoshard", args.command, args.target, "--stages", str(saved.num_stages),
               "--pipeline", saved.pipeline, *_memory_flags(memory), "--compare", args.compare]
    return ("--compare splits the model again with each strategy, which --plan (rebuild the saved split) does not "
            "do: drop --compare to rebuild, save or draw the saved plan, or drop --plan to compare strategies on its "
            f"pipeline and stage count: {shlex.join(command)}")


def _print_timing(session: _Session, console: Console) -> None:
    if session.timing is not None:
        console.print(session.timing.table())


def _plan_command(args: argparse.Namespace, console: Console, build: bool) -> int:
    _check_output_paths(args)
    if args.compare and args.plan:
        raise InvalidArgumentError(_compare_without_plan(args))
    if args.compare and (args.out or args.svg or args.png):
        raise InvalidArgumentError("--compare shows strategies side by side; "
                                   "run again with one --strategy to save or draw")
    links = _links(args)
    prints = {"--time-stages": "the step it predicts", "--timing": "the time each pass took"}
    asked = [flag for flag in prints if getattr(args, flag[2:].replace("-", "_"), False)]
    if args.quiet and asked:
        raise InvalidArgumentError(f"{asked[0]} prints {prints[asked[0]]}, and --quiet prints nothing: drop one")
    if args.compare and links:
        raise InvalidArgumentError("--link-bandwidth and --link-latency set the link of the predicted step time, "
                                   "which --compare does not show; drop them, or run again with one --strategy")
    if args.compare and getattr(args, "time_stages", False):
        raise InvalidArgumentError("--time-stages times the stages of one plan, which --compare does not build; drop "
                                   "it, or run again with one --strategy")
    if getattr(args, "time_repeats", None) is not None:
        whole_number(args.time_repeats, "--time-repeats", at_least=1)
        if not args.time_stages:
            raise InvalidArgumentError("--time-repeats sets how often --time-stages times each stage: add "
                                       "--time-stages, or drop --time-repeats")
    session = _Session(args)
    if getattr(args, "time_stages", False) and session.inputs is None:  # before the split, not after its tables
        raise InvalidArgumentError(f"--time-stages times the stages on the example inputs, and {args.target} returned "
                                   f"the model alone: make it return {FACTORY_WITH_INPUTS}, or drop --time-stages")
    choice = _chosen_pipeline(args, session.inputs)
    if choice.saved is not None:
        session.keep_saved_memory_model(choice.saved)
    if args.compare is not None:
        return _compare(args, session, choice, console)
    pipeline = choice.pipeline if build else choice.pipeline[: _split_step(choice.pipeline)[0] + 1]
    program = session.run(pipeline)
    plan, notes = session.plan(program, choice)
    if args.stages is not None:
        check_stages_made(args.stages, plan.num_stages, pipeline)
    if session.memory is not None:
        session.memory.all_in_flight(plan.num_stages)  # refuses a schedule these stages cannot run
    if choice.saved is not None and program.dag is not None and session.inputs is not None:
        warn_over_saved_budget(program.dag, program.partition.assignment, plan.num_stages, plan.memory_model,
                               choice.saved, args.plan)
    if not args.quiet:
        _show(plan, f"{args.target}: {plural(plan.num_stages, 'stage')} ({choice.spec})", console, notes,
              _step(links, plan.memory_model))
        if program.verification:
            console.print(f"verified: {program.verification}", markup=False, highlight=False)
        served = program.sharded.served_inputs() if program.sharded is not None else None
        if served:
            console.print(served_line(served), markup=False, highlight=False)
        if getattr(args, "time_stages", False):
            for line in _timed_step_lines(program, links, plan.memory_model, args.time_repeats or TIMING_REPEATS):
                console.print(line, markup=False, highlight=False)
        _print_timing(session, console)
    _write(plan, args, console)
    return 0


def cmd_split(args: argparse.Namespace, console: Console) -> int:
    return _plan_command(args, console, build=True)


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    if not args.target.endswith(".json"):
        return _plan_command(args, console, build=False)
    used = [flag for flag, value in (("--stages", args.stages), ("--pipeline", args.pipeline), ("--plan", args.plan),
                                     ("--compare", args.compare), ("--strategy", args.strategy), ("--cost", args.cost),
                                     ("--tolerance", args.tolerance),
                                     ("--time-profile", args.time_profile), ("--device-tflops", args.device_tflops),
                                     ("--device-bandwidth", args.device_bandwidth))
            if value is not None]
    if used:
        raise InvalidArgumentError(
            f"{', '.join(used)} cannot be used when inspecting a saved plan, which shows what it recorded; "
            "to plan again, inspect the model: autoshard inspect TARGET --stages K ...")
    _check_output_paths(args)
    links = _links(args)  # a link is no part of a plan: its step can be shown over any
    plan, budgets = _judged(read_plan(args.target), args)
    if not args.quiet:
        _show(plan, f"{args.target}: {plural(plan.num_stages, 'stage')} ({plan.pipeline})", console, (),
              _step(links, plan.memory_model))
        for line in budget_lines(plan, budgets) if budgets else ():  # the tables showed the plan's own
            console.print(line, markup=False, highlight=False)
    # (without --max-memory, the budgets the plan was made under: the table says whether it is over them)
    short = memory_shortfall(plan.training_memory() or [], budgets or per_stage(saved_budgets(plan), plan.num_stages))
    if short is not None:
        raise InfeasibleSplitError(f"plan {args.target} does not fit{'' if budgets else ' its own max_memory'}: "
                                   f"{short}")
    _write(plan, args, console)
    return 0


def _judged(plan: SavedPlan, args: argparse.Namespace) -> tuple[SavedPlan, tuple[float, ...]]:
    """A saved plan with its training memory counted under the memory flags given (the recorded sizes
    serve any optimizer, schedule or microbatch count: no model is needed), and the --max-memory
    budgets it is to be checked against (none when not given)."""
    memory = _memory_model(args, saved=plan.memory_model)
    given = _max_memory(args)
    if (memory != plan.memory_model or given is not None) and plan.training_memory() is None:
        raise InvalidArgumentError(
            "this saved plan records no sizes (it was made without shape-prop), so its training memory cannot be "
            "counted: drop the memory flags, or plan again with example inputs")
    budgets = () if given is None else stage_limits(plan.num_stages, max_memory=given)["max_memory"]
    return dataclasses.replace(plan, memory_model=memory), budgets


def cmd_passes(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="registered passes")
    for column in ("pass", "summary", "options", "requires → provides"):
        table.add_column(column, overflow="fold")
    for cls in registered_passes():
        options = ", ".join(f"{o.key}={o.default if o.default is not None else '(required)'}"
                            for o in option_table(cls))
        flow = f"{', '.join(sorted(cls.requires))} → {', '.join(sorted(cls.provides))}"
        table.add_row(cls.name, Text(cls.summary()), Text(options or "-"), flow)
    console.print(table)
    return 0


def cmd_examples(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="built-in examples (use as TARGET)")
    table.add_column("name")
    table.add_column("model")
    for name, (_, description) in sorted(EXAMPLES.items()):
        table.add_row(name, Text(description))
    console.print(table)
    return 0


# --------------------------------------------------------------------------------------------
# Running a command
# --------------------------------------------------------------------------------------------
def _hint(exc: BaseException) -> str | None:
    if isinstance(exc, MissingDependencyError):
        return None  # the message is the install command
    if isinstance(exc, TargetError):
        return ("TARGET is a built-in example (see `autoshard examples`) or package.module:factory; "
                "add --debug to see the traceback")
    if isinstance(exc, PlanError):
        return "make a fresh plan with `autoshard split TARGET --stages K --out PLAN.json`"
    if isinstance(exc, (ShapePropagationError, ExampleInputsError)):
        return ("the example inputs must be ones the model runs on (model(*args, **kwargs) works): check their "
                "shapes and dtypes against its forward; add --debug to see the traceback")
    if type(exc) in (InvalidArgumentError, InvalidArgumentTypeError):
        return None  # a value refused: the message names it and what to take; a traceback adds nothing
    if isinstance(exc, AutoshardError):
        return "add --debug to see the traceback"
    return "this looks like a bug in autoshard or in the model; add --debug for the traceback and report it"


#: The library's parameter names that its messages use, as a command-line user knows them: the flag
#: that sets each one. ``--stages`` sets ``num_stages``; ``--max-memory`` reaches the splitter as
#: ``memory_budgets`` and, in the training-memory model, with ``memory_in_flight``.
FLAGS_OF_PARAMETERS = {
    "num_stages": "--stages",
    "max_memory": "--max-memory",
    "memory_budgets": "--max-memory budgets",
    "memory_in_flight": "microbatches in flight",
    "optimizer_bytes_per_param": "--optimizer-bytes",
    "stages_per_rank": "--stages-per-rank",
    "link_bandwidth": "--link-bandwidth",
    "link_latency": "--link-latency",
    "tolerance": "--tolerance",
}

#: A parameter name standing alone (not inside a word, a path, a file name or a pipeline spec), with
#: an optional ``[j]`` index: ``max_memory[0]``.
_PARAMETER = re.compile(r"(?<![\w./-])(" + "|".join(FLAGS_OF_PARAMETERS) + r")(?:\[(\d+)\])?(?![\w/-]|\.\w)")

#: Text to copy as it is: a pass's options in a spec (``split{tolerance=0.1}``) and a memory model
#: (``MemoryModel(stages_per_rank=4)``), which a flag in their place would break.
_VERBATIM = re.compile(r"(\{[^{}]*\}|MemoryModel\([^()]*\))")


def in_flag_terms(text: str) -> str:
    """``text`` with the library's parameter names replaced by the flags that set them, so that an
    error raised by the library speaks of what the command-line user typed (``max_memory[0]`` is
    ``--max-memory (stage 0)``)."""
    def flag(match: re.Match[str]) -> str:
        name, index = match.groups()
        return FLAGS_OF_PARAMETERS[name] + (f" (stage {index})" if index is not None else "")

    parts = _VERBATIM.split(text)  # the spans to keep at the odd places
    return "".join(part if i % 2 else _PARAMETER.sub(flag, part) for i, part in enumerate(parts))


def _report_error(exc: BaseException) -> int:
    """One message, its notes and a hint on stderr; exit code 2 for a refused request, 1 for a crash.
    Printed without wrapping (``soft_wrap``): a pipeline spec or a command in the message stays on one
    line, so it can be copied (rich otherwise breaks lines at 80 columns when stderr is not a terminal)."""
    stderr = Console(stderr=True, highlight=False, soft_wrap=True)
    known = isinstance(exc, AutoshardError)
    message = in_flag_terms(str(exc)) if known else f"unexpected {type(exc).__name__}: {exc}"
    stderr.print(Text.assemble(("error: ", "bold red"), message))
    for note in getattr(exc, "__notes__", ()):
        stderr.print(Text(f"  {in_flag_terms(note)}", style="dim"))
    hint = _hint(exc)
    if hint:
        stderr.print(Text.assemble(("hint: ", "bold"), hint))
    return 2 if known else 1


def _table_width() -> int | None:
    """The terminal's own width (rich measures it), else ``COLUMNS`` if set, else ``PIPED_WIDTH``."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return None
    return PIPED_WIDTH


def _show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    """A warning as one line, like the errors: the source line Python shows belongs to autoshard."""
    text = f"warning: {in_flag_terms(str(message))} ({category.__name__})"
    Console(stderr=True, highlight=False, soft_wrap=True).print(text, markup=False)


#: The function that runs each command ``autoshard.cli``'s parser takes.
COMMANDS = {"split": cmd_split, "inspect": cmd_inspect, "passes": cmd_passes, "examples": cmd_examples}


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` (parsed by ``autoshard.cli``); its exit code. A failure is one message
    on stderr (exit 2 for a refused request, 1 for a crash) unless ``--debug`` asks for the traceback."""
    console = Console(highlight=False, width=_table_width())
    try:
        with progress.silenced(getattr(args, "quiet", False)), warnings.catch_warnings():
            if not args.debug:
                warnings.showwarning = _show_warning
            return COMMANDS[args.command](args, console)
    except KeyboardInterrupt:
        if args.debug:
            raise
        Console(stderr=True).print("interrupted", markup=False)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes one message unless --debug
        if args.debug:
            raise
        return _report_error(exc)
