"""Estimated time per node: the roofline model, its calibration, and measured times winning."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

import autoshard
from autoshard.costs.estimate import (
    DeviceModel,
    bytes_moved,
    calibrated_device,
    device_model,
    estimated_seconds,
    node_times,
)
from autoshard.errors import InvalidArgumentError
from autoshard.lowering.from_fx import WeightInfo
from autoshard.plan_reporting import plan_report

SLOW = DeviceModel(peak_flops=1e3, bandwidth=1e2)
"""1000 FLOP/s and 100 B/s: round numbers make the expected seconds exact."""


def measured_dag(flops: float = 1000.0, seconds: float | None = None) -> nx.DiGraph:
    """x (64 B) -> mm (reads a 64 B weight, allocates 64 B) -> view (no flops, no allocation)."""
    dag = nx.DiGraph(weights={"w": WeightInfo(("w",), 16, 64, "parameter", True)})
    dag.add_node("x", input=True, bytes=64.0, value_meta="x", flops=None, allocated=None, seconds=None)
    dag.add_node("mm", input=False, bytes=64.0, value_meta="t", flops=flops, allocated=64, weights=("w",),
                 seconds=seconds)
    dag.add_node("view", input=False, bytes=64.0, value_meta="t", flops=0, allocated=0, weights=(),
                 seconds=None if seconds is None else 0.0)
    dag.add_edges_from([("x", "mm"), ("mm", "view")])
    return dag


def test_bytes_moved_counts_inputs_weights_and_new_memory_and_a_view_moves_nothing():
    dag = measured_dag()
    assert bytes_moved(dag, "mm") == 64 + 64 + 64
    assert bytes_moved(dag, "view") == 0.0
    assert bytes_moved(dag, "x") == 0.0


def test_the_roofline_takes_the_slower_of_arithmetic_and_memory():
    memory_bound = estimated_seconds(measured_dag(flops=1000.0), SLOW)
    assert memory_bound == {"x": 0.0, "mm": 192 / 1e2, "view": 0.0}
    compute_bound = estimated_seconds(measured_dag(flops=50_000.0), SLOW)
    assert compute_bound["mm"] == 50_000 / 1e3


def test_the_estimate_is_monotone_in_flops():
    sweep = [0.0, 1.0, 1e3, 1.92e3, 2e3, 1e4, 1e6, 1e9]
    seconds = [estimated_seconds(measured_dag(flops=f), SLOW)["mm"] for f in sweep]
    assert seconds == sorted(seconds)
    assert seconds[-1] > seconds[-2] > seconds[-3] > seconds[-4]  # strictly once compute-bound


def test_a_faster_device_gives_a_smaller_estimate():
    dag = measured_dag(flops=1e6)
    assert estimated_seconds(dag, DeviceModel(1e9, 1e9))["mm"] < estimated_seconds(dag, SLOW)["mm"]


def test_measured_times_win_over_any_estimate():
    times = node_times(measured_dag(seconds=0.25), SLOW)
    assert times.measured and times.estimate is None
    assert times.seconds["mm"] == 0.25
    estimated = node_times(measured_dag(), SLOW)
    assert not estimated.measured and estimated.estimate == SLOW


def test_no_flops_means_no_estimate_and_says_what_to_add():
    dag = measured_dag()
    dag.nodes["mm"]["value_meta"] = None  # shape-prop did not run
    with pytest.raises(InvalidArgumentError, match="shape-prop.*example inputs"):
        node_times(dag)


def test_calibration_runs_once_per_process_and_gives_plausible_peaks():
    first = calibrated_device()
    assert calibrated_device() is first
    assert first.calibrated
    assert 1e8 < first.peak_flops < 1e15 and 1e8 < first.bandwidth < 1e13


def test_given_peaks_replace_calibrated_ones():
    given = device_model(2.0, 3.0)
    assert given == DeviceModel(2e12, 3e9, calibrated=False)
    half = device_model(peak_tflops=2.0)
    assert half.peak_flops == 2e12 and half.bandwidth == calibrated_device().bandwidth and not half.calibrated


@pytest.mark.parametrize("peak,bandwidth", [(0.0, 1.0), (1.0, -1.0), (float("inf"), 1.0), (True, 1.0)])
def test_a_device_model_refuses_unusable_peaks(peak, bandwidth):
    with pytest.raises(InvalidArgumentError, match="must be a finite number > 0"):
        DeviceModel(peak, bandwidth)


def test_the_plan_report_estimates_each_stage_under_the_given_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 16),))
    report = plan_report(sharded, device=SLOW)
    expected = estimated_seconds(sharded.plan.dag, SLOW)
    assert report.time_estimate == SLOW
    for stage in report.stages:
        assert stage.seconds == pytest.approx(sum(expected[n] for n in sharded.plan.stage_nodes(stage.index)))
    faster = plan_report(sharded, device=DeviceModel(1e12, 1e12))
    assert all(f.seconds < s.seconds for f, s in zip(faster.stages, report.stages))
