"""The memory model's flags (--optimizer, --schedule, --stages-per-rank, --microbatches,
--master-weights, --optimizer-bytes): they reach the plan and its file, survive a rebuild with
--plan, come back as a command to copy, and bad values are refused naming the flag and the choices."""

from __future__ import annotations

import argparse
import json

import pytest

from autoshard import cli, commands
from autoshard.costs.memory_model import MemoryModel


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,message", [
    (("--optimizer", "adagrad"),
     "--optimizer 'adagrad' is not one the memory model knows; pick one of: adam, adamw, sgd-momentum, sgd, none"),
    (("--optimizer", "sgd_momentum"), "(did you mean 'sgd-momentum'?)"),
    (("--schedule", "zero-bubble"),
     "--schedule 'zero-bubble' is not one the memory model knows; pick one of: 1f1b, gpipe, interleaved-1f1b"),
    (("--stages-per-rank", "0"), "--stages-per-rank must be at least 1"),
    (("--schedule", "interleaved-1f1b", "--stages-per-rank", "3"),
     "interleaved 1F1B runs 3 stages per rank, so the number of stages must divide by it; got 2 stages: "
     "pick --stages-per-rank dividing 2"),
    (("--stages-per-rank", "2"),  # was accepted, and counted nothing under the default 1F1B
     "--stages-per-rank sets how many stages each process runs under --schedule interleaved-1f1b, and the "
     "schedule here is 1f1b, which runs one: add --schedule interleaved-1f1b, or drop --stages-per-rank"),
    (("--schedule", "gpipe", "--stages-per-rank", "2"), "the schedule here is gpipe, which runs one"),
])
def test_a_value_the_memory_model_does_not_know_is_refused_naming_the_flag(capsys, argv, message):
    code, out, err = run(capsys, "inspect", "residual-mlp", "-k", "2", "-q", *argv)
    assert code == 2 and out == ""
    assert message in " ".join(err.split())
    assert "Traceback" not in err and "stages_per_rank" not in err


def test_the_flags_set_the_plans_memory_model_and_a_rebuild_keeps_it(capsys, tmp_path):
    """SGD under GPipe with 2 microbatches and master weights, as the plan file records it; --plan
    keeps it, and --optimizer given then resets the state bytes to that optimizer's own."""
    adam, sgd = tmp_path / "adam.json", tmp_path / "sgd.json"
    assert run(capsys, "inspect", "residual-mlp", "-k", "2", "-q", "--out", str(adam))[0] == 0
    code, out, err = run(capsys, "inspect", "residual-mlp", "-k", "2", "--optimizer", "SGD", "--schedule", "gpipe",
                         "--microbatches", "2", "--master-weights", "--out", str(sgd))
    assert code == 0, err
    assert "sgd state (0 tensors a parameter in the dtype it steps, fp32 master weights)" in " ".join(out.split())
    saved = json.loads(sgd.read_text())
    assert saved["memory_model"] == {**MemoryModel().to_dict(), "optimizer": "sgd", "optimizer_bytes_per_param": None,
                                     "schedule": "gpipe", "microbatches": 2, "master_weights": True}
    totals = [[s["total"] for s in json.loads(p.read_text())["summary"]["training_memory"]["stages"]]
              for p in (sgd, adam)]
    assert totals[0][0] < totals[1][0]  # stage 0: no optimizer state, 2 microbatches in flight as under 1F1B
    rebuilt = tmp_path / "rebuilt.json"
    assert run(capsys, "inspect", "residual-mlp", "--plan", str(sgd), "-q", "--out", str(rebuilt))[0] == 0
    assert json.loads(rebuilt.read_text())["memory_model"] == saved["memory_model"]
    assert run(capsys, "inspect", "residual-mlp", "--plan", str(sgd), "--optimizer", "adam", "--no-master-weights",
               "-q", "--out", str(rebuilt))[0] == 0
    assert json.loads(rebuilt.read_text())["memory_model"] == {
        **saved["memory_model"], "optimizer": "adam", "optimizer_bytes_per_param": None, "master_weights": False}


