"""A training step predicted from the stages timed whole and the runtime's own costs: the time a
message keeps its ranks busy in the step simulation, ``measure_stage_time``, the runtime
calibration (fitted, cached, refreshable) and ``predict_step``."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import subprocess
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import autoshard
from autoshard import cli
from autoshard.costs import estimate
from autoshard.costs.step_time import StepTimeModel, step_time
from autoshard.errors import InputMismatchError, InvalidArgumentError, InvalidArgumentTypeError, LaunchError
from autoshard.report import format_seconds, step_time_lines
from autoshard.runtime import (
    RuntimeCalibration, calibrate_runtime, measure_stage_memory, measure_stage_time, predict_step, run_local)
from autoshard.runtime import calibrate, predict
from autoshard.runtime.calibrate import TimedSteps, fitted_runtime, measure_runtime
from autoshard.runtime.launch import run_module
from autoshard.runtime.predict import EvalModeStepWarning
from autoshard.runtime.replay import running_device
from autoshard.runtime.stage_time import TIMING_REPEATS, timed_plan

FREE_LINK = {"link_bandwidth": 1e15, "link_latency": 0.0}


def test_each_message_keeps_both_of_its_ranks_busy():
    # 2 stages, 1F1B, 2 microbatches: every op sends or receives one message, so each op lasts
    # f + message; the step is (m + k - 1) ops of forward plus backward, as without messages.
    plain = step_time([1.0, 1.0], [1.0, 1.0], [0.0], StepTimeModel("1f1b", 2, **FREE_LINK))
    busy = step_time([1.0, 1.0], [1.0, 1.0], [0.0], StepTimeModel("1f1b", 2, message_seconds=0.5, **FREE_LINK))
    assert plain.seconds == pytest.approx(6.0) and busy.seconds == pytest.approx(9.0)
    assert busy.busy == pytest.approx((2 * 3.0, 2 * 3.0))  # the messages are the ranks' work too
    assert busy.bubble == pytest.approx(plain.bubble)


def test_a_stage_between_two_ranks_pays_for_both_messages():
    # interleaved, 4 stages on 2 ranks: stages 1 and 2 each have two neighbours on the other rank.
    model = StepTimeModel("interleaved-1f1b", 2, message_seconds=0.25, **FREE_LINK)
    timed = step_time([0.0] * 4, [0.0] * 4, [0.0] * 3, model)
    assert timed.busy == pytest.approx((2 * 0.5, 2 * 1.0, 2 * 1.0, 2 * 0.5))
    one_stage = step_time([1.0], [1.0], [], StepTimeModel("gpipe", 3, message_seconds=5.0))
    assert one_stage.seconds == pytest.approx(6.0)  # no neighbour, no message


def test_message_seconds_is_checked_and_reported():
    with pytest.raises(InvalidArgumentError, match="message_seconds"):
        StepTimeModel(message_seconds=-1e-3)
    assert StepTimeModel(message_seconds=2e-4).to_dict()["message_seconds"] == 2e-4


def test_the_compute_scale_stretches_every_op_and_is_reported():
    # one stage, no messages: the step is m (f + b), each op compute_scale times as long as alone
    plain = step_time([1.0], [2.0], [], StepTimeModel("gpipe", 2))
    slowed = step_time([1.0], [2.0], [], StepTimeModel("gpipe", 2, compute_scale=1.5))
    assert plain.seconds == pytest.approx(6.0) and slowed.seconds == pytest.approx(9.0)
    assert slowed.forward == (1.5,) and slowed.busy == pytest.approx((9.0,))
    assert "(forward 1.500 s + backward 3.000 s per microbatch, x1.50 their time alone)" in str(slowed)
    assert "their time alone" not in str(plain)
    assert " ".join(step_time_lines(slowed)).count("their time alone") == 1  # said once, where the times are
    assert StepTimeModel(compute_scale=1.25).to_dict()["compute_scale"] == 1.25


def _steps(schedule: str, seconds: float, message: float, scale: float) -> TimedSteps:
    """Two stages of ``seconds`` forward and twice that backward, run as ``message`` and ``scale``
    say; each op inside the steps took ``scale`` times its time alone, plus 0.1 ms of the runtime's."""
    step = StepTimeModel(schedule, 8, link_bandwidth=1e9, link_latency=1e-4)
    truth = dataclasses.replace(step, message_seconds=message, compute_scale=scale)
    forward, backward = [seconds, seconds], [2 * seconds, 2 * seconds]
    return TimedSteps(step_time(forward, backward, [4096.0], truth).seconds, 1.5 * seconds * scale + 1e-4, forward,
                      backward, [4096], step)


def test_the_calibration_takes_the_ops_slowdown_and_fits_each_schedules_time_per_message():
    truth = {"gpipe": 5e-4, "1f1b": 3e-4}
    # the ops of the pipelines whose compute counts, less those whose compute hardly does, give the scale
    runs = {schedule: (_steps(schedule, 1e-5, message, 1.3), _steps(schedule, 2e-3, message, 1.3))
            for schedule, message in truth.items()}
    message, scale = fitted_runtime(runs)
    assert scale == pytest.approx(1.3, rel=1e-9) and message == pytest.approx(truth, rel=1e-4)
    tiny, working = runs["1f1b"]
    quicker = dataclasses.replace(tiny, measured=tiny.simulated(0.0, 1.3) * 0.9)  # faster than its stages allow
    assert fitted_runtime({"1f1b": (quicker, working)})[0] == {"1f1b": 0.0}
    wild = dataclasses.replace(working, inside=working.alone * 100)
    assert fitted_runtime({"1f1b": (tiny, wild)})[1] == calibrate.SCALE_RANGE[1]  # clamped


class _Slow(torch.autograd.Function):
    """Sleeps a known time in its forward and in its backward."""

    @staticmethod
    def forward(ctx, x, forward_seconds, backward_seconds):
        time.sleep(forward_seconds)
        ctx.backward_seconds = backward_seconds
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_seconds)
        return grad, None, None


class _Sleepy(nn.Module):
    def __init__(self, forward_seconds: float, backward_seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seconds = (forward_seconds, backward_seconds)

    def forward(self, x):
        return _Slow.apply(self.lin(x), *self.seconds)


def _sleepy_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Sleepy(0.03, 0.04))


@pytest.fixture(scope="module")
def sleepy():
    """Two stages: the second sleeps 30 ms in its forward and 40 ms in its backward."""
    model = _sleepy_model()
    example = (torch.randn(2, 4),)
    sharded = autoshard.shard_model(model, 2, example_inputs=example)
    assert sharded.plan.assignment["_slow_apply"] == 1
    return sharded, example


