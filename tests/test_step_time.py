"""The step-time model: a simulated pipeline step on hand-made stage times, PyTorch's interleaved
order, the plan report's prediction, and refusals of bad settings."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _ComputationType

import autoshard
from autoshard.costs.estimate import DeviceModel
from autoshard.costs.step_time import StepTimeModel, _interleaved_orders, _orders, step_time
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError
from autoshard.report import format_seconds, step_time_lines

FREE = dict(link_latency=0.0)
"""Links that cost nothing for 0 bytes: the step is the schedule's alone."""


def test_the_step_model_is_importable_beside_the_memory_and_device_models():
    """plan_report(step=...) and predict_step(step=...) take it as they take MemoryModel and DeviceModel."""
    assert autoshard.StepTimeModel is StepTimeModel and "StepTimeModel" in dir(autoshard)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k, m", [(2, 2), (2, 8), (4, 4), (4, 8), (3, 5)])
def test_equal_stages_on_free_links_take_the_textbook_m_plus_k_minus_one_slots(schedule, k, m):
    step = step_time([1.0] * k, [2.0] * k, [0.0] * (k - 1), StepTimeModel(schedule, m, **FREE))
    assert step.seconds == pytest.approx((m + k - 1) * 3.0)
    assert step.bubble == pytest.approx((k - 1) / (m + k - 1))
    assert step.busy == (m * 3.0,) * k


def test_each_rank_ends_the_step_with_its_optimizer_step():
    """1F1B, 2 stages, 2 microbatches, forward 1 s and backward 2 s, free links: rank 0 runs its last
    backward from 7 to 9 s, rank 1 ends at 7 s; each then steps its optimizer."""
    free = StepTimeModel("1f1b", 2, link_latency=0.0, link_bandwidth=1e30)
    assert step_time([1, 1], [2, 2], [0], free).seconds == 9
    stepped = step_time([1, 1], [2, 2], [0], free, optimizer_step=[0.5, 3])
    assert stepped.seconds == max(9 + 0.5, 7 + 3) and stepped.optimizer_step == (0.5, 3)
    assert stepped.busy == (2 * 3 + 0.5, 2 * 3 + 3) and "optimizer step, longest on stage 1 (3.000 s)" in str(stepped)
    scaled = step_time([1, 1], [2, 2], [0], dataclasses.replace(free, compute_scale=2.0), optimizer_step=[0.5, 3])
    assert scaled.seconds == max(18 + 1, 14 + 6)
    with pytest.raises(InvalidArgumentError, match="and 1 optimizer steps"):
        step_time([1, 1], [2, 2], [0], free, optimizer_step=[1])