@pytest.mark.parametrize("model", [
    MemoryModel(),
    MemoryModel(optimizer="sgd-momentum", schedule="interleaved-1f1b", stages_per_rank=4, microbatches=8),
    MemoryModel(optimizer="adamw", optimizer_bytes_per_param=2, schedule="gpipe", master_weights=True),
    MemoryModel(optimizer_foreach=True),
    MemoryModel(optimizer_foreach=False),
    MemoryModel(schedule="gpipe", keep_gradients=True),
])
def test_the_command_to_copy_sets_the_same_memory_model(model):
    """What a refusal's advice (--compare with --plan) prints is parsed back to the same model."""
    args = cli.build_parser().parse_args(["inspect", "residual-mlp", *commands._memory_flags(model)])
    assert isinstance(args, argparse.Namespace)
    assert (commands._memory_model(args) or MemoryModel()) == model


def test_a_saved_plan_is_counted_under_the_memory_flags_given_without_its_model(capsys, tmp_path):
    """``inspect plan.json --schedule gpipe --microbatches 8``: the recorded sizes give the training
    memory of another run, as a plan made with those flags counts it."""
    path, made = tmp_path / "plan.json", tmp_path / "gpipe.json"
    assert run(capsys, "inspect", "gpt-lm", "-k", "2", "-q", "--out", str(path))[0] == 0
    flags = ("--schedule", "gpipe", "--microbatches", "8", "--optimizer", "sgd")
    assert run(capsys, "inspect", "gpt-lm", "-k", "2", "-q", *flags, "--out", str(made))[0] == 0
    judged = tmp_path / "judged.json"
    code, out, err = run(capsys, "inspect", str(path), *flags, "--out", str(judged))
    stages = [json.loads(p.read_text())["summary"]["training_memory"]["stages"] for p in (path, made, judged)]
    assert code == 0, err
    assert [s["total"] for s in stages[2]] == [s["total"] for s in stages[1]] != [s["total"] for s in stages[0]]
    assert "gpipe" in out and "sgd" in out