def test_a_stage_is_timed_whole_forward_and_backward_apart(sleepy):
    sharded, example = sleepy
    first, second = (measure_stage_time(sharded, j, example, repeats=2) for j in range(2))
    assert first.forward < 0.02 and first.backward < 0.02
    assert 0.03 <= second.forward < 0.06 and 0.04 <= second.backward < 0.07
    assert second.to_dict() == {"stage": 1, "forward": second.forward, "backward": second.backward, "repeats": 2,
                                "device": "cpu", "sent_bytes": 2 * 4 * 4, "plan": first.plan, "spread": second.spread,
                                "threads": torch.get_num_threads(), "optimizer_step": second.optimizer_step}
    assert 0 < second.optimizer_step < 0.02  # Adam over one Linear(4, 4)
    assert first.sent_bytes == 2 * 4 * 4  # 2 rows of 4 floats to the next stage
    assert 0 <= second.spread < 0.5  # two runs of 70 ms of sleep


def test_stages_are_timed_on_the_threads_asked_and_the_callers_are_given_back(sleepy, monkeypatch):
    """On the CPU a stage's time moves with torch's threads (several times over on a busy machine), so
    a step is predicted from stages timed on the threads each rank runs: one, by default, where the
    runtime is calibrated, as its ranks (and torchrun's) run."""
    sharded, example = sleepy
    caller = torch.get_num_threads()
    seen = []

    def forward(ctx, x, forward_seconds, backward_seconds):
        seen.append(torch.get_num_threads())
        ctx.backward_seconds = 0.0
        return x * 1.0

    monkeypatch.setattr(_Slow, "forward", staticmethod(forward))
    assert measure_stage_time(sharded, 1, example, repeats=1, threads=3).threads == 3 and set(seen) == {3}
    assert torch.get_num_threads() == caller
    here = RuntimeCalibration(5e9, 2e-4, {name: 3e-4 for name in ("gpipe", "1f1b", "interleaved-1f1b")}, 1.25)
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: here)
    seen.clear()
    calibrated = predict_step(sharded, example, step=StepTimeModel("gpipe", 2), repeats=1)
    assert set(seen) == {1} and "(measure_stage_time on 1 thread;" in calibrated.source
    seen.clear()
    asked = predict_step(sharded, example, step=StepTimeModel("gpipe", 2), repeats=1, threads=2)  # calibrated too
    assert set(seen) == {2} and "(measure_stage_time on 2 threads;" in asked.source
    seen.clear()
    own = predict_step(sharded, example, step=StepTimeModel("gpipe", 2), calibrate=False, repeats=1, threads=2)
    assert set(seen) == {2} and "(measure_stage_time on 2 threads;" in own.source
    seen.clear()
    predict_step(sharded, example, step=StepTimeModel("gpipe", 2), calibrate=False, repeats=1)
    assert set(seen) == {caller} and torch.get_num_threads() == caller
    for bad in (0, 1.5):
        with pytest.raises((InvalidArgumentError, InvalidArgumentTypeError), match="threads"):
            measure_stage_time(sharded, 1, example, threads=bad)
        with pytest.raises((InvalidArgumentError, InvalidArgumentTypeError), match="threads"):
            predict_step(sharded, example, calibrate=False, threads=bad)


def _sleeping_slower(monkeypatch: pytest.MonkeyPatch, slower: Callable[[int], bool]) -> None:
    """Make each run of the sleepy stage whose number (the warm-up is 0) ``slower`` picks sleep 3x."""
    real, runs = time.sleep, {"forwards": 0, "factor": 1}

    def sleep(seconds: float) -> None:
        if seconds == 0.03:  # a forward: a new run
            runs["factor"] = 3 if slower(runs["forwards"]) else 1
            runs["forwards"] += 1
        real(seconds * runs["factor"])

    monkeypatch.setattr(time, "sleep", sleep)


def test_a_stage_timing_says_how_far_its_runs_spread(sleepy, monkeypatch):
    sharded, example = sleepy
    _sleeping_slower(monkeypatch, lambda run: run % 2 == 1)  # 210 ms, 70 ms, 210 ms, 70 ms
    timed = measure_stage_time(sharded, 1, example, repeats=4)
    assert timed.spread == pytest.approx((0.21 - 0.07) / 0.14, rel=0.2)  # the middle half's width over the median


def test_one_stalled_run_does_not_make_a_timing_spread(sleepy, monkeypatch):
    sharded, example = sleepy
    _sleeping_slower(monkeypatch, lambda run: run == 3)  # one run of nine stalls, as a pause of the VM does
    timed = measure_stage_time(sharded, 1, example, repeats=9)
    # the stalled run alone would read (210 - 70) / 70 = 2.0; a loaded machine's sleeps overshoot
    # by themselves (0.22 read in a CI run beside three other jobs on two cores)
    assert timed.spread < 0.5 and timed.forward + timed.backward < 0.1


def test_the_timed_backwards_accumulate_gradients_as_a_steps_microbatches_do(sleepy, monkeypatch):
    sharded, example = sleepy
    found = []
    real = torch.autograd.backward

    def backward(tensors, grad_tensors=None, **options):
        found.append([p.grad is not None for p in sharded.stages[0].parameters()])
        return real(tensors, grad_tensors, **options)

    monkeypatch.setattr(torch.autograd, "backward", backward)
    measure_stage_time(sharded, 0, example, repeats=3)
    assert found == [[False, False], [True, True], [True, True], [True, True]]  # the warm-up's, then accumulated
    assert all(p.grad is None for p in sharded.parameters())  # and given back


def test_timing_a_stage_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).train()
    example = (torch.randn(4, 8),)
    sharded = autoshard.shard_model(model, 2, example_inputs=example)
    before = {name: t.detach().clone() for name, t in sharded.state_dict().items()}
    draw = torch.random.get_rng_state()
    measure_stage_time(sharded, 1, example)
    assert all(p.grad is None for p in sharded.parameters())
    assert all(torch.equal(before[name], t) for name, t in sharded.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), draw)


def test_bad_arguments_to_measure_stage_time_are_typed_errors(sleepy):
    sharded, example = sleepy
    with pytest.raises(InvalidArgumentError, match="stage 2 is out of range.*from 0 to 1"):
        measure_stage_time(sharded, 2, example)
    with pytest.raises(InvalidArgumentTypeError, match="measure_stage_time needs the ShardedModel"):
        measure_stage_time(nn.Linear(2, 2), 0, example)
    with pytest.raises(InvalidArgumentError, match="repeats"):
        measure_stage_time(sharded, 0, example, repeats=0)
    for measure in (functools.partial(measure_stage_time, sharded, 1),
                    functools.partial(measure_stage_memory, sharded, 1),
                    functools.partial(predict_step, sharded, calibrate=False)):
        with pytest.raises(InputMismatchError, match="one microbatch of the model's inputs, and none were given"):
            measure()


