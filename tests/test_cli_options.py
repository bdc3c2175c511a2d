"""The CLI's options, run in-process through ``main`` (fast: torch is imported once)."""

from __future__ import annotations

import io
import json
import re
import shlex
import sys

import pytest

from autoshard import cli, commands, progress
from autoshard.errors import AutoshardError
from autoshard.targets import TargetError, load_target

from test_cli import modules, stage_rows


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def flags(memory_model: dict) -> dict:
    """The part of a plan file's memory model that --optimizer-bytes and --microbatches set."""
    return {key: memory_model[key] for key in ("optimizer_bytes_per_param", "microbatches")}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def flat(text: str) -> str:
    return " ".join(text.split())


def test_examples_and_passes_are_listed(capsys):
    code, out, _ = run(capsys, "examples")
    assert code == 0 and all(n in out for n in ("branched", "transformer-lm", "residual-mlp", "long-skip"))
    code, out, _ = run(capsys, "passes")
    assert code == 0 and all(n in out for n in ("trace", "build-dag", "linearize", "split", "emit", "verify"))
    assert "tolerance" in out


def test_wrapped_leaves_are_listed_with_their_stage_and_reason(capsys):
    code, out, err = run(capsys, "split", "branched", "-k", "5")
    assert code == 0, err
    assert [modules(r[1]) for r in stage_rows(out)] == [f"blocks.{i}-{i + 1}" for i in (0, 2, 4, 6, 8)]
    wrapped = out.split("kept whole")[1]
    assert "│ module │ blocks.0 │ 0     │" in wrapped and "│ module │ blocks.9 │ 4     │" in wrapped
    assert "control flow" in wrapped


def test_compare_shows_strategies_side_by_side(capsys):
    code, out, err = run(capsys, "split", "branched", "-k", "4", "--compare", "greedy,uniform")
    assert code == 0, err
    assert "strategies compared" in out and "modules per stage" in out
    lines = [line for line in out.splitlines() if line.startswith("│ greedy") or line.startswith("│ uniform")]
    assert len(lines) == 2
    assert "1.200" in lines[0]  # greedy: 3 blocks of 10 in stage 0 against a lower bound of 2.5 blocks
    assert "1.200" in lines[1]  # uniform: 3, 3, 2, 2 blocks
    assert "verified" not in out  # comparing builds no stages


def test_compare_drops_the_tolerance_for_baselines_and_dumps_every_split(capsys, tmp_path):
    """A pipeline's tolerance is min-cut's; greedy, which has no use for it, is compared without it
    (alone, split{strategy=greedy tolerance=...} is refused), and each strategy's split is dumped."""
    spec = "trace,shape-prop,build-dag,linearize,split{tolerance=0.1},emit"
    code, out, err = run(capsys, "split", "branched", "-k", "2", "--pipeline", spec, "--compare", "greedy,min-cut",
                         "--dump-dir", str(tmp_path))
    assert code == 0, err
    assert sum(line.startswith(("│ greedy", "│ min-cut")) for line in out.splitlines()) == 2
    splits = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith("-split.txt"))
    assert splits == ["004-split.txt", "005-split.txt"]
    assert "strategy=greedy" in (tmp_path / splits[0]).read_text().splitlines()[0]


def test_compare_refuses_unknown_strategies_and_saving(capsys):
    code, _, err = run(capsys, "split", "branched", "-k", "2", "--compare", "greedy,nope")
    assert code == 2 and "unknown: 'nope';" in flat(err) and "known: " in err
    code, _, err = run(capsys, "split", "branched", "-k", "2", "--compare", "greedy,mincut")
    assert code == 2 and "unknown: 'mincut' (did you mean 'min-cut'?)" in flat(err)
    code, _, err = run(capsys, "split", "branched", "-k", "2", "--compare", "greedy", "--out", "x.json")
    assert code == 2 and "run again with one --strategy" in flat(err)
    code, _, err = run(capsys, "split", "branched", "-k", "2", "--compare", "")  # was ignored: one split shown
    assert code == 2 and "unknown: (none given)" in flat(err)


def test_an_empty_cost_is_refused_not_taken_for_the_default(capsys):
    code, _, err = run(capsys, "split", "branched", "-k", "2", "--cost", "")
    assert code == 2 and "unknown cost model ''; known: " in flat(err), err