def test_the_slowest_stage_is_the_bottleneck_and_sets_the_pace():
    base = step_time([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.0, 0.0], StepTimeModel("1f1b", 8, **FREE))
    slow = step_time([1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [0.0, 0.0], StepTimeModel("1f1b", 8, **FREE))
    assert slow.bottleneck == 1
    assert slow.seconds >= 8 * 6.0  # the bottleneck's own work
    assert slow.seconds > base.seconds
    assert slow.bubble > base.bubble  # the other stages wait for it


def test_interleaving_shrinks_the_bubble_for_the_same_work():
    """Two ranks doing the same work: two stages of 1 + 2, or four of 0.5 + 1 two per rank."""
    for m in (4, 8):
        plain = step_time([1.0, 1.0], [2.0, 2.0], [0.0], StepTimeModel("1f1b", m, **FREE))
        interleaved = step_time([0.5] * 4, [1.0] * 4, [0.0] * 3, StepTimeModel("interleaved-1f1b", m, **FREE))
        assert sum(interleaved.busy) == sum(plain.busy)
        assert interleaved.seconds < plain.seconds
        assert interleaved.bubble < plain.bubble


def test_the_link_adds_latency_plus_bytes_over_bandwidth_per_crossing():
    """One microbatch through two stages crosses the link twice: forward, then its gradient back."""
    model = StepTimeModel("gpipe", 1, link_bandwidth=1e6, link_latency=0.01)
    step = step_time([1.0, 1.0], [2.0, 2.0], [5e5], model)
    assert step.links == (0.01 + 0.5,)
    assert step.seconds == pytest.approx(1 + 0.51 + 1 + 2 + 0.51 + 2)
    times = [step_time([1.0, 1.0], [2.0, 2.0], [b], StepTimeModel("1f1b", 4)).seconds for b in (0, 1e6, 1e8, 1e9)]
    assert times == sorted(times) and times[-1] > times[0]


def test_stages_on_one_rank_do_not_cross_a_link():
    """Interleaved with one rank: every stage is local, so the bytes cost nothing."""
    model = StepTimeModel("interleaved-1f1b", 2, stages_per_rank=2, link_bandwidth=1.0)
    step = step_time([1.0, 1.0], [2.0, 2.0], [1e9], model)
    assert step.seconds == pytest.approx(2 * 2 * 3.0) and step.bubble == 0.0


def torch_interleaved_order(k: int, per_rank: int, m: int) -> list[list[tuple[bool, int, int]]]:
    """Each rank's (backward, stage, microbatch) as ``ScheduleInterleaved1F1B`` computes them: its own
    method, on a schedule given the four numbers it reads (building one needs a process group)."""
    ranks = k // per_rank
    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = per_rank, ranks, m
    schedule.microbatches_per_round = m // max(1, m // ranks)
    return [[(op.computation_type == _ComputationType.FULL_BACKWARD, op.stage_index, op.microbatch_index)
             for op in schedule._calculate_single_rank_operations(rank) if op is not None]
            for rank in range(ranks)]


@pytest.mark.parametrize("k, per_rank, m", [(4, 2, 2), (4, 2, 4), (4, 2, 8), (8, 2, 4), (6, 3, 6), (8, 4, 8)])
def test_interleaved_order_is_pytorchs(k, per_rank, m):
    orders, rank_of = _interleaved_orders(k, m, per_rank)
    assert orders == torch_interleaved_order(k, per_rank, m)
    assert rank_of == [s % (k // per_rank) for s in range(k)]


@pytest.fixture(scope="module")
def sharded():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    return autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 16),))


SLOW = DeviceModel(peak_flops=1e6, bandwidth=1e6)


def test_the_plan_report_predicts_the_step_from_its_stage_times_and_boundaries(sharded):
    model = StepTimeModel("gpipe", 4, link_bandwidth=1e5, link_latency=1e-3)
    report = autoshard.plan_report(sharded, device=SLOW, step=model)
    seconds = [stage.seconds for stage in report.stages]
    sent = [sum(v.nbytes for v in report.stages[0].values_out)]
    assert sent == [4 * 16 * 4]
    expected = step_time(seconds, [2 * s for s in seconds], sent, model)
    assert report.step_time.seconds == pytest.approx(expected.seconds)
    assert report.step_time.microbatches == 4 and report.step_time.links == (1e-3 + 256 / 1e5,)
    assert report.step_time.source == f"estimated under {SLOW.describe()}; backward = 2 x forward"
    text = str(report)  # the tables compute it again from the plan file they show: the same numbers
    assert f"step time (predicted): {format_seconds(expected.seconds)} for 4 microbatches under gpipe" in text
    assert f"bottleneck stage {expected.bottleneck}" in text and f"step time from: {report.step_time.source}" in text
    assert report.to_dict()["step_time"]["model"]["schedule"] == "gpipe"


def test_the_report_follows_the_memory_models_schedule_by_default(sharded):
    memory = autoshard.MemoryModel(schedule="gpipe", microbatches=8)
    step = autoshard.plan_report(sharded, memory=memory, device=SLOW).step_time
    assert (step.model.schedule, step.microbatches) == ("gpipe", 8)
    assert autoshard.plan_report(sharded, device=SLOW).step_time.microbatches == 2  # 1f1b, one per stage


def test_a_profile_with_backward_is_split_into_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    spec = "capture,shape-prop,profile{backward=true repeats=1 warmup=0},build-dag,linearize,split{stages=2},emit"
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),), pipeline=spec)
    report = autoshard.plan_report(sharded)
    step = report.step_time
    assert "profile{backward=true}" in step.source
    for stage in report.stages:
        assert step.forward[stage.index] + step.backward[stage.index] == pytest.approx(stage.seconds)
        assert step.backward[stage.index] == pytest.approx(2 * step.forward[stage.index])