def test_predict_step_simulates_the_stages_timed_whole(sleepy, monkeypatch):
    sharded, example = sleepy

    def refuse() -> RuntimeCalibration:
        raise AssertionError("calibrated where the caller gave every runtime field, or asked for none")

    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", refuse)
    step = StepTimeModel("gpipe", 2, **FREE_LINK)
    predicted = predict_step(sharded, example, step=step, calibrate=False, repeats=2)
    # GPipe on 2 microbatches: the second stage's two forwards then its two backwards, after the first's forward.
    assert 2 * (0.03 + 0.04) <= predicted.seconds < 2 * (0.06 + 0.07)
    assert predicted.model == step and predicted.bottleneck == 1
    assert "each stage timed whole" in predicted.source and "calibrated with the runtime" not in predicted.source
    # then each rank steps Adam over its stages' weights, timed too
    assert "then its adam step" in predicted.source and predicted.optimizer_step[1] > 0
    # and says so: uncalibrated, the runtime's own costs are the defaults, which can move the step several times over
    assert predicted.source.endswith("; as given: link 1e+06 GB/s, no latency; StepTimeModel's defaults, not "
                                     "calibrated: none per message, compute as timed alone")
    bare = predict_step(sharded, example, step=StepTimeModel("gpipe", 2), calibrate=False,
                        repeats=1)  # nothing given: the defaults are not called the caller's
    assert "as given" not in bare.source and bare.source.endswith(
        "; StepTimeModel's defaults, not calibrated: link 1 GB/s, latency 100.0 µs, none per message, compute as "
        "timed alone")
    scaled = predict_step(sharded, example, step=dataclasses.replace(step, message_seconds="0.5ms", compute_scale=1.5),
                          repeats=1)  # every runtime field given: nothing left to calibrate, and nothing measured
    assert scaled.source.endswith("; as given: link 1e+06 GB/s, no latency, 500.0 µs per message, compute x1.50")
    with pytest.raises(InvalidArgumentTypeError, match=r"got str '1f1b': StepTimeModel\('1f1b'\)"):
        predict_step(sharded, example, step="1f1b", calibrate=False)  # shown how, as plan_report shows it


def test_several_steps_are_predicted_from_one_timing_of_the_stages(sleepy):
    sharded, example = sleepy
    times = [measure_stage_time(sharded, j, example, repeats=1) for j in range(2)]
    gpipe, one_f_one_b = (predict_step(sharded, step=StepTimeModel(name, 4, **FREE_LINK), calibrate=False,
                                       times=times) for name in ("gpipe", "1f1b"))
    assert gpipe.forward == one_f_one_b.forward == tuple(t.forward for t in times)
    assert gpipe.backward == tuple(t.backward for t in times)
    with pytest.raises(InvalidArgumentError, match=r"one StageTimeMeasurement per stage.*got \[1, 0\]"):
        predict_step(sharded, calibrate=False, times=times[::-1])
    with pytest.raises(InvalidArgumentError, match=r"got \[0\]"):
        predict_step(sharded, calibrate=False, times=times[:1])


def test_the_step_ends_with_each_rank_stepping_its_optimizer(sleepy):
    """A training step ends with the optimizer's step on every rank: timed with the stages, added
    after each rank's last op (a step of 1 s on each ends the step 1 s later); a plan for no
    optimizer times none."""
    sharded, example = sleepy
    times = [measure_stage_time(sharded, j, example, repeats=1) for j in range(2)]
    assert all(t.optimizer_step > 0 for t in times)
    step = StepTimeModel("gpipe", 2, **FREE_LINK)
    bare = predict_step(sharded, step=step, calibrate=False,
                        times=[dataclasses.replace(t, optimizer_step=0.0) for t in times])
    slow = [dataclasses.replace(t, optimizer_step=1.0) for t in times]
    stepped = predict_step(sharded, step=step, calibrate=False, times=slow)
    assert stepped.seconds == pytest.approx(bare.seconds + 1.0) and "then its adam step" in stepped.source
    assert bare.optimizer_step == () and "no optimizer step timed" in bare.source
    plain = autoshard.shard_model(_sleepy_model(), 2, example_inputs=example,
                                  memory_model=autoshard.MemoryModel(optimizer="none"))
    assert measure_stage_time(plain, 1, example, repeats=1).optimizer_step == 0.0


def test_a_step_predicted_from_timings_whose_runs_spread_widely_warns(sleepy):
    sharded, example = sleepy
    timed = [measure_stage_time(sharded, j, example, repeats=1) for j in range(2)]
    steady = [dataclasses.replace(t, spread=0.1) for t in timed]
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.TimingSpreadWarning)
        predict_step(sharded, calibrate=False, times=steady)
    noisy = [steady[0], dataclasses.replace(steady[1], spread=3.0)]
    with pytest.warns(autoshard.TimingSpreadWarning, match=r"stage 1's timed runs spread 300% .* a quiet machine"):
        predict_step(sharded, calibrate=False, times=noisy)


def test_predict_step_takes_the_link_and_messages_from_the_calibration(sleepy, monkeypatch):
    sharded, example = sleepy
    calibration = RuntimeCalibration(link_bandwidth=2e9, link_latency=1e-4,
                                     message_seconds={"gpipe": 5e-4, "1f1b": 3e-4, "interleaved-1f1b": 4e-4},
                                     compute_scale=1.2)
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: calibration)
    predicted = predict_step(sharded, example, step=StepTimeModel("1f1b", 4), repeats=1)
    assert (predicted.model.link_bandwidth, predicted.model.link_latency, predicted.model.message_seconds,
            predicted.model.compute_scale) == (2e9, 1e-4, 3e-4, 1.2)  # the step's own schedule's message
    assert predicted.model.schedule == "1f1b" and predicted.microbatches == 4
    gpipe = predict_step(sharded, example, step=StepTimeModel("gpipe", 4), repeats=1).model
    assert (gpipe.message_seconds, gpipe.compute_scale) == (5e-4, 1.2)
    assert predicted.source.endswith("; calibrated with the runtime (calibrate_runtime): link 2 GB/s, latency "
                                     "100.0 µs, 300.0 µs per message, compute x1.20")


