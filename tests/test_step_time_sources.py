"""Where the step-time model's stage times come from and what it refuses: a profile that timed the
backward says so itself, through a profile file and a plan file, to plan_report and the CLI alike;
the CLI's link flags; the schedules PyTorch refuses."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import autoshard
from autoshard import cli
from autoshard.costs.step_time import StepTimeModel, step_time
from autoshard.errors import InvalidArgumentError
from autoshard.examples import residual_mlp
from autoshard.plan_io import plan_from_dict, read_plan
from autoshard.report import format_seconds, plan_step_time

SPEC = "capture,shape-prop,profile{{{options}}},build-dag,linearize,split{{stages=2}},emit"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, " ".join(out.out.split()), " ".join(out.err.split())


def shard(pipeline: str | None = None, **kwargs) -> autoshard.ShardedModel:
    model, args, _ = residual_mlp()  # the CLI's residual-mlp: the same graph and sizes
    return autoshard.shard_model(model, 2, example_inputs=args, pipeline=pipeline, **kwargs)


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """A plan profiled with its backward, its profile file and its plan file."""
    folder = tmp_path_factory.mktemp("timed")
    profile, plan = folder / "times.json", folder / "plan.json"
    sharded = shard(SPEC.format(options=f"backward=true repeats=1 warmup=0 path={profile}"))
    sharded.save_plan(plan)
    return sharded, profile, plan


def test_a_profile_that_timed_the_backward_predicts_the_same_step_however_it_is_reloaded(timed, capsys):
    sharded, profile, plan = timed
    step = autoshard.plan_report(sharded).step_time
    assert "forward and backward" in step.source  # split 1 : 2, not the sum taken as a forward
    assert step.forward[0] + step.backward[0] == pytest.approx(autoshard.plan_report(sharded).stages[0].seconds)
    assert autoshard.plan_report(sharded.plan).step_time == step  # a bare StagePlan reads it too
    reloaded = {
        "profile{path=F}": shard(SPEC.format(options=f"path={profile}")),
        "time_profile=F": shard(time_profile=profile),
        "load_plan": autoshard.load_plan(plan, *residual_mlp()[:2]),
    }
    for how, again in reloaded.items():
        assert autoshard.plan_report(again).step_time.seconds == step.seconds, how
    saved = read_plan(plan)
    assert saved.time_backward and plan_step_time(saved).seconds == step.seconds
    code, out, _ = run(capsys, "inspect", str(plan))  # the CLI shows the plan file
    assert code == 0 and f"step time (predicted): {format_seconds(step.seconds)}" in out
    assert "measured forward and backward" in out
    out_plan = plan.with_name("cli.json")  # and the CLI's own split, the profile loaded by path
    code, out, _ = run(capsys, "inspect", "residual-mlp", "-k", "2", "--time-profile", str(profile),
                       "--out", str(out_plan))
    assert code == 0 and f"step time (predicted): {format_seconds(step.seconds)}" in out
    assert plan_step_time(read_plan(out_plan)).seconds == step.seconds


def test_an_old_plan_file_without_the_record_goes_by_its_pipelines_profile_options(timed):
    """Plans written before ``time_backward`` was recorded: their pipeline's ``profile`` options say
    (found by review: they had been read as forward only, and their backward predicted again)."""
    current = read_plan(timed[2])
    data = current.to_dict()
    del data["time_backward"]
    old = plan_from_dict(json.loads(json.dumps(data)))
    assert old.time_backward is None and plan_step_time(old).seconds == plan_step_time(current).seconds
    data["pipeline"] = data["pipeline"].replace("backward=true ", "")
    forward_only = plan_from_dict(json.loads(json.dumps(data)))
    step = plan_step_time(forward_only)
    assert step.forward == pytest.approx(forward_only.stage_seconds()) and "backward = 2 x forward" in step.source
    assert read_plan(timed[2]).to_dict()["time_backward"] is True  # written now, so never guessed again


def test_the_link_flags_reach_the_step_time_model(timed, capsys):
    plan = str(timed[2])
    link = StepTimeModel(link_bandwidth=1e5, link_latency=0.01)
    expected = plan_step_time(read_plan(plan), link)
    code, out, _ = run(capsys, "inspect", plan, "--link-bandwidth", "1e5", "--link-latency", "0.01")
    assert code == 0 and f"step time (predicted): {format_seconds(expected.seconds)}" in out
    assert f"links {format_seconds(expected.links[0])} per message" in out
    code, out, _ = run(capsys, "inspect", plan)
    assert f"links {format_seconds(expected.links[0])}" not in out  # the default link is another


@pytest.mark.parametrize("flag, value, accepted", [
    ("--link-bandwidth", "0", "takes a rate > 0"), ("--link-bandwidth", "-5", "takes a rate > 0"),
    ("--link-bandwidth", "inf", "takes a rate > 0"), ("--link-bandwidth", "25GB", "(in B/s); got '25GB'"),
    ("--link-latency", "nan", "takes a time >= 0 such as 5us, 0.1ms or a bare number of seconds; got 'nan'"),
    ("--link-latency", "-1", "takes a time >= 0"), ("--link-latency", "5 parsecs", "got '5 parsecs'"),
])
def test_a_link_flag_that_is_no_finite_positive_number_is_refused_naming_it(capsys, flag, value, accepted):
    code, _, err = run(capsys, "inspect", "residual-mlp", "-k", "2", flag, value)
    assert code == 2 and f"error: {flag} " in err and accepted in err


def test_the_link_bandwidth_reads_a_rate_with_units_as_a_bare_number_in_bytes_per_second(timed, capsys):
    plan = str(timed[2])
    outputs = {value: run(capsys, "inspect", plan, "--link-bandwidth", value)[1]
               for value in ("2.5e10", "25GB/s", "25000 MB/s", "200Gb/s", "200Gbit/s", "200gbit/s", "200Gbps")}
    lines = {value: next(line for line in out.splitlines() if "GB/s" in line) for value, out in outputs.items()}
    assert len(set(lines.values())) == 1 and "25 GB/s" in lines["25GB/s"]  # (Gb, Gbit, Gbps: gigabits)


@pytest.mark.parametrize("value, warned", [("25", True), ("1e5", True), ("2.5e10", False), ("25GB/s", False)])
def test_a_bare_link_bandwidth_slower_than_any_link_is_warned_as_bytes_per_second(capsys, value, warned):
    """--device-bandwidth 3350 reads GB/s, --link-bandwidth 25 bytes/s: a step predicted 1e9 times too slow, said."""
    code, _, err = run(capsys, "inspect", "residual-mlp", "-k", "2", "--link-bandwidth", value)
    assert code == 0
    assert ("is read as" in err and "bytes per second" in err and "--link-bandwidth 25GB/s" in err) is warned, err


@pytest.mark.parametrize("flag, value, spellings", [
    ("--link-bandwidth", "25gb/s", ("25GB/s for bytes", "25Gbit/s for bits")),
    ("--link-bandwidth", "25 mb/s", ("25MB/s for bytes", "25Mbit/s for bits")),
    ("--link-bandwidth", "25gib/s", ("25GiB/s for bytes", "25Gibit/s for bits")),
    ("--device-bandwidth", "900gb/s", ("900GB/s for bytes", "900Gbit/s for bits")),
])
def test_an_all_lowercase_rate_is_refused_as_ambiguous_naming_both_spellings(capsys, flag, value, spellings):
    """--max-memory 40gb reads gigabytes, so 25gb/s read as gigabits would silently be 8x less."""
    extra = ("--device-tflops", "1") if flag == "--device-bandwidth" else ()
    code, _, err = run(capsys, "inspect", "residual-mlp", "-k", "2", *extra, flag, value)
    assert code == 2 and f"error: {flag} got '{value}', which could mean bytes or bits" in err
    assert all(spelling in err for spelling in spellings)
    with pytest.raises(InvalidArgumentError, match="could mean bytes or bits"):
        StepTimeModel(link_bandwidth=value)


def test_the_link_latency_reads_a_time_with_units_as_a_bare_number_in_seconds(timed, capsys):
    plan = str(timed[2])
    outputs = {value: run(capsys, "inspect", plan, "--link-latency", value)[1]
               for value in ("5e-5", "50us", "50 µs", "0.05ms", "50000ns")}
    lines = {value: next(line for line in out.splitlines() if "per message at most" in line)
             for value, out in outputs.items()}
    assert len(set(lines.values())) == 1 and f"+ {format_seconds(5e-5)} each" in lines["50us"]


def test_link_flags_are_refused_with_compare_which_shows_no_step(capsys):
    code, _, err = run(capsys, "inspect", "residual-mlp", "-k", "2", "--compare", "greedy", "--link-latency", "0")
    assert code == 2 and "--compare does not show" in err


@pytest.mark.parametrize("schedule, name", [(Schedule1F1B, "1f1b"), (ScheduleGPipe, "gpipe")])
@pytest.mark.parametrize("k, m", [(4, 2), (4, 3), (4, 4), (2, 1), (2, 5)])
def test_the_model_refuses_the_microbatch_counts_pytorchs_schedule_refuses(schedule, name, k, m):
    stage = SimpleNamespace(num_stages=k, group_size=k, group_rank=0, stage_index=0, is_first=True, is_last=False)
    try:
        schedule(stage, m)
        torch_refuses = False
    except ValueError:
        torch_refuses = True
    model = StepTimeModel(name, m)
    assert (model.refusal(k) is not None) == torch_refuses
    if torch_refuses:
        with pytest.raises(InvalidArgumentError, match=f"Schedule1F1B needs at least as many microbatches as stages "
                                                       f"and refuses {m} for {k} stages: give at least {k}"):
            step_time([1.0] * k, [2.0] * k, [0.0] * (k - 1), model)


def test_a_report_refuses_such_a_step_given_and_says_why_it_shows_none_for_the_memory_models(timed, capsys):
    sharded = timed[0]
    with pytest.raises(InvalidArgumentError, match="Schedule1F1B"):
        autoshard.plan_report(sharded, step=StepTimeModel("1f1b", 1))
    report = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=1))  # a cap the memory counts
    assert report.step_time is None and report.stages[0].memory is not None
    assert "step time: not predicted: PyTorch's Schedule1F1B needs" in " ".join(str(report).split())
    code, out, _ = run(capsys, "inspect", "residual-mlp", "-k", "2", "--microbatches", "1")
    assert code == 0 and "step time: not predicted: PyTorch's Schedule1F1B needs" in out