@pytest.mark.parametrize("settings, words", [
    (dict(schedule="1f1c"), "unknown schedule '1f1c' \\(did you mean '1f1b'\\?\\)"),
    (dict(microbatches=0), "microbatches must be at least 1, got 0"),
    (dict(link_bandwidth=0), "link_bandwidth .* must be a finite number > 0, got 0"),
    (dict(link_bandwidth=float("inf")), "link_bandwidth"),
    (dict(link_latency=-1.0), "link_latency .* >= 0"),
    (dict(compute_scale=0), "compute_scale must be a finite number > 0, got 0"),
])
def test_bad_settings_are_refused_naming_the_value(settings, words):
    with pytest.raises(InvalidArgumentError, match=words):
        StepTimeModel(**settings)


@pytest.mark.parametrize("settings, words", [
    (dict(schedule=3), "schedule must be the name of one of gpipe, 1f1b, interleaved-1f1b, got int 3"),
    (dict(link_bandwidth=[25e9]), "link_bandwidth .* must be a finite number > 0, got list"),
    (dict(message_seconds=None), "message_seconds must be a finite number >= 0, got NoneType None"),
])
def test_settings_of_the_wrong_type_are_type_errors(settings, words):
    with pytest.raises(InvalidArgumentTypeError, match=words):
        StepTimeModel(**settings)


def test_rates_and_times_may_be_written_with_units():
    written = StepTimeModel(link_bandwidth="25GB/s", link_latency="5us", message_seconds="0.2 ms")
    assert written == StepTimeModel(link_bandwidth=25e9, link_latency=5e-6, message_seconds=2e-4)
    assert written.to_dict()["link_bandwidth"] == 25e9  # stored as the number
    for micro in ("5\u00b5s", "5 \u03bcs"):  # the micro sign the tables print, and the Greek mu
        assert StepTimeModel(link_latency=micro).link_latency == 5e-6
    with pytest.raises(InvalidArgumentError, match="link_latency takes a time >= 0 such as 5us.*got '5 parsecs'"):
        StepTimeModel(link_latency="5 parsecs")
    with pytest.raises(InvalidArgumentError, match="link_bandwidth takes a rate > 0 .*got '25GB'"):
        StepTimeModel(link_bandwidth="25GB")
    with pytest.raises(InvalidArgumentError, match="link_bandwidth takes a rate > 0 .*got 'fast'"):
        StepTimeModel(link_bandwidth="fast")


def test_settings_a_schedule_cannot_run_are_refused():
    with pytest.raises(InvalidArgumentTypeError, match="microbatches must be an int"):
        StepTimeModel(microbatches=2.5)
    with pytest.raises(InvalidArgumentError, match="stages must divide by it"):
        step_time([1.0] * 3, [1.0] * 3, [0.0] * 2, StepTimeModel("interleaved-1f1b", 4))
    with pytest.raises(InvalidArgumentError, match="rounds"):
        step_time([1.0] * 4, [1.0] * 4, [0.0] * 3, StepTimeModel("interleaved-1f1b", 5))
    with pytest.raises(InvalidArgumentError, match="want k, k, k - 1"):
        step_time([1.0, 1.0], [1.0], [0.0])


@pytest.mark.parametrize("schedule, k, m", [("gpipe", 3, 4), ("gpipe", 4, 2), ("1f1b", 3, 4), ("1f1b", 4, 4),
                                            ("interleaved-1f1b", 4, 4)])
def test_every_order_runs_each_microbatch_forward_then_backward_once_per_stage(schedule, k, m):
    orders, rank_of = _orders(StepTimeModel(schedule, m), k, m)
    ops = [op for order in orders for op in order]
    assert sorted(ops) == sorted((b, s, mb) for b in (False, True) for s in range(k) for mb in range(m))
    for rank, order in enumerate(orders):
        assert all(rank_of[s] == rank for _, s, _ in order)
        assert all(order.index((False, s, mb)) < order.index((True, s, mb)) for _, s, mb in order)