@pytest.fixture
def runtime_cache(empty_calibration_cache, monkeypatch):
    """A fresh cache directory and process, and a stand-in measurement that counts its runs."""
    runs = []

    def measure() -> RuntimeCalibration:
        runs.append(1)
        return RuntimeCalibration(1e9, 1e-4, {"gpipe": 1.0, "1f1b": 1e-4 * len(runs), "interleaved-1f1b": 2.0})

    monkeypatch.setattr(calibrate, "measure_runtime", measure)
    return runs


def _one_f_one_b() -> float:
    return calibrate_runtime().message_seconds["1f1b"]


def test_the_runtime_calibration_is_cached_beside_the_device_and_refreshable(runtime_cache, monkeypatch):
    assert _one_f_one_b() == 1e-4 and _one_f_one_b() == 1e-4 and runtime_cache == [1]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:  # the calibration's workers run one thread each, whatever the caller runs
        monkeypatch.setattr(estimate, "_THIS_PROCESS", {})
        assert _one_f_one_b() == 1e-4 and runtime_cache == [1]
    finally:
        torch.set_num_threads(threads)
    stored = json.loads(estimate.calibration_cache().read_text())
    assert stored[calibrate.runtime_cache_key()]["message_seconds"] == {
        "gpipe": 1.0, "1f1b": 1e-4, "interleaved-1f1b": 2.0}
    assert calibrate_runtime(refresh=True).message_seconds["1f1b"] == 2e-4 and _one_f_one_b() == 2e-4
    monkeypatch.setattr(estimate, "_THIS_PROCESS", {})  # a new process reads the file
    assert calibrate_runtime() == RuntimeCalibration(1e9, 1e-4, {"gpipe": 1.0, "1f1b": 2e-4, "interleaved-1f1b": 2.0})
    assert len(runtime_cache) == 2
    monkeypatch.setattr(estimate, "_THIS_PROCESS", {})
    monkeypatch.setenv(estimate.RECALIBRATE_ENV, "1")  # measures once per process, not once per call
    assert _one_f_one_b() == pytest.approx(3e-4) and _one_f_one_b() == pytest.approx(3e-4)
    assert len(runtime_cache) == 3


EVERY_SCHEDULE = {"gpipe": 3e-4, "1f1b": 3e-4, "interleaved-1f1b": 3e-4}


@pytest.mark.parametrize("message_seconds, compute_scale", [
    (-1, None), (3e-4, None), ({"1f1b": 3e-4}, None), ({"gpipe": 3e-4, "1f1b": -3e-4, "interleaved-1f1b": 3e-4}, None),
    (EVERY_SCHEDULE, None),  # an older entry: no compute scale
    (EVERY_SCHEDULE, {"1f1b": 1.2}), (EVERY_SCHEDULE, 0.0)])
def test_an_unusable_cached_runtime_calibration_is_measured_again(runtime_cache, message_seconds, compute_scale):
    path = estimate.calibration_cache()
    path.parent.mkdir(parents=True)
    key = calibrate.runtime_cache_key()
    entry = {"link_bandwidth": 1e9, "link_latency": 1e-4, "message_seconds": message_seconds}
    path.write_text(json.dumps({key: entry if compute_scale is None else dict(entry, compute_scale=compute_scale)}))
    assert _one_f_one_b() == 1e-4 and runtime_cache == [1]


def test_a_calibration_gives_every_schedule_a_time_per_message():
    with pytest.raises(InvalidArgumentError, match="each of gpipe, 1f1b, interleaved-1f1b"):
        RuntimeCalibration(1e9, 1e-4, {"1f1b": 1e-4})
    with pytest.raises(InvalidArgumentError, match="message_seconds"):
        RuntimeCalibration(1e9, 1e-4, {"gpipe": 1e-4, "1f1b": -1e-4, "interleaved-1f1b": 1e-4})
    with pytest.raises(InvalidArgumentError, match="compute_scale must be a finite number > 0"):
        RuntimeCalibration(1e9, 1e-4, EVERY_SCHEDULE, -1.0)
    with pytest.raises(InvalidArgumentTypeError, match="compute_scale must be a finite number > 0, got dict"):
        RuntimeCalibration(1e9, 1e-4, EVERY_SCHEDULE, {"1f1b": 1.2})
    assert RuntimeCalibration(1e9, 1e-4, EVERY_SCHEDULE).compute_scale == 1.0


@pytest.mark.multiprocess
@pytest.mark.timeout(calibrate.TIMEOUT + 120)
def test_measuring_the_runtime_runs_two_processes_and_gives_plausible_costs():
    """The real calibration: two gloo processes, a ping-pong and steps of a model too small to
    compute and of one that computes."""
    measured = measure_runtime()
    assert 1e6 < measured.link_bandwidth < 1e13 and 0 < measured.link_latency < 0.05
    assert set(measured.message_seconds) == {"gpipe", "1f1b", "interleaved-1f1b"}
    # on CPU the runtime costs something per message, not seconds; a link latency inflated by a
    # loaded machine can leave a schedule nothing to add (0), but not all three
    assert all(0 <= seconds < 0.05 for seconds in measured.message_seconds.values())
    assert sum(measured.message_seconds.values()) > 0
    # the stages compute about as long in the pipeline as alone, not ten times longer or shorter
    assert 0.5 < measured.compute_scale < 4, measured.compute_scale
    assert "µs of each rank's time per message" in measured.describe()
    assert f"stages compute x{measured.compute_scale:.2f} their time alone" in measured.describe()


def _run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, " ".join(capsys.readouterr().out.split())


def test_the_command_line_predicts_the_step_from_the_stages_timed(capsys, monkeypatch):
    calibration = RuntimeCalibration(2e9, 1e-4, {"gpipe": 5e-4, "1f1b": 3e-4, "interleaved-1f1b": 4e-4})
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: calibration)
    code, out = _run_cli(capsys, "split", "residual-mlp", "-k", "2", "--time-stages")
    assert code == 0 and "each stage timed whole" in out and "calibrated with the runtime" in out
    assert f"{format_seconds(3e-4)} of each rank's time per message" in out
    assert "step time (predicted):" in out and "step time (stages timed):" in out  # the estimate, then the timing
    assert re.search(r"its runs spread up to \d+%", out)