def test_a_saved_plan_checked_against_a_budget_names_the_stage_over_it(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert run(capsys, "inspect", "gpt-lm", "-k", "2", "-q", "--out", str(path))[0] == 0
    totals = [s["total"] for s in json.loads(path.read_text())["summary"]["training_memory"]["stages"]]
    fullest = max(range(2), key=totals.__getitem__)
    code, out, err = run(capsys, "inspect", str(path), "--max-memory", f"{max(totals):.0f}")
    assert code == 0, err
    assert "max memory (given): " in out and f"fullest stage {fullest} at " in out and "100.0% of its budget" in out
    code, out, err = run(capsys, "inspect", str(path), "--max-memory", f"{max(totals) - 1:.0f}")
    flat = " ".join(err.split())
    assert code == 2 and ": over it" in out
    assert f"plan {path} does not fit: stage {fullest} needs {max(totals):,.0f} bytes" in flat
    assert "1 byte short" in flat
    code, _, err = run(capsys, "inspect", str(path), "--max-memory", "1GB,2GB,3GB")
    assert code == 2 and "3 entries but there are 2 stages" in err


def test_a_saved_plan_counted_for_another_run_is_checked_against_its_own_budget(capsys, tmp_path):
    """A plan made under --max-memory and counted at more microbatches: the table said "over it" but the
    command exited 0 unless the budget was typed again; it exits 2 now, naming the stage over."""
    path = tmp_path / "plan.json"
    assert run(capsys, "inspect", "gpt-lm", "-k", "2", "-q", "--out", str(path))[0] == 0
    budget = max(s["total"] for s in json.loads(path.read_text())["summary"]["training_memory"]["stages"])
    planned = ("inspect", "gpt-lm", "-k", "2", "-q", "--max-memory", f"{budget:.0f}", "--out", str(path))
    assert run(capsys, *planned)[0] == 0
    assert run(capsys, "inspect", str(path), "-q")[0] == 0
    code, out, err = run(capsys, "inspect", str(path), "--microbatches", "8")
    assert code == 2 and ": over it" in out
    assert f"plan {path} does not fit its own --max-memory: stage " in " ".join(err.split())


def test_a_saved_plan_without_sizes_refuses_a_memory_check(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run(capsys, "inspect", "residual-mlp", "-k", "2", "-q", "--pipeline",
                       "capture,build-dag,linearize,split", "--out", str(path))
    assert code == 0, err
    assert run(capsys, "inspect", str(path))[0] == 0
    code, _, err = run(capsys, "inspect", str(path), "--microbatches", "4")
    assert code == 2 and "records no sizes (it was made without shape-prop)" in " ".join(err.split())


def test_a_budgeted_plan_rebuilt_for_other_training_settings_warns_of_the_stage_over_budget(capsys, tmp_path):
    """``--plan`` checks the budget the plan was made under, as ``load_plan`` does: here GPipe keeps all
    8 microbatches in flight where the plan was made for 1F1B's few."""
    fitted = tmp_path / "fitted.json"
    assert run(capsys, "split", "gpt-lm", "-k", "2", "--out", str(fitted))[0] == 0
    fullest = max(s["total"] for s in json.loads(fitted.read_text())["summary"]["training_memory"]["stages"])
    plan = tmp_path / "plan.json"
    assert run(capsys, "split", "gpt-lm", "-k", "2", "--max-memory", f"{fullest:.0f}", "--out", str(plan))[0] == 0
    code, _, err = run(capsys, "split", "gpt-lm", "--plan", str(plan))
    assert code == 0 and "StalePlanWarning" not in err  # as made: within its budget
    code, _, err = run(capsys, "split", "gpt-lm", "--plan", str(plan), "--schedule", "gpipe", "--microbatches", "8")
    flat = " ".join(err.split())
    assert code == 0 and "(StalePlanWarning)" in flat
    assert f"made under --max-memory {fullest:,.0f}, {fullest:,.0f} bytes" in flat and "bytes short" in flat


def test_a_failed_split_prints_a_command_that_reproduces_it_with_its_memory_flags(capsys):
    """The spec alone plans for Adam with every microbatch in flight: run with it, the split under
    --optimizer sgd --microbatches 8 failed another way (or not at all)."""
    import shlex

    argv = ["split", "residual-mlp", "-k", "2", "--max-memory", "1KB", "--tolerance", "0.1", "--optimizer", "sgd",
            "--schedule", "interleaved-1f1b", "--stages-per-rank", "1", "--microbatches", "8", "-q"]
    code, _, err = run(capsys, *argv)
    lines = err.splitlines()
    command = next(line for line in lines if "reproduce on the command line: " in line).split(": ", 1)[1]
    assert code == 2 and "stages_per_rank=1)" in err and "tolerance=0.1 " in err  # no flag inside the spec
    assert shlex.split(command)[:2] == ["autoshard", "split"] and "--optimizer sgd" in command
    again = run(capsys, *shlex.split(command)[1:], "-q")
    assert again[0] == 2 and again[2].splitlines()[0] == lines[0]
    assert run(capsys, *shlex.split(command)[1:7], "-q")[2].splitlines()[0] != lines[0]  # without the flags


def test_a_budget_without_a_unit_too_small_to_split_says_it_was_read_as_bytes(capsys):
    """``--max-memory 10`` meant 10 GB to a user and 10 bytes to the splitter, which said only that the
    budgets sum to 20."""
    code, _, err = run(capsys, "split", "residual-mlp", "-k", "2", "--max-memory", "10", "-q")
    assert code == 2 and "--max-memory 10 is in bytes: give a unit for more, such as 40GiB" in " ".join(err.split())
    code, _, err = run(capsys, "split", "residual-mlp", "-k", "2", "--max-memory", "1e3,2e3", "-q")
    assert code == 2 and "--max-memory 1e3,2e3 is in bytes" in " ".join(err.split())
    code, _, err = run(capsys, "split", "residual-mlp", "-k", "2", "--max-memory", "1KB", "-q")
    assert code == 2 and "is in bytes" not in err


def test_a_failed_rebuild_prints_its_plan_and_memory_flags():
    """A rebuild's pipeline loads the plan file (no stage count to give): the command names the file."""
    args = argparse.Namespace(plan="p.json", no_verify=True, command="split", target="residual-mlp", stages=None)
    assert commands._reproduction(args, None, MemoryModel(optimizer="sgd")) == (
        "autoshard split residual-mlp --plan p.json --no-verify --optimizer sgd")
    assert commands._reproduction(args, None, MemoryModel()) is None
    assert commands._reproduction(args, None, None) is None


def test_stages_per_rank_changes_a_saved_interleaved_plan_and_is_refused_for_a_saved_1f1b_one(capsys, tmp_path):
    """The schedule --stages-per-rank needs may come from the plan file, not a flag."""
    interleaved, plain = tmp_path / "interleaved.json", tmp_path / "plain.json"
    assert run(capsys, "inspect", "residual-mlp", "-k", "2", "-q", "--schedule", "interleaved-1f1b",
               "--out", str(interleaved))[0] == 0
    assert run(capsys, "inspect", "residual-mlp", "-k", "2", "-q", "--out", str(plain))[0] == 0
    rebuilt = tmp_path / "rebuilt.json"
    assert run(capsys, "inspect", "residual-mlp", "--plan", str(interleaved), "--stages-per-rank", "1", "-q",
               "--out", str(rebuilt))[0] == 0
    assert json.loads(rebuilt.read_text())["memory_model"]["stages_per_rank"] == 1
    code, _, err = run(capsys, "inspect", "residual-mlp", "--plan", str(plain), "--stages-per-rank", "1", "-q")
    assert code == 2 and "the schedule here is 1f1b" in " ".join(err.split())
    assert run(capsys, "inspect", "residual-mlp", "--plan", str(interleaved), "--schedule", "gpipe", "-q",
               "--out", str(rebuilt))[0] == 0  # the saved 2 stages per rank are interleaved 1F1B's, not GPipe's
    assert json.loads(rebuilt.read_text())["memory_model"]["stages_per_rank"] == 1


def test_the_tables_show_the_budget_and_how_full_the_fullest_stage_is_against_it(capsys, tmp_path):
    """Whether a plan fits its --max-memory was readable only as bytes in the pipeline spec."""
    from autoshard.report import human_bytes

    free = tmp_path / "free.json"
    code, out, _ = run(capsys, "inspect", "residual-mlp", "-k", "2", "--out", str(free))
    assert code == 0 and "max memory:" not in out  # no budget, no line
    totals = [s["total"] for s in json.loads(free.read_text())["summary"]["training_memory"]["stages"]]
    budgets = [totals[0] * 2, totals[1] * 1.25]
    plan = tmp_path / "plan.json"
    code, out, _ = run(capsys, "inspect", "residual-mlp", "-k", "2", "--out", str(plan),
                       "--max-memory", ",".join(f"{b:.0f}" for b in budgets))
    assert code == 0
    assert (f"max memory: {human_bytes(round(budgets[0]))}, {human_bytes(round(budgets[1]))}; fullest stage 1 at "
            f"{human_bytes(totals[1])}, 80.0% of its budget\n") in out
    code, out, _ = run(capsys, "inspect", "residual-mlp", "--plan", str(plan), "--schedule", "gpipe",
                       "--microbatches", "64")
    assert code == 0 and "% of its budget: over it\n" in out  # rebuilt for more microbatches in flight
    code, out, _ = run(capsys, "inspect", str(plan))
    assert code == 0 and out.count("max memory: ") == 1  # the saved budget, shown once (was twice)
    code, out, _ = run(capsys, "inspect", str(plan), "--max-memory", "1GiB")
    assert code == 0 and out.count("max memory: ") == 1 and out.count("max memory (given): 1.0 GiB") == 1
    code, out, _ = run(capsys, "inspect", "residual-mlp", "-k", "2", "--max-memory", "40GiB")
    assert code == 0 and "max memory: 40.0 GiB per stage; fullest stage " in out
    assert ", under 0.1% of its budget\n" in out  # not 0.0%


def test_the_budget_line_reads_any_split_pass_as_the_stale_plan_warning_does(capsys):
    """The tables read a plan's budget off the split pass named ``split`` only; the warning on a
    rebuilt plan off any pass given ``max-memory``: both read one ``saved_budgets`` now."""
    spec = "capture,shape-prop,build-dag,linearize,split-fixed-order{stages=2 max-memory=40e9},emit"
    code, out, _ = run(capsys, "inspect", "residual-mlp", "-k", "2", "--pipeline", spec)
    assert code == 0 and "max memory: 37.3 GiB per stage; fullest stage " in out