def test_interleaved_steps_default_to_one_microbatch_per_rank_as_the_memory_model_counts():
    model = StepTimeModel(schedule="interleaved-1f1b", stages_per_rank=2)
    memory = autoshard.MemoryModel(schedule="interleaved-1f1b", stages_per_rank=2)
    assert model.microbatch_count(4) == 2 == max(memory.all_in_flight(4))
    assert StepTimeModel(schedule="1f1b").microbatch_count(4) == 4


def test_numpy_numbers_are_numbers():
    import numpy as np

    assert StepTimeModel(link_bandwidth=np.float32(1e9), link_latency=np.int64(0)).link_seconds(1e9) == 1.0
    # and stored as Python's, so a report's to_dict() stays JSON-ready
    model = StepTimeModel("interleaved-1f1b", np.int64(4), np.int32(2), link_bandwidth=np.float32(2e9),
                          link_latency=np.int64(0), backward_ratio=np.float32(2), message_seconds=np.int64(0),
                          compute_scale=np.float32(1.5))
    assert json.loads(json.dumps(model.to_dict())) == {
        "schedule": "interleaved-1f1b", "microbatches": 4, "stages_per_rank": 2, "link_bandwidth": 2e9,
        "link_latency": 0.0, "backward_ratio": 2.0, "message_seconds": 0.0, "compute_scale": 1.5}
    assert {type(value) for value in model.to_dict().values()} == {str, int, float}


def test_stages_of_one_rank_send_no_messages():
    """Interleaved 1F1B with as many stages per rank as stages runs on one rank: no link is paid."""
    one_rank = StepTimeModel("interleaved-1f1b", 2, stages_per_rank=2, link_bandwidth=1.0, link_latency=5.0)
    step = step_time([1.0, 1.0], [2.0, 2.0], [1e6], one_rank)
    assert step.links == (0.0,) and step.seconds == pytest.approx(2 * (1.0 + 2.0) * 2)
    assert not any("links" in line for line in step_time_lines(step))


def test_a_bubble_short_of_all_the_time_does_not_print_as_100_percent():
    """Stages of 10 ns behind 100 µs links: the ranks idle over 99% of the step, not all of it."""
    step = step_time([1e-8, 1e-8], [2e-8, 2e-8], [0.0], StepTimeModel("gpipe", 4))
    assert 0.995 <= step.bubble < 1 and "bubble over 99% of the ranks' time" in str(step)


def test_a_step_prints_as_its_time_schedule_bubble_and_bottleneck():
    """``print(predict_step(...))`` reads as the report's line, not as the dataclass's fields."""
    step = step_time([1e-3, 3e-3], [2e-3, 6e-3], [0.0], StepTimeModel("gpipe", 4, **FREE))
    assert str(step) == (f"{format_seconds(step.seconds)} for 4 microbatches under gpipe; bubble {step.bubble:.0%} of "
                         "the ranks' time; bottleneck stage 1 (forward 3.000 ms + backward 6.000 ms per microbatch)")
    assert step_time_lines(step)[0] == f"step time (predicted): {step}"


def test_a_schedule_the_runtime_runs_and_the_models_do_not_is_refused_saying_so():
    for make in (lambda name: StepTimeModel(name), lambda name: autoshard.MemoryModel(schedule=name)):
        with pytest.raises(InvalidArgumentError, match="the runtime runs more of PyTorch's schedules"):
            make("interleaved-zero-bubble")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stages_per_rank_is_refused_for_a_schedule_that_runs_one_stage_per_rank(schedule):
    """As ``MemoryModel`` refuses it: ``StepTimeModel("1f1b", stages_per_rank=3)`` counted for nothing."""
    with pytest.raises(InvalidArgumentError, match=r"stages_per_rank=3 .*interleaved-1f1b"):
        StepTimeModel(schedule, stages_per_rank=3)
    assert StepTimeModel(schedule).stages_per_rank == 1
    assert StepTimeModel("interleaved-1f1b").stages_per_rank == 2