def test_a_link_given_on_the_command_line_is_kept_over_the_calibration(capsys, monkeypatch):
    here = RuntimeCalibration(5e9, 2e-4, {name: 3e-4 for name in ("gpipe", "1f1b", "interleaved-1f1b")}, 1.25)
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: here)
    code, out = _run_cli(capsys, "split", "residual-mlp", "-k", "2", "--time-stages", "--link-latency", "0.01")
    out = " ".join(out.split())
    assert code == 0 and "each stage timed whole" in out
    assert ("calibrated with the runtime (calibrate_runtime): link 5 GB/s, 300.0 µs per message, compute x1.25; "
            f"as given: latency {format_seconds(0.01)}") in out
    assert f"+ {format_seconds(0.01)} each" in out


def test_a_link_flag_that_equals_the_default_is_kept_too(capsys, monkeypatch):
    """--link-bandwidth 1GB/s is given like any other rate: the timed step crosses it, as the report's
    step does, rather than the calibrated link it happens to share a default with."""
    here = RuntimeCalibration(5e9, 2e-4, {name: 3e-4 for name in ("gpipe", "1f1b", "interleaved-1f1b")}, 1.25)
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: here)
    code, out = _run_cli(capsys, "split", "residual-mlp", "-k", "2", "--time-stages", "--link-bandwidth", "1GB/s",
                         "--link-latency", "100us")
    assert code == 0 and ("calibrated with the runtime (calibrate_runtime): 300.0 µs per message, compute x1.25; "
                          f"as given: link 1 GB/s, latency {format_seconds(1e-4)}") in out


def test_the_command_line_refuses_to_time_stages_it_would_print_nothing_of(capsys):
    code = cli.main(["split", "residual-mlp", "-k", "2", "--time-stages", "--quiet"])
    assert code == 2 and "--quiet prints nothing: drop one" in " ".join(capsys.readouterr().err.split())
    for command in ("split", "inspect"):  # the passes' times too (printed nothing, and succeeded)
        code = cli.main([command, "residual-mlp", "-k", "2", "--timing", "-q"])
        assert code == 2 and "--timing prints the time each pass took, and --quiet prints nothing" in " ".join(
            capsys.readouterr().err.split())
    # --compare shows no plan's step either: refused, as the link flags are, rather than ignored
    code = cli.main(["split", "residual-mlp", "-k", "2", "--time-stages", "--compare", "greedy,min-cut"])
    assert code == 2 and ("--time-stages times the stages of one plan, which --compare does not build; drop it, or run "
                          "again with one --strategy") in " ".join(capsys.readouterr().err.split())


def test_the_command_line_refuses_to_time_stages_without_example_inputs_before_splitting(capsys, tmp_path,
                                                                                         monkeypatch):
    # it was refused only after the split, its verification and its tables were printed
    (tmp_path / "bare.py").write_text("import torch\n\ndef build():\n"
                                      "    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])\n")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["split", "bare:build", "-k", "2", "--time-stages"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert ("--time-stages times the stages on the example inputs, and bare:build returned the model alone: make it "
            "return (model, args) or (model, args, kwargs)") in " ".join(captured.err.split())


def test_the_command_line_says_why_it_times_no_step_pytorch_would_refuse(capsys):
    code, out = _run_cli(capsys, "split", "residual-mlp", "-k", "2", "--microbatches", "1", "--time-stages")
    assert code == 0 and "step time (stages timed): not predicted: PyTorch's Schedule1F1B needs" in out
    with pytest.raises(SystemExit):
        cli.main(["inspect", "residual-mlp", "-k", "2", "--time-stages"])  # no stages are built there


def test_gradients_the_model_already_holds_are_given_back_untouched(sleepy):
    sharded, example = sleepy
    for p in sharded.parameters():
        p.grad = torch.full_like(p, 0.5)
    held = [(p.grad, p.grad.clone()) for p in sharded.parameters()]
    measure_stage_time(sharded, 1, example, repeats=1)
    measure_stage_memory(sharded, 1, example)
    try:
        assert all(p.grad is grad and torch.equal(grad, copy) for p, (grad, copy) in zip(sharded.parameters(), held))
    finally:
        sharded.zero_grad(set_to_none=True)


def test_a_caller_under_no_grad_still_gets_the_backward_timed(sleepy):
    sharded, example = sleepy
    with torch.no_grad():
        timed = measure_stage_time(sharded, 1, example, repeats=1)
    assert timed.backward >= 0.04 and torch.is_grad_enabled()


def test_the_link_carries_the_bytes_the_timed_stages_sent(sleepy):
    sharded, example = sleepy
    step = StepTimeModel("gpipe", 2, link_bandwidth=1e3, link_latency=0.0)  # 1 kB/s: the bytes dominate
    predicted = predict_step(sharded, example, step=step, calibrate=False, repeats=1)
    sent = sharded.plan.boundary_bytes()
    assert sent == [2 * 4 * 4] and predicted.links == pytest.approx((sent[0] / 1e3,))
    assert predicted.seconds > 2 * predicted.links[0]  # a forward's value and a backward's gradient cross it
    wider = predict_step(sharded, (torch.randn(6, 4),), step=step, calibrate=False, repeats=1)
    assert wider.links == pytest.approx((6 * 4 * 4 / 1e3,))  # a microbatch of 6 rows sends its own bytes


def test_predict_step_refuses_bad_input_before_calibrating(sleepy, monkeypatch):
    sharded, example = sleepy

    def refuse() -> RuntimeCalibration:
        raise AssertionError("calibrated before checking the arguments")

    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", refuse)
    with pytest.raises(InvalidArgumentTypeError, match="predict_step needs the ShardedModel"):
        predict_step(nn.Linear(2, 2), example)
    with pytest.raises(InvalidArgumentError, match="Schedule1F1B needs at least as many microbatches"):
        predict_step(sharded, example, step=StepTimeModel("1f1b", 1))
    capped = autoshard.shard_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, example_inputs=example,
                                   memory_model=autoshard.MemoryModel(microbatches=1))
    with pytest.raises(InvalidArgumentError, match=r"refuses 1 for 2 stages.*\(the plan's memory model's step: 1f1b, "
                       r"1 microbatch; pass step=StepTimeModel\(schedule, microbatches\) to predict another\)"):
        predict_step(capped, example)  # the counts came from the plan, not from the caller
    with pytest.raises(InvalidArgumentError, match="one StageTimeMeasurement per stage"):
        predict_step(sharded, example, times=[])
    with pytest.raises(InvalidArgumentTypeError, match="calibrate must be True, False or None"):
        predict_step(sharded, example, calibrate="yes")
    with pytest.raises(InvalidArgumentTypeError, match="calibrate must be True, False or None"):
        predict_step(sharded, example, calibrate=1)  # 1 == True, but not a bool
    other = autoshard.shard_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, example_inputs=example)
    with pytest.raises(InvalidArgumentError, match="times were measured on another plan"):
        predict_step(sharded, example, times=[measure_stage_time(other, j, example, repeats=1) for j in range(2)])
    narrow, wide = (autoshard.shard_model(nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 4)), 2,
                                          example_inputs=example) for width in (8, 64))
    assert narrow.plan.assignment == wide.plan.assignment  # one split, other widths
    with pytest.raises(InvalidArgumentError, match="times were measured on another plan"):
        predict_step(wide, example, times=[measure_stage_time(narrow, j, example, repeats=1) for j in range(2)])
    with pytest.raises(InvalidArgumentTypeError, match="times must be a list"):
        predict_step(sharded, example, times=(t for t in ()))
    with pytest.raises(InvalidArgumentTypeError, match="example_kwargs must be a dict"):
        predict_step(sharded, example, [1, 2])
    with pytest.raises(InputMismatchError, match="refuses these arguments"):  # the model's inputs, before calibrating
        predict_step(sharded, (torch.randn(2, 4), torch.randn(2, 4)))