def test_strategy_option_reaches_the_split(capsys, tmp_path):
    code, out, err = run(capsys, "split", "branched", "-k", "4", "--strategy", "uniform", "--out",
                         str(tmp_path / "p.json"))
    assert code == 0, err
    counts = [int(r[2]) for r in stage_rows(out)]
    assert len(counts) == 4 and max(counts) - min(counts) <= 1  # uniform: equal node counts
    assert "strategy=uniform" in json.loads((tmp_path / "p.json").read_text())["pipeline"]


def test_inspect_a_target_builds_no_stages(capsys):
    code, out, err = run(capsys, "inspect", "long-skip", "-k", "2", "--timing")
    assert code == 0, err
    assert [modules(r[1]) for r in stage_rows(out)] == ["stack.0-3", "stack.4-7"]
    assert "verified" not in out
    timing = out.split("autoshard pass timing")[1]
    assert "split{stages=2}" in timing and "emit" not in timing


def test_inspect_a_saved_plan_shows_the_same_tables(capsys, tmp_path):
    path = str(tmp_path / "plan.json")
    code, split_out, err = run(capsys, "split", "residual-mlp", "-k", "2", "--out", path)
    assert code == 0, err
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    assert stage_rows(out) == stage_rows(split_out)
    code, _, err = run(capsys, "inspect", path, "--stages", "3")
    assert code == 2 and "cannot be used when inspecting a saved plan" in flat(err)


def test_custom_pipeline_timing_and_dump_dir(capsys, tmp_path):
    spec = "trace,build-dag,linearize,split{cost=nodes},emit"
    code, out, err = run(capsys, "split", "residual-mlp", "-k", "2", "--pipeline", spec, "--timing",
                         "--dump-dir", str(tmp_path / "dump"))
    assert code == 0, err
    assert "split{stages=2 cost=nodes}" in flat(out) and "nodes (split)" in out
    assert "autoshard pass timing" in out and "total" in out
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == [
        "000-trace.txt", "001-build-dag.txt", "002-linearize.txt", "003-split.txt", "004-emit.txt"]


def test_quiet_prints_nothing_but_still_writes(capsys, tmp_path):
    code, out, err = run(capsys, "split", "residual-mlp", "-k", "2", "-q", "--out", str(tmp_path / "p.json"))
    assert (code, out, err) == (0, "", "")
    assert (tmp_path / "p.json").exists()


def test_progress_names_each_pass_on_a_terminal_and_quiet_silences_it(capsys, monkeypatch):
    terminal = FakeTTY()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["inspect", "residual-mlp", "-k", "2"]) == 0
    assert "autoshard: " in terminal.getvalue()
    quiet_terminal = FakeTTY()
    monkeypatch.setattr(sys, "stderr", quiet_terminal)
    assert cli.main(["inspect", "residual-mlp", "-k", "2", "--quiet"]) == 0
    assert quiet_terminal.getvalue() == ""
    assert progress.enabled()  # --quiet lasts for its command only


@pytest.mark.parametrize("argv,message", [
    (("split", "residual-mlp", "-k", "0"), "--stages must be at least 1"),
    (("split", "branched", "-k", "100"), "cannot split into 100 non-empty stages: the maximum is"),
    (("split", "residual-mlp"), "say how many stages: --stages K"),
    (("split", "residual-mlp", "-k", "2", "--pipeline", "trace,split"), "build-dag"),
    (("split", "residual-mlp", "-k", "2", "--pipeline", "trace,build-dag,linearize,split,emit",
      "--strategy", "greedy"), "set the strategy in the spec"),
    (("split", "residual-mlp", "-k", "2", "--svg", "plan.png"), "--svg writes a .svg file"),
    (("split", "residual-mlp", "-k", "2", "--out", "no-such-folder/plan.json"),
     "--out writes 'no-such-folder/plan.json', but there is no folder 'no-such-folder': create it first"),
    (("split", "residual-mlp", "-k", "2", "--time-profile", "no-such-folder/profile.json"),
     "--time-profile writes 'no-such-folder/profile.json', but there is no folder 'no-such-folder'"),
    (("split", "residual-mlp", "-k", "2", "--cost", "flopz"), "unknown cost model 'flopz' (did you mean 'flops'?)"),
    (("split", "residual-mlp", "-k", "2", "--strategy", "mincut"),
     "unknown strategy 'mincut' (did you mean 'min-cut'?)"),
    (("split", "residual-mlp", "-k", "2", "--pipeline", "trace,build-dag,linearize,split{strategy=mincut},emit"),
     "unknown strategy 'mincut' (did you mean 'min-cut'?)"),
    (("split", "residual-mpl", "-k", "2"), "did you mean 'residual-mlp'?"),
    (("split", "residual-mlp", "-k", "2", "--max-memory", "12XB"), "--max-memory takes bytes per stage"),
    (("split", "residual-mlp", "-k", "2", "--max-memory", "1GB,2GB,3GB"),
     "--max-memory has 3 entries but there are 2 stages"),
    (("split", "residual-mlp", "-k", "2", "--microbatches", "0"), "--microbatches must be at least 1"),
    (("split", "residual-mlp", "-k", "2", "--optimizer-bytes", "-1"),
     "--optimizer-bytes must be a number >= 0"),
])
def test_refused_requests_exit_2_with_the_reason(capsys, argv, message):
    """The reason names the flags the user typed, never the library's parameter names."""
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in flat(err)
    assert err.startswith("error: ") and "Traceback" not in err and out == ""
    assert not any(name in err for name in commands.FLAGS_OF_PARAMETERS)


