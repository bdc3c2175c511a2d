"""Instruments: hook order, Timing, DumpDir, PrintAfter, ModelUnchanged."""

from __future__ import annotations

import io
import re
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import networkx as nx
import pytest
import torch
from rich.console import Console
from rich.table import Table

from autoshard.errors import InvalidArgumentError, PassContractError, PassFailed
from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram
from autoshard.passes.instruments import (
    DumpDir,
    Instrument,
    ModelUnchanged,
    PrintAfter,
    Timing,
    describe_program,
    model_fingerprint,
)
from autoshard.passes.pipeline import Pipeline
from autoshard.passes.registry import PassRegistry

REG = PassRegistry(entry_point_group=None)


@REG.register
@dataclass(frozen=True)
class TracePass(Pass):
    """Trace the model with torch.fx."""

    name: ClassVar[str] = "trace"
    provides: ClassVar[frozenset[str]] = frozenset({"traced"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return replace(program, traced=torch.fx.symbolic_trace(program.model))


@REG.register
@dataclass(frozen=True)
class BuildDagPass(Pass):
    """Build a frozen DAG from the traced graph."""

    name: ClassVar[str] = "build-dag"
    requires: ClassVar[frozenset[str]] = frozenset({"traced"})
    provides: ClassVar[frozenset[str]] = frozenset({"dag"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        g = nx.DiGraph()
        for node in program.traced.graph.nodes:
            g.add_node(node.name, op=node.op)
            for user in node.users:
                g.add_edge(node.name, user.name)
        return replace(program, dag=nx.freeze(g))


@REG.register
@dataclass(frozen=True)
class SleepPass(Pass):
    """Take some time and fill `verification`."""

    name: ClassVar[str] = "sleep"
    provides: ClassVar[frozenset[str]] = frozenset({"verification"})
    seconds: float = 0.0
    fail: bool = False

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("boom")
        return replace(program, verification="slept")


@REG.register
@dataclass(frozen=True)
class MutatePass(Pass):
    """A badly behaved pass that changes the user's model in one of several ways."""

    name: ClassVar[str] = "mutate"
    how: str = "nothing"

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        model = program.model
        if self.how == "in-place":
            with torch.no_grad():
                model[0].weight.add_(1.0)
        elif self.how == "data":
            model[0].weight.data[0, 0] += 1.0  # bypasses the version counter; the checksum sees it
        elif self.how == "eval":
            model.eval()
        elif self.how == "hook":
            model[1].register_forward_hook(lambda *a: None)
        elif self.how == "replace":
            model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
        elif self.how == "add-module":
            model.add_module("extra", torch.nn.Identity())
        elif self.how == "requires-grad":
            model[0].bias.requires_grad_(False)
        elif self.how == "input":
            program.example_inputs.args[0].mul_(2)
        elif self.how == "proxy":  # what Swin's forward does to itself when traced
            model[0].window_size = (7, torch.fx.Proxy(torch.fx.Graph().placeholder("x")))
        elif self.how == "attribute":  # what it does on a real call: the model's own business
            model[0].window_size = (7, 7)
        return program


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def start() -> ShardProgram:
    return ShardProgram(model=make_model(), example_inputs=ExampleInputs(args=(torch.ones(2, 3),)))


def run(spec: str, *instruments: Instrument, program: ShardProgram | None = None):
    return Pipeline.parse(spec, registry=REG).run(program or start(), PassContext(instruments=list(instruments)))


class Recorder(Instrument):
    def __init__(self, label: str, log: list[str]) -> None:
        self.label, self.log = label, log

    def before_pipeline(self, pipeline, program):
        self.log.append(f"{self.label}.before_pipeline({pipeline})")

    def before_pass(self, pass_, index, program):
        self.log.append(f"{self.label}.before_pass({pass_.name},{index})")

    def after_pass(self, pass_, index, program):
        self.log.append(f"{self.label}.after_pass({pass_.name},{index},{sorted(program.provided())})")

    def after_pass_failed(self, pass_, index, program, exc):
        self.log.append(f"{self.label}.after_pass_failed({pass_.name},{index},{type(exc).__name__})")

    def after_pipeline(self, pipeline, program):
        self.log.append(f"{self.label}.after_pipeline")


# ----------------------------------------------------------------------------------------------
# Hook order
# ----------------------------------------------------------------------------------------------
def test_hooks_run_before_in_order_and_after_in_reverse_order():
    log: list[str] = []
    run("trace,sleep", Recorder("A", log), Recorder("B", log))
    assert log == [
        "A.before_pipeline(trace,sleep)",
        "B.before_pipeline(trace,sleep)",
        "A.before_pass(trace,0)",
        "B.before_pass(trace,0)",
        "B.after_pass(trace,0,['example_inputs', 'model', 'traced'])",
        "A.after_pass(trace,0,['example_inputs', 'model', 'traced'])",
        "A.before_pass(sleep,1)",
        "B.before_pass(sleep,1)",
        "B.after_pass(sleep,1,['example_inputs', 'model', 'traced', 'verification'])",
        "A.after_pass(sleep,1,['example_inputs', 'model', 'traced', 'verification'])",
        "B.after_pipeline",
        "A.after_pipeline",
    ]


def test_failure_hook_runs_in_reverse_order_and_the_pipeline_hook_does_not():
    log: list[str] = []
    with pytest.raises(PassFailed):
        run("trace,sleep{fail=true}", Recorder("A", log), Recorder("B", log))
    assert log[-4:] == [
        "A.before_pass(sleep,1)",
        "B.before_pass(sleep,1)",
        "B.after_pass_failed(sleep,1,RuntimeError)",
        "A.after_pass_failed(sleep,1,RuntimeError)",
    ]


def test_contract_violation_reaches_the_failure_hook():
    log: list[str] = []

    @dataclass(frozen=True)
    class LiarPass(Pass):
        """Declares `dag`, provides nothing."""

        name: ClassVar[str] = "liar"
        provides: ClassVar[frozenset[str]] = frozenset({"dag"})

        def run(self, program, ctx):
            return program

    with pytest.raises(PassContractError):
        Pipeline([LiarPass()]).run(start(), PassContext(instruments=[Recorder("A", log)]))
    assert log[-1] == "A.after_pass_failed(liar,0,PassContractError)"


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
def test_timing_rows_and_table():
    timing = Timing()
    run("trace,sleep{seconds=0.02}", timing)
    rows = timing.rows()
    assert [(r.index, r.name, r.spec, r.status) for r in rows] == [
        (0, "trace", "trace", "ok"),
        (1, "sleep", "sleep{seconds=0.02}", "ok"),
    ]
    assert rows[1].seconds >= 0.02 and rows[0].seconds >= 0
    assert timing.total_seconds == pytest.approx(sum(r.seconds for r in rows))
    assert timing.pipeline_seconds >= timing.total_seconds
    table = timing.table()
    assert isinstance(table, Table) and table.row_count == 3  # two passes and the total
    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    text = console.file.getvalue()
    assert "sleep{seconds=0.02}" in text and "total" in text


def test_timing_records_failed_pass():
    timing = Timing()
    with pytest.raises(PassFailed):
        run("sleep{fail=true}", timing)
    assert [(r.name, r.status) for r in timing.rows()] == [("sleep", "failed")]


# ----------------------------------------------------------------------------------------------
# DumpDir and PrintAfter
# ----------------------------------------------------------------------------------------------
def test_dump_dir_writes_one_readable_file_per_pass(tmp_path):
    dump = DumpDir(tmp_path / "dumps")
    run("trace,build-dag,sleep", dump)
    files = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert files == ["000-trace.txt", "001-build-dag.txt", "002-sleep.txt"]
    trace = (tmp_path / "dumps" / "000-trace.txt").read_text()
    assert trace.startswith("# after pass 0: trace\n# pipeline: trace,build-dag,sleep\n")
    assert "artifacts set: model, example_inputs, traced" in trace
    assert "not set: constraints, facts, times, dag, order, partition, sharded, verification" in trace
    assert "def forward(self, input" in trace  # the GraphModule's code
    assert "args[0]: Tensor(shape=[2, 3], dtype=float32, device=cpu)" in trace
    dag = (tmp_path / "dumps" / "001-build-dag.txt").read_text()
    assert "== dag ==" in dag and "DiGraph: 5 nodes, 4 edges" in dag and "edge input_1 -> _0" in dag
    assert (tmp_path / "dumps" / "002-sleep.txt").read_text().count("== verification ==\n'slept'") == 1


def test_dump_dir_writes_the_failure_with_the_input_program(tmp_path):
    with pytest.raises(PassFailed):
        run("trace,sleep{fail=true}", DumpDir(tmp_path))
    failed = (tmp_path / "001-sleep.failed.txt").read_text()
    assert failed.startswith("# pass 1 failed: sleep{fail=true}")
    assert "RuntimeError: boom" in failed and "artifacts set: model, example_inputs, traced" in failed


def test_describe_program_uses_an_artifacts_describe_method():
    class Plan:
        def describe(self) -> str:
            return "3 stages, balanced"

    text = describe_program(ShardProgram(model=make_model(), partition=Plan()))
    assert "== partition ==\n3 stages, balanced" in text
    assert "Sequential: 26 parameters, training=True" in text


def test_print_after_selected_passes():
    out = io.StringIO()
    run("trace,sleep", PrintAfter(["sleep"], file=out))
    text = out.getvalue()
    assert "after pass 1: sleep" in text and "after pass 0" not in text
    assert "== verification ==" in text


def test_print_after_all_defaults_to_stderr(capsys):
    run("trace,sleep", PrintAfter("all"))
    err = capsys.readouterr().err
    assert "after pass 0: trace" in err and "after pass 1: sleep" in err


# ----------------------------------------------------------------------------------------------
# ModelUnchanged
# ----------------------------------------------------------------------------------------------
def test_model_unchanged_accepts_well_behaved_passes():
    result = run("trace,build-dag,mutate,sleep", ModelUnchanged())
    assert result.program.verification == "slept"
    assert run("trace,mutate{how=attribute},sleep", ModelUnchanged()).program.verification == "slept"


@pytest.mark.parametrize(
    ("how", "detail"),
    [
        ("in-place", r"parameter '0.weight' was modified in place \(version (\d+) -> (?!\1)\d+\)"),
        ("data", r"the values of parameter '0.weight' changed \(checksum"),
        ("eval", r"training flag of the root module changed from True to False"),
        ("hook", r"hooks of '1' changed: forward_hooks 0 -> 1"),
        ("replace", r"parameter '0.weight' was replaced by another tensor"),
        ("add-module", r"the module tree changed \(added \['extra'\]\)"),
        ("requires-grad", r"parameter '0.bias' changed: requires_grad True -> False"),
        ("input", r"example input args\[0\] was modified in place"),
        ("proxy", r"trace values left on '0' changed from \(\) to \('window_size',\)"),
    ],
)
def test_model_unchanged_names_the_pass_that_changed_the_model(how, detail):
    with pytest.raises(PassContractError) as info:
        run(f"trace,mutate{{how={how}}},sleep", ModelUnchanged())
    exc = info.value
    assert "pass 'mutate' (position 1) modified the user's model: " in str(exc)
    assert re.search(detail, str(exc)), str(exc)
    assert (exc.pass_name, exc.index) == ("mutate", 1)
    assert any(f"reproduce with pipeline: trace,mutate{{how={how}}},sleep" in n for n in exc.__notes__)


def test_model_fingerprint_is_stable_and_sees_training_flags_of_submodules():
    model = make_model()
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    model[1].eval()
    after = model_fingerprint(model)
    assert after != before and after["training flag of '1'"] is False


def test_dump_dir_that_cannot_be_created_is_a_typed_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidArgumentError, match="cannot create the dump directory"):
        run("trace,build-dag", DumpDir(blocker / "dumps"))


def test_dump_dir_shared_by_two_runs_keeps_both(tmp_path):
    """The CLI's --compare runs one split per strategy with one DumpDir: none may overwrite another."""
    dump = DumpDir(tmp_path)
    run("trace,build-dag", dump)
    run("trace", dump)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000-trace.txt", "001-build-dag.txt", "002-trace.txt"]