def test_a_step_keeps_its_own_link_and_calibrates_the_rest(sleepy, monkeypatch):
    """Link numbers the caller gives are theirs to keep (as --link-bandwidth keeps them on the command
    line); the runtime's work per message and the compute scale are still this machine's."""
    sharded, example = sleepy
    here = RuntimeCalibration(5e9, 2e-4, {name: 3e-4 for name in ("gpipe", "1f1b", "interleaved-1f1b")}, 1.25)
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: here)
    predicted = predict_step(sharded, example, step=StepTimeModel("gpipe", 2, link_bandwidth=1e6, link_latency=1e-3),
                             repeats=1)
    model = predicted.model
    assert (model.link_bandwidth, model.link_latency, model.message_seconds, model.compute_scale) == (
        1e6, 1e-3, 3e-4, 1.25)
    assert predicted.source.endswith("; calibrated with the runtime (calibrate_runtime): 300.0 µs per message, "
                                     "compute x1.25; as given: link 0.001 GB/s, latency 1.000 ms")
    assert predict_step(sharded, example, step=StepTimeModel("gpipe", 2, link_bandwidth=1e6), calibrate=False,
                        repeats=1).model.compute_scale == 1.0


def test_a_step_keeps_what_it_gives_even_at_the_default_values(sleepy, monkeypatch):
    """A value given is the caller's, whatever it equals: free messages over this machine's link, or
    1 GB/s with the runtime's costs measured; a field left out is calibrated."""
    sharded, example = sleepy
    here = RuntimeCalibration(5e9, 2e-4, {name: 3e-4 for name in ("gpipe", "1f1b", "interleaved-1f1b")}, 1.25)
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: here)
    given = StepTimeModel("gpipe", 2, link_bandwidth="1GB/s", message_seconds=0.0)
    model = predict_step(sharded, example, step=given, repeats=1).model
    assert (model.link_bandwidth, model.link_latency, model.message_seconds, model.compute_scale) == (
        1e9, 2e-4, 0.0, 1.25)
    left = predict_step(sharded, example, step=dataclasses.replace(StepTimeModel(), schedule="gpipe",
                                                                   microbatches=2), repeats=1).model
    assert (left.link_bandwidth, left.message_seconds) == (5e9, 3e-4)  # defaults carried by replace stay defaults


def test_stages_are_measured_out_of_inference_mode(sleepy):
    """Under inference_mode no backward would run: a training step's time and memory would be half told."""
    sharded, example = sleepy
    outside = measure_stage_memory(sharded, 1, example, microbatches=2)
    with torch.inference_mode():
        inputs = (torch.randn(2, 4),)
        timed = measure_stage_time(sharded, 1, inputs, repeats=1)
        held = measure_stage_memory(sharded, 1, inputs, microbatches=2)
        assert torch.is_inference_mode_enabled()  # the caller's mode is given back
    assert timed.backward >= 0.04 and held.peak == outside.peak


def test_stages_on_the_meta_device_are_not_measured(sleepy):
    sharded, example = sleepy
    on_meta = copy.deepcopy(sharded)
    on_meta.stages[1].to("meta")
    assert measure_stage_time(on_meta, 0, example, repeats=1).backward >= 0  # stage 1 does not run for stage 0
    with pytest.raises(InvalidArgumentError, match="stage 1 is on the meta device"):
        measure_stage_memory(on_meta, 1, example)
    with pytest.raises(InvalidArgumentError, match="stage 1 is on the meta device"):
        predict_step(on_meta, example, calibrate=False)
    with pytest.raises(InvalidArgumentError, match="some inputs are on the meta device"):
        measure_stage_time(sharded, 0, (torch.empty(2, 4, device="meta"),))


def test_a_failed_calibration_says_what_the_child_said(monkeypatch):
    def timed_out(module, timeout):
        raise subprocess.TimeoutExpired([module], timeout, output="", stderr="UserWarning: slow\nsecond line\n")

    monkeypatch.setattr(calibrate, "run_module", timed_out)
    with pytest.raises(LaunchError, match="(?s)calibrating the pipeline runtime.*UserWarning: slow\nsecond line"):
        measure_runtime()
    monkeypatch.setattr(calibrate, "run_module",
                        lambda module, timeout: subprocess.CompletedProcess([module], 0, "not json\n", "a warning\n"))
    with pytest.raises(LaunchError, match="(?s)no readable result.*not json.*a warning"):
        measure_runtime()


