"""The autoshard command: split a model and show, save, draw or compare the plan.

    autoshard split TARGET --stages K [--out plan.json] [--svg plan.svg] [--compare greedy,min-cut]
    autoshard split TARGET --stages K --device-tflops 989 --device-bandwidth 3350GB/s   # times for that device
    autoshard split TARGET --stages K --max-memory 40GiB --optimizer sgd-momentum --microbatches 8
    autoshard split TARGET --stages K --link-bandwidth 25GB/s --link-latency 5us  # step time over that link
    autoshard split TARGET --plan plan.json        # rebuild the saved stages
    autoshard inspect TARGET --stages K            # the plan only: no stages are built
    autoshard inspect plan.json                    # show a saved plan
    autoshard passes | examples
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from autoshard import __version__
from autoshard.costs.memory_model import OPTIMIZER_BYTES, SCHEDULES
from autoshard.costs.step_time import DEFAULT_LINK_BANDWIDTH, DEFAULT_LINK_LATENCY
from autoshard.errors import suggest

#: Values the help states whose modules import torch (``autoshard.targets``' ``FACTORY_RETURNS``,
#: ``autoshard.runtime.stage_time``'s ``TIMING_REPEATS``), which ``--help`` does without: copies,
#: which tests/test_cli_startup.py checks the help states as the library has them.
_FACTORY_RETURNS = "a model, (model, args) or (model, args, kwargs)"
_TIMING_REPEATS = 9


def _plan_options(build: bool) -> argparse.ArgumentParser:
    """The options ``split`` and ``inspect`` share (``split`` also builds and verifies stages)."""
    options = argparse.ArgumentParser(add_help=False)
    target_help = (f"a built-in example name or package.module:factory returning {_FACTORY_RETURNS}"
                   + ("" if build else "; or a saved plan.json to show"))
    options.add_argument("target", metavar="TARGET", help=target_help)
    options.add_argument("--stages", "-k", type=int, metavar="K", help="number of stages")
    options.add_argument("--cost", help="cost model to balance (default: params)")
    options.add_argument("--strategy", help="splitting strategy (default: min-cut)")
    options.add_argument("--tolerance", type=float, metavar="FRACTION",
                         help="let the costliest stage cost up to this fraction more than the best balance where "
                              "fewer bytes then cross the boundaries, e.g. 0.1 (default 0)")
    options.add_argument("--compare", metavar="S1,S2", help="show several strategies side by side, e.g. greedy,min-cut")
    options.add_argument("--pipeline", metavar="SPEC",
                         help="custom pipeline, e.g. 'trace,build-dag,linearize,split,emit'")
    options.add_argument("--time-profile", metavar="PROFILE.json",
                         help="measure node times (or reuse this file's): the time column is then measured")
    options.add_argument("--device-tflops", type=float, metavar="TFLOPS",
                         help="peak TFLOP/s of the device for estimated times (default: this machine, calibrated)")
    options.add_argument("--device-bandwidth", metavar="RATE",
                         help="memory bandwidth of the device for estimated times, e.g. 900GB/s (a bare number: "
                              "GB/s; bits: 200Gbit/s; default: this machine, calibrated)")
    options.add_argument("--max-memory", metavar="BYTES",
                         help="training-memory budget per stage, e.g. 40GiB or 30GB,40GB,... (one value: every stage); "
                              "inspecting a saved plan.json: check the plan against it (exit 2 if a stage is over)")
    options.add_argument("--optimizer-bytes", type=float, metavar="N",
                         help="optimizer state bytes per trainable parameter for training memory (default: the "
                              "optimizer's state tensors in the dtype it steps: 8 for Adam on fp32 weights, 4 on bf16)")
    options.add_argument("--microbatches", type=int, metavar="M",
                         help="microbatches per step for training memory (default: as many as the schedule keeps "
                              "at most, k - j at stage j under 1F1B)")
    options.add_argument("--optimizer", metavar="NAME",
                         help="optimizer whose state training memory counts: " + ", ".join(OPTIMIZER_BYTES)
                              + " (default adam)")
    options.add_argument("--schedule", metavar="NAME",
                         help="pipeline schedule whose microbatches in flight training memory counts: "
                              + ", ".join(SCHEDULES) + " (default 1f1b)")
    options.add_argument("--stages-per-rank", type=int, metavar="N",
                         help="stages each process runs under --schedule interleaved-1f1b (default 2)")
    options.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=None,
                         help="count an fp32 master copy of bf16/fp16 trainable weights (mixed precision)")
    options.add_argument("--optimizer-foreach", action=argparse.BooleanOptionalAction, default=None,
                         help="the optimizer steps every weight at once (torch.optim's foreach; --no-optimizer-foreach:"
                              " one after another); default: as torch chooses where the model is (foreach on a GPU)")
    options.add_argument("--keep-gradients", action=argparse.BooleanOptionalAction, default=None,
                         help="the training loop keeps gradients between steps (zero_grad(set_to_none=False)); "
                              "default: zero_grad frees them, so a GPipe stage's first backward makes them")
    options.add_argument("--link-bandwidth", metavar="RATE",
                         help="bandwidth between two ranks for the predicted step time, e.g. 25GB/s or in bits "
                              f"200Gbit/s (a bare number: bytes/s; default {DEFAULT_LINK_BANDWIDTH:g} bytes/s: gloo "
                              "between CPU processes on one machine)")
    options.add_argument("--link-latency", metavar="TIME",
                         help="time per message between two ranks for the predicted step time, e.g. 5us (a bare "
                              f"number: seconds; default {DEFAULT_LINK_LATENCY:g} s)")
    options.add_argument("--pin", action="append", metavar="NAME=STAGE",
                         help="hold a module path, class or weight in a stage, e.g. encoder=0 (repeatable)")
    options.add_argument("--no-split", action="append", metavar="NAME",
                         help="keep a module path or every module of a class in one stage (repeatable)")
    options.add_argument("--cut-before", action="append", metavar="MODULE",
                         help="start a stage at this module (repeatable)")
    options.add_argument("--plan", metavar="PLAN.json", help="use the split saved in this plan instead of splitting")
    options.add_argument("--out", metavar="PLAN.json", help="save the plan as JSON (reuse it with --plan)")
    options.add_argument("--svg", metavar="FILE.svg", help="draw the plan as SVG (needs matplotlib)")
    options.add_argument("--png", metavar="FILE.png", help="draw the plan as PNG (needs matplotlib)")
    options.add_argument("--timing", action="store_true", help="print the time each pass took")
    options.add_argument("--dump-dir", metavar="DIR", help="write each pass's result into this folder")
    options.add_argument("--quiet", "-q", action="store_true", help="print nothing on success, draw no progress")
    options.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    if build:
        options.add_argument("--no-verify", action="store_true", help="skip comparing the stages with the model")
        options.add_argument("--time-stages", action="store_true",
                             help="also predict the step from the stages timed whole on the example, over this "
                                  "machine's runtime costs (calibrated once with two local processes, about 25 s)")
        options.add_argument("--time-repeats", type=int, metavar="N",
                             help=f"with --time-stages: timed runs of each stage, the median counts "
                                  f"(default {_TIMING_REPEATS}; more on a busy machine)")
    else:
        options.set_defaults(no_verify=True)
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"autoshard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("split", parents=[_plan_options(build=True)],
                        help="split a model into K stages, build and verify them, and show the plan")
    commands.add_parser("inspect", parents=[_plan_options(build=False)],
                        help="show the plan for a model (no stages built) or a saved plan.json")
    commands.add_parser("passes", help="list the registered passes")
    commands.add_parser("examples", help="list the built-in example models")
    return parser


def _parsed(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments; a flag this command does not take but another does is refused naming
    that command (``inspect --time-stages`` got only argparse's "unrecognized arguments"), one no
    command takes with the closest this one does (``--optimzer``)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        hints = []
        for flag in dict.fromkeys(item.partition("=")[0] for item in unknown if item.startswith("-")):
            takers = [name for name, sub in commands.items() if flag in sub._option_string_actions]
            if takers:
                hints.append(f"{flag} is an option of {', '.join(repr(f'autoshard {name}') for name in takers)}")
            elif close := suggest(flag, commands[args.command]._option_string_actions):
                hints.append(f"{flag}{close}")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"; {hint}" for hint in hints))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default: this process's arguments); its exit code. The library
    (torch, seconds to import) loads once the arguments parse: ``--help``, ``--version`` and a usage
    error are answered without it."""
    args = _parsed(build_parser(), argv)
    from autoshard.commands import run

    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