def test_library_parameter_names_become_flags_but_specs_and_paths_stay():
    """The mapping rewrites names standing alone only: a spec's options, a path or a file name that
    happens to contain one is what the user typed, and must stay copyable."""
    assert commands.in_flag_terms("num_stages is 3; max_memory[1] is 1,000") == (
        "--stages is 3; --max-memory (stage 1) is 1,000")
    assert commands.in_flag_terms("under memory_budgets [1.0] with memory_in_flight [2]") == (
        "under --max-memory budgets [1.0] with microbatches in flight [2]")
    kept = "split{stages=2 max-memory=1.0} /x/max_memory/p.json max_memory.json my_num_stages"
    assert commands.in_flag_terms(kept) == kept
    kept = "split{stages=2 tolerance=0.1},emit with memory_model=MemoryModel(stages_per_rank=1)"  # was --tolerance=
    assert commands.in_flag_terms(kept) == kept


def test_errors_are_not_wrapped_so_a_spec_copies_whole(capsys, monkeypatch):
    """rich wraps at 80 columns when stderr is a pipe (or at the terminal's width): the reproducing
    spec broke in the middle, even at the space inside split{...}."""
    monkeypatch.setenv("COLUMNS", "80")
    code, _, err = run(capsys, "inspect", "residual-mlp", "-k", "2", "--strategy", "nope")
    assert code == 2
    spec = "capture,shape-prop,build-dag,linearize,split{stages=2 strategy=nope}"
    assert any(line.endswith("reproduce with pipeline: " + spec) for line in err.splitlines()), err


def test_a_saved_plan_cannot_be_changed_from_the_command_line(capsys, tmp_path):
    path = str(tmp_path / "plan.json")
    assert run(capsys, "split", "residual-mlp", "-k", "2", "-q", "--out", path)[0] == 0
    code, _, err = run(capsys, "split", "residual-mlp", "--plan", path, "--cost", "nodes")
    assert code == 2 and "--cost cannot change a saved plan" in flat(err)
    code, _, err = run(capsys, "split", "residual-mlp", "--plan", path, "-k", "3")
    assert code == 2 and "has 2 stages, not 3" in flat(err)


def test_compare_with_a_saved_plan_advises_a_command_that_works(capsys, tmp_path):
    """The advice was "run again with one --strategy", which --plan refuses; the command it gives now
    compares strategies on the saved plan's pipeline, stage count and memory model."""
    path = str(tmp_path / "plan.json")
    assert run(capsys, "split", "residual-mlp", "-k", "2", "--microbatches", "1", "-q", "--out", path)[0] == 0
    code, _, err = run(capsys, "split", "residual-mlp", "--plan", path, "--compare", "greedy,min-cut")
    assert code == 2 and "--strategy" not in err
    command = shlex.split(err.splitlines()[0].split("stage count: ", 1)[1])
    assert command[:3] == ["autoshard", "split", "residual-mlp"] and "--plan" not in command
    assert command[command.index("--microbatches") + 1] == "1"
    code, out, err = run(capsys, *command[1:])
    assert code == 0, err
    assert sum(line.startswith(("│ greedy", "│ min-cut")) for line in out.splitlines()) == 2


