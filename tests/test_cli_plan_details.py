"""What the CLI tells about a plan beyond its costs: time per stage (measured or estimated), training
memory, and how the split was made (strategy, tolerance, optimality, tied weights placed apart).

Run in-process through ``main`` (torch is imported once); test_cli.py covers the subprocess path.
"""

from __future__ import annotations

import importlib
import json
import textwrap
from pathlib import Path

import pytest

import autoshard
from autoshard import cli
from autoshard.costs.memory import stage_memory
from autoshard.examples import load_example
from autoshard.plan_io import read_plan
from autoshard.report import human_bytes

from test_cli import stage_rows

TIED = textwrap.dedent('''
    import torch
    from autoshard.examples import GPTStyleLM

    def build():
        torch.manual_seed(0)
        return GPTStyleLM(vocab=100, width=32, layers=2).eval(), (torch.randint(0, 100, (2, 8)),)
''')


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def run(capsys, *argv: str) -> str:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def flat(text: str) -> str:
    return " ".join(text.split())


def header(stdout: str) -> list[str]:
    """The column names of the first table."""
    line = next(line for line in stdout.splitlines() if line.startswith("┃"))
    return [cell.strip() for cell in line.strip("┃").split("┃")]


def column(stdout: str, name: str) -> list[str]:
    index = header(stdout).index(name)
    return [row[index] for row in stage_rows(stdout)]


# --------------------------------------------------------------------------------------------
# Time per stage
# --------------------------------------------------------------------------------------------
def test_the_table_always_has_an_estimated_time_column(capsys, tmp_path):
    out = run(capsys, "split", "residual-mlp", "-k", "2", "--out", str(tmp_path / "p.json"))
    cells = column(out, "time (est.)")
    assert len(cells) == 2 and all(cell.endswith(("µs", "ms", " s")) for cell in cells)
    assert "time (est.): per node max(FLOPs / peak, bytes moved / bandwidth)" in out
    assert "calibrated on this machine" in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["time_estimate"]["calibrated"] is True
    assert plan["summary"]["stage_seconds"]["source"] == "estimated"
    assert all(s > 0 for s in plan["summary"]["stage_seconds"]["seconds"])


def test_device_flags_set_the_roofline_and_a_slower_device_takes_longer(capsys, tmp_path):
    seconds = {}
    for tflops in ("0.000001", "1"):
        path = tmp_path / f"{tflops}.json"
        out = run(capsys, "inspect", "residual-mlp", "-k", "2", "--device-tflops", tflops, "--device-bandwidth",
                  "1", "--out", str(path))
        assert "(given)" in out
        plan = read_plan(path)
        assert plan.time_estimate.peak_flops == float(tflops) * 1e12 and plan.time_estimate.bandwidth == 1e9
        assert not plan.time_estimate.calibrated
        seconds[tflops] = plan.stage_seconds()
    assert all(slow > fast for slow, fast in zip(seconds["0.000001"], seconds["1"]))


def test_the_device_bandwidth_reads_a_rate_with_units_as_a_bare_number_in_gb_per_second(capsys, tmp_path):
    for value in ("2", "2GB/s", "2e9 B/s", "2000MB/s"):
        path = tmp_path / "p.json"
        run(capsys, "inspect", "residual-mlp", "-k", "2", "--device-tflops", "1", "--device-bandwidth", value,
            "--out", str(path))
        assert read_plan(path).time_estimate.bandwidth == pytest.approx(2e9), value


