"""The runtime calibration says when other processes kept the machine busy while it measured:
its numbers then read slow, and the cache keeps them for every later prediction."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import time
import warnings

import pytest

import autoshard
from autoshard.runtime import calibrate, machine_load
from autoshard.runtime.calibrate import RuntimeCalibration, measure_runtime
from autoshard.runtime.machine_load import LoadMeter, machine_cpu_seconds, own_cpu_seconds

MEASURED = RuntimeCalibration(2e9, 1e-4, {"gpipe": 5e-4, "1f1b": 3e-4, "interleaved-1f1b": 4e-4}, 1.1)


@pytest.fixture
def measured_while(monkeypatch):
    """A stand-in calibration child, and the machine's and this process's CPU seconds it reads, one
    per call, in turn."""
    monkeypatch.setattr(calibrate, "run_module", lambda module, timeout: subprocess.CompletedProcess(
        [module], 0, json.dumps(dataclasses.asdict(MEASURED)) + "\n", ""))

    def readings(machine: list, own: list) -> None:
        monkeypatch.setattr(machine_load, "machine_cpu_seconds", lambda: machine.pop(0))
        monkeypatch.setattr(machine_load, "own_cpu_seconds", lambda: own.pop(0))
    return readings


def test_a_runtime_calibrated_on_a_busy_machine_says_so_and_how_to_measure_again(measured_while):
    # 4 CPU seconds of the machine pass, 3 of them busy, 0.5 of them this process's and its children's
    measured_while([(100.0, 200.0), (103.0, 204.0)], [10.0, 10.5])
    with pytest.warns(autoshard.CalibrationLoadWarning, match=r"other processes used 62% of this machine.s CPU "
                      r"time while autoshard measured the pipeline runtime .* cached as measured; "
                      r".*AUTOSHARD_RECALIBRATE=1"):
        assert measure_runtime() == MEASURED  # kept all the same: it is all there is


@pytest.mark.parametrize("machine, own, share", [
    ([(100.0, 200.0), (101.7, 204.0)], [10.0, 10.5], "30%"),  # a little over BUSY_SHARE
    ([(100.0, 200.0), (101.0, 201.0)], [10.0, 10.0], "100%"),  # a window of one CPU second is judged
])
def test_a_runtime_calibrated_just_over_the_busy_share_warns(measured_while, machine, own, share):
    measured_while(machine, own)
    with pytest.warns(autoshard.CalibrationLoadWarning, match=f"other processes used {share} of"):
        measure_runtime()


def test_the_others_share_is_never_below_nothing_when_this_process_counts_more_than_the_machine(monkeypatch):
    # children's CPU seconds arrive when waited for, the machine's ticks as they pass: own can read more
    readings = [(101.0, 204.0)]
    monkeypatch.setattr(machine_load, "machine_cpu_seconds", lambda: readings.pop(0))
    monkeypatch.setattr(machine_load, "own_cpu_seconds", lambda: 13.0)
    assert LoadMeter((100.0, 200.0), 10.0).others_share() == 0.0


def test_the_machines_busy_time_leaves_out_idle_and_iowait(monkeypatch):
    # user nice system idle iowait irq softirq steal: waiting on a disk keeps no CPU busy
    monkeypatch.setattr(machine_load, "open", lambda *args, **kwargs: io.StringIO(
        "cpu  300 0 100 500 80 10 5 5 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"), raising=False)
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    assert machine_cpu_seconds() == pytest.approx((420 / ticks, 1000 / ticks))


@pytest.mark.parametrize("machine, own", [
    ([(100.0, 200.0), (100.6, 204.0)], [10.0, 10.5]),  # others 0.1 s of 4: quiet
    ([(100.0, 200.0), (101.5, 204.0)], [10.0, 10.5]),  # others 1 s of 4: 25%, not more than BUSY_SHARE
    ([(100.0, 200.0), (100.5, 200.5)], [10.0, 10.0]),  # half a CPU second, all others': too short to judge
    ([None, None], [10.0, 10.5])])  # no /proc/stat
def test_a_runtime_calibrated_on_a_quiet_machine_or_one_it_cannot_judge_warns_nothing(measured_while, machine, own):
    measured_while(machine, own)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.CalibrationLoadWarning)
        assert measure_runtime() == MEASURED


def test_the_load_meter_counts_this_processes_work_in_the_machines():
    if machine_cpu_seconds() is None:
        pytest.skip("no /proc/stat on this system: the load is not read here")
    meter = LoadMeter.start()
    deadline = time.process_time() + 1.2
    while time.process_time() < deadline:  # 1.2 s of this process's CPU time, in the machine's too
        pass
    busy = machine_cpu_seconds()[0] - meter.machine[0]
    assert own_cpu_seconds() - meter.own >= 1.15 and busy >= 1.1  # ticks and seconds in the same unit
    assert 0.0 <= meter.others_share() <= 1.0