def test_the_memory_model_flags_plan_training_memory_and_stay_with_the_plan(capsys, tmp_path):
    """--optimizer-bytes / --microbatches reach the split's memory figures, the report's words and
    the plan file; a plan rebuilt with --plan keeps them, and an older file without them reads as
    the default (Adam, every microbatch in flight)."""
    adam, sgd = tmp_path / "adam.json", tmp_path / "sgd.json"
    assert run(capsys, "split", "gpt-lm", "-k", "3", "-q", "--out", str(adam))[0] == 0
    code, out, err = run(capsys, "split", "gpt-lm", "-k", "3", "--optimizer-bytes", "0", "--microbatches", "1",
                         "--out", str(sgd))
    assert code == 0, err
    assert "state (0 B per parameter)" in flat(out) and "min(k - j, 1)" in flat(out)
    saved_sgd, saved_adam = json.loads(sgd.read_text()), json.loads(adam.read_text())
    assert flags(saved_sgd["memory_model"]) == {"optimizer_bytes_per_param": 0.0, "microbatches": 1}
    assert flags(saved_adam["memory_model"]) == {"optimizer_bytes_per_param": None, "microbatches": None}
    memory = [[s["total"] for s in p["summary"]["training_memory"]["stages"]] for p in (saved_sgd, saved_adam)]
    assert all(a < b for a, b in zip(*memory))  # no optimizer state, one microbatch: less at every stage
    rebuilt = tmp_path / "rebuilt.json"
    assert run(capsys, "split", "gpt-lm", "--plan", str(sgd), "-q", "--out", str(rebuilt))[0] == 0
    assert json.loads(rebuilt.read_text())["summary"] == saved_sgd["summary"]
    for flag, value, kept in (("--microbatches", "2", {"optimizer_bytes_per_param": 0.0, "microbatches": 2}),
                              ("--optimizer-bytes", "4", {"optimizer_bytes_per_param": 4.0, "microbatches": 1})):
        # a flag given with --plan replaces its own value only; the other one stays the plan's
        assert run(capsys, "inspect", "gpt-lm", "--plan", str(sgd), flag, value, "-q", "--out", str(rebuilt))[0] == 0
        assert flags(json.loads(rebuilt.read_text())["memory_model"]) == kept
    del saved_sgd["memory_model"]
    sgd.write_text(json.dumps(saved_sgd))
    code, out, _ = run(capsys, "inspect", str(sgd))
    assert code == 0 and "adam state (2 tensors a parameter in the dtype it steps)" in flat(out)


def test_max_memory_bounds_each_stage_from_the_command_line(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "split", "gpt-lm", "-k", "2", "--max-memory", "0.8MiB", "--out", str(path))
    assert code == 0, err
    assert "max-memory=838860.8,838860.8" in out
    assert all(s["total"] <= 0.8 * 2**20 for s in json.loads(path.read_text())["summary"]["training_memory"]["stages"])
    code, _, err = run(capsys, "split", "gpt-lm", "-k", "2", "--max-memory", "1KB")
    assert code == 2 and re.search(r"--max-memory \(stage \d\) is 1,000", flat(err)) and "memory_budgets" not in err
    code, _, err = run(capsys, "split", "gpt-lm", "--plan", str(path), "--max-memory", "1GB")
    assert code == 2 and "--max-memory cannot change a saved plan" in flat(err)
    assert f"to check the saved plan against a budget: autoshard inspect {path} --max-memory 1GB" in flat(err)