def test_with_a_time_profile_the_column_shows_the_measured_numbers(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    run(capsys, "inspect", "residual-mlp", "-k", "2", "--time-profile", str(profile), "-q")
    data = json.loads(profile.read_text())
    data["seconds"] = {name: 0.001 for name in data["seconds"]}  # every node now takes exactly 1 ms
    profile.write_text(json.dumps(data))
    out = run(capsys, "inspect", "residual-mlp", "-k", "2", "--time-profile", str(profile), "--out",
              str(tmp_path / "p.json"))
    plan = read_plan(tmp_path / "p.json")
    counts = [sum(1 for n in plan.nodes if n.stage == j and not n.input) for j in range(2)]
    assert column(out, "time (measured)") == [f"{c:.3f} ms" for c in counts]
    assert "time: measured per node (profile)" in out
    assert plan.time_measured and plan.time_estimate is None
    assert plan.stage_seconds() == pytest.approx([0.001 * c for c in counts])


def test_a_split_balanced_by_time_labels_its_column_as_such(capsys, tmp_path):
    out = run(capsys, "inspect", "residual-mlp", "-k", "2", "--cost", "time")
    assert "time (split, measured)" in header(out)


@pytest.mark.parametrize("argv,message", [
    (("--device-tflops", "0"), "--device-tflops must be a number > 0, got 0.0"),
    (("--device-bandwidth", "nan"), "--device-bandwidth takes a rate > 0 such as 25GB/s"),
    (("--device-bandwidth", "900GB"), "a bare number (in GB/s); got '900GB'"),
    (("--pipeline", "capture,build-dag,linearize,split,emit", "--time-profile", "p.json"), "profile{path=FILE}"),
])
def test_bad_time_options_are_refused(capsys, argv, message):
    code = cli.main(["split", "residual-mlp", "-k", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in flat(err) and "Traceback" not in err


def test_a_saved_plan_keeps_its_device_and_refuses_a_new_one_on_inspect(capsys, tmp_path):
    path = str(tmp_path / "p.json")
    run(capsys, "split", "residual-mlp", "-k", "2", "--device-tflops", "2", "--device-bandwidth", "3", "--out", path)
    again = str(tmp_path / "again.json")
    run(capsys, "split", "residual-mlp", "--plan", path, "--out", again)
    assert read_plan(again).time_estimate == read_plan(path).time_estimate
    assert cli.main(["inspect", path, "--device-tflops", "5"]) == 2
    assert "cannot be used when inspecting a saved plan" in flat(capsys.readouterr().err)


# --------------------------------------------------------------------------------------------
# Training memory per stage
# --------------------------------------------------------------------------------------------
def test_training_memory_is_the_memory_model_of_each_stage(capsys, tmp_path):
    path = tmp_path / "p.json"
    out = run(capsys, "split", "transformer-lm", "-k", "3", "--out", str(path))
    model, args, _ = load_example("transformer-lm")
    plan = autoshard.shard_model(model, 3, example_inputs=args).plan
    expected = stage_memory(plan.dag, plan.assignment, 3)
    saved = json.loads(path.read_text())["summary"]["training_memory"]
    assert [s["total"] for s in saved["stages"]] == [m.total for m in expected]
    assert [s["in_flight"] for s in saved["stages"]] == [3, 2, 1]
    assert saved["model"]["optimizer_bytes_per_param"] is None  # Adam's own: two moments in the weights' dtype
    assert column(out, "train mem") == [human_bytes(m.total) for m in expected]
    assert "kept activations x microbatches in flight" in out


def test_without_example_inputs_time_and_memory_say_they_are_unknown(capsys, tmp_path, monkeypatch):
    (tmp_path / "bare.py").write_text("import torch\n\ndef build():\n"
                                      "    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])\n")
    monkeypatch.chdir(tmp_path)
    out = run(capsys, "split", "bare:build", "-k", "2")
    assert column(out, "time") == ["?", "?"] and column(out, "train mem") == ["?", "?"]
    assert "no example inputs: bare:build returned the model alone, so value sizes, FLOPs and times are not " \
           "measured" in flat(out)


# --------------------------------------------------------------------------------------------
# How the split was made
# --------------------------------------------------------------------------------------------
def test_the_split_record_names_strategy_and_tolerance_and_survives_a_rebuild(capsys, tmp_path):
    path = str(tmp_path / "p.json")
    spec = "capture,shape-prop,build-dag,linearize,split{tolerance=0.25},emit"
    out = run(capsys, "split", "residual-mlp", "-k", "2", "--pipeline", spec, "--out", path)
    assert "split: min-cut, tolerance 0.25, bound " in out
    split = json.loads(Path(path).read_text())["split"]
    assert split["strategy"] == "min-cut" and split["tolerance"] == 0.25 and split["proven_optimal"] is None
    again = str(tmp_path / "again.json")
    rebuilt = run(capsys, "split", "residual-mlp", "--plan", path, "--out", again)
    assert json.loads(Path(again).read_text())["split"] == split
    assert "split: min-cut, tolerance 0.25" in rebuilt and "edited by hand" not in rebuilt


WIDTHS = textwrap.dedent('''
    import torch
    from autoshard.examples import ResidualMLP

    def narrow():
        torch.manual_seed(0)
        return ResidualMLP(num_blocks=4, width=8), (torch.randn(2, 8),)

    def wide():
        torch.manual_seed(0)
        return ResidualMLP(num_blocks=4, width=32), (torch.randn(2, 32),)
''')


def test_a_plan_loaded_into_wider_weights_warns_and_drops_the_balance_it_recorded(capsys, tmp_path, monkeypatch):
    """Same graph, other sizes: the stages are the plan's and compute the model, but its recorded
    bound and bottleneck were measured on the narrow weights and must not be reported as this model's."""
    (tmp_path / "widths.py").write_text(WIDTHS)
    monkeypatch.chdir(tmp_path)
    run(capsys, "split", "widths:narrow", "-k", "2", "--out", "narrow.json")
    assert json.loads(Path("narrow.json").read_text())["split"]["bound"] > 0
    code = cli.main(["split", "widths:wide", "--plan", "narrow.json", "--out", "wide.json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "warning: plan narrow.json was made for other weights" in flat(out.err)
    assert "'linears.0.weight' has 1,024 elements here, 64 in the plan" in flat(out.err)
    assert "verified" in out.out and "bound" not in json.loads(Path("wide.json").read_text()).get("split", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    model, args = importlib.import_module("widths").wide()
    with pytest.warns(autoshard.plan_io.StalePlanWarning) as warned:
        rebuilt = autoshard.load_plan("narrow.json", model, args)
    assert rebuilt.plan.split_info is None
    assert {w.filename for w in warned} == {__file__}  # the user's call, not a pass inside autoshard


def test_exact_says_when_it_proved_its_split_optimal(capsys, tmp_path):
    path = tmp_path / "p.json"
    out = run(capsys, "inspect", "residual-mlp", "-k", "2", "--strategy", "exact", "--out", str(path))
    assert "split: exact" in out and "proven optimal" in out
    assert read_plan(path).split.info.proven_optimal is True


def test_a_hand_edit_is_noticed(capsys, tmp_path):
    path = tmp_path / "p.json"
    run(capsys, "split", "residual-mlp", "-k", "3", "-q", "--out", str(path))
    data = json.loads(path.read_text())
    first_of_stage_1 = next(n for n in data["nodes"] if n["stage"] == 1)
    first_of_stage_1["stage"] = 0  # a valid edit: the stage boundary moves one node later
    del data["modules"]
    path.write_text(json.dumps(data))
    assert not read_plan(path).split_is_current
    out = run(capsys, "inspect", str(path))
    assert "then edited by hand: the stages are no longer the splitter's" in out


def test_tied_weights_placed_apart_need_gradient_sync_and_every_view_agrees(capsys, tmp_path, monkeypatch):
    (tmp_path / "tied.py").write_text(TIED)
    monkeypatch.chdir(tmp_path)
    out = run(capsys, "split", "tied:build", "-k", "2", "--out", "p.json")
    shared = out.split("shared weights (tied)")[1]
    assert "wte.weight" in shared and "lm_head.weight" in shared
    assert "0, 1" in shared and "yes: sum the gradient across these stages" in shared
    assert "tied weights it had to place apart: wte.weight" in out

    saved = read_plan(tmp_path / "p.json")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, args = importlib.import_module("tied").build()
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    assert sharded.plan.split_info.separated == ("wte.weight",) == saved.split.info.separated
    assert [(w.name, w.stages) for w in saved.gradient_sync()] == [
        (w.name, w.stages) for w in sharded.plan.gradient_sync] == [("wte.weight", (0, 1))]
    summary = json.loads((tmp_path / "p.json").read_text())["summary"]
    assert summary["gradient_sync"] == [{"weight": "wte.weight", "aliases": ["wte.weight", "lm_head.weight"],
                                         "stages": [0, 1]}]


@pytest.mark.parametrize("cost", ["params", "memory"])
def test_saved_plan_stage_costs_count_a_tied_weight_in_every_stage_that_holds_it(capsys, tmp_path, cost):
    """The CLI table read per-node sums, which charge a tied weight to its first reader only, and
    one microbatch of activations for memory: not what the split balanced nor what plan_report says."""
    path = tmp_path / "plan.json"
    run(capsys, "split", "gpt-lm", "-k", "3", "--cost", cost, "--out", str(path))
    saved = read_plan(path)
    model, args, _ = load_example("gpt-lm")
    report = autoshard.plan_report(autoshard.load_plan(path, model, args))
    assert saved.stage_costs(cost) == [stage.costs[cost] for stage in report.stages]
    assert saved.bottleneck() == max(stage.costs[cost] for stage in report.stages)
    assert len(report.shared_weights) == 1 and len(report.shared_weights[0].stages) == 2  # the tied embedding