def _rank(rank: int, world: int) -> int:
    return rank


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_local_processes_start_under_torchruns_environment(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets for its ranks
    assert run_local(_rank, 2, timeout=90) == [0, 1]


def _mark_and_parent(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("AUTOSHARD_LAUNCH_MARK"), os.getppid()


@pytest.mark.timeout(200)
def test_ranks_fork_from_one_server_and_start_with_the_callers_environment_of_each_launch(monkeypatch):
    """The ranks fork from a server that imported torch once (started by the first launch), where
    spawned ones would import it anew at every launch; each launch still hands them the caller's
    environment as it is then, as a spawned process gets it."""
    monkeypatch.setenv("AUTOSHARD_LAUNCH_MARK", "first")
    first = run_local(_mark_and_parent, 2, timeout=90)
    monkeypatch.setenv("AUTOSHARD_LAUNCH_MARK", "second")
    second = run_local(_mark_and_parent, 2, timeout=90)
    assert [mark for mark, _ in first] == ["first"] * 2 and [mark for mark, _ in second] == ["second"] * 2
    parents = {parent for _, parent in first + second}
    assert len(parents) == 1 and os.getpid() not in parents


@pytest.mark.timeout(120)
def test_a_module_run_apart_imports_the_callers_copy_of_autoshard(tmp_path):
    """A script that found autoshard through sys.path.insert must calibrate with that copy, not an installed one."""
    elsewhere = tmp_path / "checkout"
    elsewhere.mkdir()
    (elsewhere / "autoshard").symlink_to(Path(autoshard.__file__).parent, target_is_directory=True)
    (elsewhere / "where_is_autoshard.py").write_text("import autoshard\nprint(autoshard.__file__)\n")
    script = (f"import sys; sys.path.insert(0, {str(elsewhere)!r}); from autoshard.runtime.launch import run_module; "
              "print(run_module('where_is_autoshard', 100).stdout)")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=110,
                           cwd=tmp_path, check=True).stdout
    assert str(elsewhere / "autoshard" / "__init__.py") in found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_module_run_apart_ends_with_the_processes_it_started_at_its_deadline(tmp_path, monkeypatch):
    (tmp_path / "starts_a_sleeper.py").write_text(
        "import subprocess, sys, time\n"
        "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(50)'])\n"
        "print(sleeper.pid, flush=True)\n"
        "time.sleep(50)\n")
    monkeypatch.setattr(sys, "path", [tmp_path, *sys.path])  # a Path entry, as sys.path.append(Path(...)) makes
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_module("starts_a_sleeper", timeout=10)
    sleeper = int(expired.value.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper)


@pytest.mark.timeout(60)
def test_a_module_run_apart_ends_with_the_processes_it_started_on_ctrl_c(tmp_path, monkeypatch):
    pid_file = tmp_path / "sleeper.pid"
    (tmp_path / "starts_a_sleeper_quietly.py").write_text(
        "import pathlib, subprocess, sys, time\n"
        "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(50)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(sleeper.pid))\n"
        "time.sleep(50)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def interrupted(self, timeout=None):
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_module("starts_a_sleeper_quietly", timeout=30)
    monkeypatch.undo()
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper)


def test_a_stage_without_weights_runs_where_its_inputs_are():
    """Its timing must synchronise the device its inputs are on (a weightless stage after GPU stages)."""
    weightless, weighted = nn.ReLU(), nn.Linear(2, 2)
    assert running_device(weightless, ((torch.empty(2, device="meta"),), {})) == torch.device("meta")
    assert running_device(weighted, ((torch.empty(2, device="meta"),), {})) == torch.device("cpu")
    assert running_device(weightless, ((), {"mask": None})) == torch.device("cpu")


def test_a_step_predicted_from_an_eval_mode_plan_warns(sleepy):
    """A training step's dropout and batch norm do not run as in evaluation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)).eval()
    example = (torch.randn(2, 4),)
    sharded = autoshard.shard_model(model, 2, example_inputs=example)
    with pytest.warns(EvalModeStepWarning, match=r"captured in eval mode.*\(1 \(Dropout, stage [01]\) run as they do"):
        predict_step(sharded, example, step=StepTimeModel("gpipe", 2), calibrate=False, repeats=1)
    # many: each named once, by its name in the model (was 'Dropout in stage 0, Dropout in stage 0, ...')
    many = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(4, 4), nn.Dropout(0.5))]).eval()
    with pytest.warns(EvalModeStepWarning, match=r"\(1 \(Dropout, stage 0\), 3 \(Dropout, stage \d\), 5 \(Dropout, "
                      r"stage \d\) and 2 more run .*\(on the command line: make TARGET return the model in training"):
        predict_step(autoshard.shard_model(many, 2, example_inputs=example), example,
                     step=StepTimeModel("gpipe", 2), calibrate=False, repeats=1)
    trained = autoshard.shard_model(model.train(), 2, example_inputs=example)
    plain = autoshard.shard_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval(), 2, example_inputs=example)
    with warnings.catch_warnings():  # in train mode, or with nothing that runs otherwise in eval: no warning
        warnings.simplefilter("error", EvalModeStepWarning)
        for quiet in (trained, plain):
            predict_step(quiet, example, step=StepTimeModel("gpipe", 2), calibrate=False, repeats=1)


class BatchBranch(nn.Module):
    """Doubles its input for batches of more than four rows: a branch the capture fixes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            x = x * 2
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_a_microbatch_the_plans_guards_refuse_is_measured_on_the_specialisation_serving_it():
    """Planned on the whole batch (8 rows), measured on a microbatch (2 rows) that flips a branch:
    the stages measured are the ones a call of those inputs runs, made as the call makes them."""
    torch.manual_seed(0)
    model = BatchBranch()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 16),))
    micro = (torch.randn(2, 16),)
    times = [measure_stage_time(sharded, j, micro, repeats=1) for j in range(2)]
    (made,) = sharded.specializations
    assert {t.plan for t in times} == {timed_plan(made.sharded)} != {timed_plan(sharded)}
    assert measure_stage_memory(sharded, 1, micro).peak > 0 and len(sharded.specializations) == 1
    step = StepTimeModel("gpipe", 4, **FREE_LINK)
    assert predict_step(sharded, step=step, calibrate=False, times=times).forward == tuple(t.forward for t in times)
    assert predict_step(sharded, micro, step=step, calibrate=False).seconds > 0
    whole = [measure_stage_time(sharded, j, (torch.randn(8, 16),), repeats=1) for j in range(2)]
    with pytest.raises(InvalidArgumentError, match="or on several"):  # one plan's stage 0, another's stage 1
        predict_step(sharded, step=step, calibrate=False, times=[whole[0], times[1]])


class BranchWithNorm(nn.Module):
    """Batches of more than four rows take ``wide``, others ``narrow``, which holds a batch norm;
    the plan's example takes ``wide``, so its stages do not hold ``narrow``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.wide, self.last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.narrow = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = self.wide(h) if x.shape[0] > 4 else self.narrow(h)
        if torch.is_grad_enabled():  # a capture fixes the grad mode it sees
            h = h + 1
        return self.last(torch.relu(h)).sum()


def test_measuring_on_a_specialisation_leaves_every_weight_of_the_model_as_it_was():
    """The specialisation serving the microbatch runs ``narrow``, which the plan's stages do not hold:
    its batch norm's statistics and its gradients are given back too. It was made under the grad mode
    the measurement runs in, so it serves the user's calls after."""
    torch.manual_seed(0)
    model = BranchWithNorm().train()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),))
    micro = (torch.randn(2, 4),)
    sharded.specialize(*micro)  # in training mode, made ahead: the stages hold a batch norm
    norm = model.narrow[1]
    statistics = [t.clone() for t in (norm.running_mean, norm.running_var, norm.num_batches_tracked)]
    for j in range(2):
        measure_stage_time(sharded, j, micro, repeats=1)
    measure_stage_memory(sharded, 1, micro)
    after = (norm.running_mean, norm.running_var, norm.num_batches_tracked)
    assert all(torch.equal(a, b) for a, b in zip(statistics, after))
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    evaluated = autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),))
    measure_stage_time(evaluated, 1, micro, repeats=1)  # makes the specialisation, under grad
    assert torch.equal(evaluated(*micro), model(*micro))