def test_a_hand_edited_plan_with_an_empty_stage_is_rejected(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert run(capsys, "split", "residual-mlp", "-k", "3", "-q", "--out", str(path))[0] == 0
    plan = json.loads(path.read_text())
    for node in plan["nodes"]:
        node["stage"] = min(node["stage"], 1)  # nothing left in stage 2
    path.write_text(json.dumps(plan))
    code, _, err = run(capsys, "split", "residual-mlp", "--plan", str(path))
    assert code == 2
    assert "breaks an invariant: non-empty: stage 2 has no non-input node" in flat(err)
    assert "hint: make a fresh plan" in err and "Traceback" not in err


def test_missing_matplotlib_names_the_extra_before_the_split(capsys, tmp_path, monkeypatch):
    """It was refused after the whole split and verification (12 s for a new user's GPT-2)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(commands, "load_target", lambda target: pytest.fail("the model was loaded before the refusal"))
    code, _, err = run(capsys, "split", "residual-mlp", "-k", "2", "--png", str(tmp_path / "p.png"))
    assert code == 2
    assert "pip install 'autoshard[plot]'" in flat(err) and "Traceback" not in err


def test_an_unexpected_failure_is_one_message_unless_debug(capsys, monkeypatch):
    def crash(target):
        raise RuntimeError("something [odd] happened")

    monkeypatch.setattr(commands, "load_target", crash)
    code, _, err = run(capsys, "split", "residual-mlp", "-k", "2")
    assert code == 1
    assert "unexpected RuntimeError: something [odd] happened" in err and "looks like a bug" in flat(err)
    with pytest.raises(RuntimeError, match="odd"):
        cli.main(["split", "residual-mlp", "-k", "2", "--debug"])
    with pytest.raises(RuntimeError, match="odd"):
        cli.main(["--debug", "split", "residual-mlp", "-k", "2"])


def test_debug_reraises_autoshard_errors(capsys):
    with pytest.raises(AutoshardError, match="at least 1"):
        cli.main(["split", "residual-mlp", "-k", "0", "--debug"])


def test_tolerance_trades_balance_for_fewer_boundary_bytes_and_cannot_change_a_saved_plan(capsys, tmp_path):
    summaries = {}
    for tolerance in ("0", "0.3"):
        path = tmp_path / f"{tolerance}.json"
        code, _, _ = run(capsys, "inspect", "transformer-lm", "-k", "4", "--tolerance", tolerance, "--out", str(path))
        assert code == 0
        summaries[tolerance] = json.loads(path.read_text())["summary"]
    tight, loose = summaries["0"], summaries["0.3"]
    assert loose["total_boundary_bytes"] < tight["total_boundary_bytes"]
    assert tight["bottleneck"] < loose["bottleneck"] <= 1.3 * tight["bottleneck"]
    code, _, err = run(capsys, "inspect", "transformer-lm", "--plan", str(tmp_path / "0.json"), "--tolerance", "0.3")
    assert code == 2 and "--tolerance cannot change a saved plan" in err


@pytest.mark.parametrize("target,advice", [
    ("mymodels.py:build", "give mymodels:build"),
    ("./mymodels.py:build", "give mymodels:build"),
    ("src/models.py:build", "give models:build, with 'src' as the current directory or on PYTHONPATH"),
    ("../models.py:build", "give models:build, with '..' as the current directory or on PYTHONPATH"),
    ("mymodels.py", "give mymodels:FACTORY (FACTORY: the function in it that returns a model"),
    ("/abs/models.py", "give models:FACTORY, with '/abs' as the current directory or on PYTHONPATH (FACTORY: "),
])
def test_a_target_naming_a_file_says_which_module_name_to_give(target, advice):
    """The import failed with "'mymodels' is not a package", which does not say to drop ``.py``."""
    with pytest.raises(TargetError, match="names a file") as refused:
        load_target(target)
    assert advice in str(refused.value)


def test_a_misspelled_factory_is_refused_with_the_closest_name(tmp_path, monkeypatch):
    (tmp_path / "mymodels_typo.py").write_text("def llama():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TargetError, match=r"has no attribute 'lama' \(did you mean 'llama'\?\)"):
        load_target("mymodels_typo:lama")
    (tmp_path / "mymodels_far.py").write_text("import torch\nclass Net:\n    pass\ndef llama():\n    pass\n")
    with pytest.raises(TargetError, match=r"has no attribute 'nope' \(it defines: Net, llama\)"):  # not torch
        load_target("mymodels_far:nope")


def test_a_flag_of_another_command_is_refused_naming_that_command(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["inspect", "residual-mlp", "-k", "2", "--time-stages"])
    err = flat(capsys.readouterr().err)
    assert exited.value.code == 2
    assert "unrecognized arguments: --time-stages; --time-stages is an option of 'autoshard split'" in err
    with pytest.raises(SystemExit):
        cli.main(["inspect", "residual-mlp", "-k", "2", "--no-such-flag"])
    err = capsys.readouterr().err
    assert "is an option of" not in err and "did you mean" not in err


def test_a_misspelt_flag_is_refused_naming_the_closest_one(capsys):
    """argparse (before Python 3.14) says only "unrecognized arguments"."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["split", "residual-mlp", "-k", "2", "--optimzer", "adam"])
    assert exited.value.code == 2
    err = flat(capsys.readouterr().err)
    assert "unrecognized arguments: --optimzer adam; --optimzer (did you mean '--optimizer'?)" in err
    with pytest.raises(SystemExit):  # the flag written with its value (--flag=value): named without it
        cli.main(["inspect", "residual-mlp", "-k", "2", "--optimzer=adam", "--time-stages=yes"])
    err = flat(capsys.readouterr().err)
    assert "; --optimzer (did you mean '--optimizer'?); --time-stages is an option of 'autoshard split'" in err
