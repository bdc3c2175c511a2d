"""The ``autoshard`` command: split a model and show the plan, list passes and examples."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from rich.console import Console
from rich.table import Table

from autoshard.api import bind_pipeline, check_stage_count, default_pipeline, example_inputs_of, run_pipeline
from autoshard.errors import AutoshardError
from autoshard.examples import EXAMPLES
from autoshard.passes.instruments import DumpDir, Instrument, Timing
from autoshard.passes.registry import registered_passes
from autoshard.passes.spec import option_table
from autoshard.report import stage_rows
from autoshard.sharded import ShardedModel
from autoshard.targets import load_target


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def stage_table(sharded: ShardedModel, title: str) -> Table:
    table = Table(title=title)
    for column in ("stage", "modules", "nodes", "params", "values in", "values out"):
        table.add_column(column, overflow="fold")
    for row in stage_rows(sharded.plan):
        table.add_row(
            str(row.index), ", ".join(row.modules), str(row.nodes), _human_bytes(row.param_bytes),
            ", ".join(row.values_in) or "(model inputs)" if row.index == 0 else ", ".join(row.values_in) or "-",
            ", ".join(row.values_out) or ("(model output)" if row.index == sharded.num_stages - 1 else "-"),
        )
    return table


def cmd_split(args: argparse.Namespace, console: Console) -> int:
    model, ex_args, ex_kwargs = load_target(args.target)
    stages = check_stage_count(args.stages)
    inputs = example_inputs_of(ex_args or None, ex_kwargs or None)
    if args.pipeline:
        pipeline = bind_pipeline(args.pipeline, stages, args.cost)
    else:
        pipeline = default_pipeline(stages, args.cost, verify=inputs is not None and not args.no_verify)
    instruments: list[Instrument] = []
    timing = Timing()
    if args.timing:
        instruments.append(timing)
    if args.dump_dir:
        instruments.append(DumpDir(args.dump_dir))
    program = run_pipeline(model, pipeline, inputs, instruments).program
    if program.sharded is None:
        raise AutoshardError(f"the pipeline '{pipeline}' produced no stages; end it with 'emit'")
    if not args.quiet:
        console.print(stage_table(program.sharded, f"{args.target}: {stages} stages ({pipeline})"))
        for leaf in program.sharded.plan.wrapped:
            console.print(f"wrapped {leaf.kind} [bold]{leaf.name}[/bold]: {leaf.reason}", markup=True, highlight=False)
        if program.verification:
            console.print(f"verified: {program.verification}")
        if args.timing:
            console.print(timing.table())
    return 0


def cmd_passes(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="registered passes")
    for column in ("pass", "summary", "options", "requires → provides"):
        table.add_column(column, overflow="fold")
    for cls in registered_passes():
        options = ", ".join(f"{o.key}={o.default if o.default is not None else '(required)'}"
                            for o in option_table(cls))
        flow = f"{', '.join(sorted(cls.requires))} → {', '.join(sorted(cls.provides))}"
        table.add_row(cls.name, cls.summary(), options or "-", flow)
    console.print(table)
    return 0


def cmd_examples(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="built-in examples (use as TARGET)")
    table.add_column("name")
    table.add_column("model")
    for name, (_, description) in sorted(EXAMPLES.items()):
        table.add_row(name, description)
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    split = commands.add_parser("split", help="split a model into K stages and print the plan")
    split.add_argument("target", metavar="TARGET",
                       help="a built-in example name or package.module:factory returning the model, "
                            "(model, args) or (model, args, kwargs)")
    split.add_argument("--stages", "-k", type=int, required=True, help="number of stages")
    split.add_argument("--cost", default="params", help="cost model to balance (default: params)")
    split.add_argument("--pipeline", help="custom pipeline spec, e.g. 'trace,build-dag,linearize,split,emit'")
    split.add_argument("--no-verify", action="store_true", help="skip comparing the stages with the model")
    split.add_argument("--timing", action="store_true", help="print the time each pass took")
    split.add_argument("--dump-dir", help="write each pass's result into this folder")
    split.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    split.set_defaults(handler=cmd_split)
    commands.add_parser("passes", help="list the registered passes").set_defaults(handler=cmd_passes)
    commands.add_parser("examples", help="list the built-in example models").set_defaults(handler=cmd_examples)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        return args.handler(args, console)
    except AutoshardError as exc:
        if args.debug:
            raise
        Console(stderr=True).print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