class NonzeroAtTheEnd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        return h[h > 0].sum()


def test_a_later_stage_on_the_meta_device_does_not_run_to_measure_an_earlier_one():
    """Choosing the serving plan runs every stage; with one on meta (a rank's others may stay
    there), the plan itself is measured, as before: a meta kernel cannot compute ``h[h > 0]``."""
    torch.manual_seed(0)
    example = (torch.randn(4, 4),)
    sharded = autoshard.shard_model(NonzeroAtTheEnd(), 2, example, cut_before=["b"])
    assert sharded.specializer is not None
    sharded.stages[1].to("meta")
    assert measure_stage_time(sharded, 0, example, repeats=1).plan == timed_plan(sharded)


class NormThenBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.mid, self.last = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.norm(self.first(x)))
        if x.shape[0] > 4:  # checked in stage 1, after stage 0's batch norm has run
            h = h * 2
        return self.last(h).sum()


def test_in_training_mode_a_guard_failing_after_a_batch_norm_ran_is_measured_on_its_specialisation():
    """A call refuses to run the stages again there (the statistics would move twice); a
    measurement gives them back afterwards, so it may."""
    torch.manual_seed(0)
    model = NormThenBranch().train()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),), cut_before=["mid"])
    statistics = [b.clone() for b in model.norm.buffers()]
    timed = measure_stage_time(sharded, 1, (torch.randn(2, 4),), repeats=1)
    (made,) = sharded.specializations
    assert timed.plan == timed_plan(made.sharded)
    assert all(torch.equal(a, b) for a, b in zip(statistics, model.norm.buffers()))


class NormLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sum()


def test_a_later_stage_holding_buffers_on_the_meta_device_does_not_stop_an_earlier_ones_measurement():
    """Buffers on meta are not compared or given back: nothing is computed there to change them."""
    torch.manual_seed(0)
    example = (torch.randn(8, 4),)
    sharded = autoshard.shard_model(NormLater(), 2, example, cut_before=["b"])
    sharded.stages[1].to("meta")
    assert measure_stage_time(sharded, 0, example, repeats=1).forward > 0


class Smoothed(nn.Module):
    """A branch on the batch size, and a buffer updated in place on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.p, self.q, self.c = (nn.Linear(4, 4) for _ in range(4))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = self.p(h) if x.shape[0] > 4 else self.q(h)
        self.ema.mul_(0.5).add_(h.detach().mean(0))
        return self.c(torch.relu(h) + self.ema).sum()


def test_a_specialisation_whose_stages_were_placed_by_hand_is_given_back_too():
    """Its stages' own copies of the model's buffers are neither the plan's nor the model's."""
    torch.manual_seed(0)
    model = Smoothed().train()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),))
    micro = (torch.randn(2, 4),)
    made = sharded.specialize(*micro)
    for stage in made.stages:
        stage._apply(lambda t: t.clone())  # what .to(another device) does to a stage's tensors
    held = [b for stage in made.stages for name, b in stage.named_buffers() if name == "ema"]
    assert held and all(b is not model.ema for b in held)
    measure_stage_time(sharded, 1, micro, repeats=1)
    assert all(torch.equal(b, torch.zeros(4)) for b in held)


def test_a_plan_tried_and_refused_leaves_no_garbage_holding_its_activations():
    """The refused plan's guard is kept to name it, without its traceback (whose frames held that
    plan's activations, graph and all, until a garbage collection)."""
    import gc

    torch.manual_seed(0)
    model = Smoothed().eval()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 4),))
    sharded.specialize(torch.randn(2, 4))
    while gc.collect():  # till none is left: a weak dictionary's entry dropped in one pass frees its value in the next
        pass
    gc.disable()
    try:
        with torch.no_grad():
            sharded(torch.randn(3, 4))  # the plan itself is tried first, and refused
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        assert not [o for o in gc.garbage if isinstance(o, (torch.Tensor, BaseException))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_with_a_later_stage_on_meta_the_specialisation_made_ahead_is_measured():
    """No stage may run to choose the plan there; one made with ``sharded.specialize`` for these
    shapes is the one that serves them."""
    torch.manual_seed(0)
    sharded = autoshard.shard_model(Smoothed().eval(), 2, example_inputs=(torch.randn(8, 4),))
    micro = (torch.randn(2, 4),)
    made = sharded.specialize(*micro)
    sharded.stages[1].to("meta")  # this rank keeps stage 0 only
    assert measure_stage_time(sharded, 0, micro, repeats=1).plan == timed_plan(made)


def test_the_command_line_times_each_stage_as_often_as_asked(capsys, monkeypatch):
    """The spread warning says to time more often: on the command line, --time-repeats."""
    calibration = RuntimeCalibration(2e9, 1e-4, {"gpipe": 5e-4, "1f1b": 3e-4, "interleaved-1f1b": 4e-4})
    monkeypatch.setattr("autoshard.runtime.predict.calibrate_runtime", lambda: calibration)
    asked = []
    real = predict.predict_step  # (the command imports it where --time-stages uses it)
    monkeypatch.setattr(predict, "predict_step", lambda *a, **kw: asked.append(kw["repeats"]) or real(*a, **kw))
    code, out = _run_cli(capsys, "split", "residual-mlp", "-k", "2", "--time-stages", "--time-repeats", "3")
    assert code == 0 and asked == [3] and "step time (stages timed):" in out
    code, out = _run_cli(capsys, "split", "residual-mlp", "-k", "2", "--time-stages")
    assert code == 0 and asked == [3, TIMING_REPEATS]
    assert cli.main(["split", "residual-mlp", "-k", "2", "--time-repeats", "3"]) == 2
    assert "add --time-stages, or drop --time-repeats" in " ".join(capsys.readouterr().err.split())
    assert cli.main(["split", "residual-mlp", "-k", "2", "--time-stages", "--time-repeats", "0"]) == 2
    assert "--time-repeats" in capsys.readouterr().err and asked == [3, TIMING_REPEATS]
