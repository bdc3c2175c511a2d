"""cost=time: measured per node with a progress bar on a terminal only; a saved profile
reproduces the plan exactly and is refused for another graph."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from torch import nn

import autoshard
from autoshard import progress
from autoshard.api import run_pipeline
from autoshard.costs import timing
from autoshard.errors import InvalidArgumentError
from autoshard.examples import LongSkip, ResidualMLP
from autoshard.passes import BuildDagPass, ExampleInputs, Pipeline, TracePass
from autoshard.passes.profile import ProfilePass


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def stderr(monkeypatch):
    def use(stream):
        monkeypatch.setattr(sys, "stderr", stream)
        return stream

    yield use
    progress.set_quiet(False)


def shard_by_time(model, x, **kwargs):
    return autoshard.shard_model(model, 3, example_inputs=(x,), cost="time", **kwargs)


def test_time_shows_a_progress_bar_on_a_terminal(stderr):
    stream = stderr(FakeTTY())
    shard_by_time(ResidualMLP(), torch.randn(4, 16))
    assert "profiling node times" in stream.getvalue()


def test_time_is_silent_when_not_on_a_terminal(stderr):
    stream = stderr(io.StringIO())
    sharded = shard_by_time(ResidualMLP(), torch.randn(4, 16))
    assert stream.getvalue() == ""
    assert all(t > 0 for t in sharded.plan.stage_costs("time"))


def test_a_saved_profile_gives_the_identical_plan_without_measuring(tmp_path, monkeypatch):
    model, x = ResidualMLP(), torch.randn(4, 16)
    path = tmp_path / "times.json"
    first = shard_by_time(model, x, time_profile=path)
    saved = json.loads(path.read_text())
    assert saved["format"] == "autoshard-time-profile" and len(saved["seconds"]) == len(first.plan.stage_nodes(0)) \
        + len(first.plan.stage_nodes(1)) + len(first.plan.stage_nodes(2))

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of loading the profile")

    monkeypatch.setattr("autoshard.passes.profile.measure_node_seconds", no_measuring)
    second = shard_by_time(model, x, time_profile=path)
    assert second.plan.assignment == first.plan.assignment
    assert second.plan.stage_costs("time") == first.plan.stage_costs("time")
    assert torch.equal(second(x), model(x))


def test_the_profile_decides_the_plan(tmp_path):
    """Times written into a profile are the costs the split balances."""
    model, x = ResidualMLP(), torch.randn(4, 16)
    path = tmp_path / "times.json"
    shard_by_time(model, x, time_profile=path)
    data = json.loads(path.read_text())
    data["seconds"] = {name: (100.0 if name == "linears_7" else 1.0) for name in data["seconds"]}
    path.write_text(json.dumps(data))
    sharded = shard_by_time(model, x, time_profile=path)
    assert max(sharded.plan.stage_costs("time")) == 100.0  # the slow node sits alone in its stage
    assert sharded.plan.stage_nodes(sharded.plan.assignment["linears_7"]) == ["linears_7"]


@pytest.mark.parametrize("pipeline", [None, "capture,shape-prop,profile{path=%s},build-dag,linearize,split,emit"])
def test_a_profile_to_write_into_no_folder_is_refused_before_anything_runs(tmp_path, pipeline):
    """The nodes were timed first, and then a PassFailed wrapped the FileNotFoundError of saving."""
    path = tmp_path / "no-such-folder" / "times.json"
    options = {"time_profile": path} if pipeline is None else {"pipeline": pipeline % path}
    with pytest.raises(InvalidArgumentError, match=r"profile path .* is to be written, but there is no folder"):
        autoshard.shard_model(ResidualMLP(), 2, (torch.randn(4, 16),), cost="time", **options)


def test_a_profile_of_another_graph_is_refused(tmp_path):
    path = tmp_path / "times.json"
    shard_by_time(ResidualMLP(), torch.randn(4, 16), time_profile=path)
    with pytest.raises(InvalidArgumentError, match="measured on another graph"):
        shard_by_time(LongSkip(), torch.randn(4, 16), time_profile=path)


@pytest.mark.parametrize("other", [
    lambda: (ResidualMLP(width=64), torch.randn(4, 64)),  # the same graph, wider weights
    lambda: (ResidualMLP(), torch.randn(256, 16)),  # the same model, a larger example batch
])
def test_a_profile_measured_on_other_sizes_is_refused(tmp_path, other):
    """The graph's signature names its nodes only: a profile of the same graph with other weight
    or input sizes matched it, and its times were balanced and reported as this model's."""
    path = tmp_path / "times.json"
    shard_by_time(ResidualMLP(), torch.randn(4, 16), time_profile=path)
    model, x = other()
    with pytest.raises(InvalidArgumentError, match="measured on other sizes.*delete it to measure again"):
        shard_by_time(model, x, time_profile=path)
    shard_by_time(ResidualMLP(), torch.randn(4, 16), time_profile=path)  # its own sizes still load


def test_a_profile_saved_without_sizes_still_loads(tmp_path):
    """Profiles written before sizes were recorded cannot be checked for them, and load as before."""
    model, x = ResidualMLP(), torch.randn(4, 16)
    path = tmp_path / "times.json"
    first = shard_by_time(model, x, time_profile=path)
    data = json.loads(path.read_text())
    data.pop("sizes", None)
    path.write_text(json.dumps(data))
    assert shard_by_time(model, x, time_profile=path).plan.assignment == first.plan.assignment


def test_an_unreadable_profile_says_so(tmp_path):
    path = tmp_path / "times.json"
    path.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="cannot read the time profile"):
        shard_by_time(ResidualMLP(), torch.randn(4, 16), time_profile=path)


def test_forward_backward_timing_leaves_the_gradients_alone():
    model = ResidualMLP()
    pipeline = Pipeline([TracePass(), ProfilePass(backward=True, warmup=0, repeats=1), BuildDagPass()])
    dag = run_pipeline(model, pipeline, ExampleInputs((torch.randn(4, 16),))).program.dag
    assert all(d["seconds"] > 0 for _, d in dag.nodes(data=True) if not d["input"])
    assert all(p.grad is None for p in model.parameters())


def test_timing_settings_are_checked():
    with pytest.raises(InvalidArgumentError, match="repeats >= 1"):
        timing.TimingSettings(repeats=0)
    with pytest.raises(InvalidArgumentError, match="threads >= 1"):
        Pipeline.parse("trace,profile{threads=0}").validate()


#: The thread counts ``_CountsThreads`` ran on, kept outside the model (runs for measuring set the
#: model's own lists back).
_THREADS_SEEN: list[int] = []


class _CountsThreads(nn.Module):
    """Notes torch's thread count each time it runs (kept whole: it branches on its input's values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _THREADS_SEEN.append(torch.get_num_threads())
        return x * 2 if x.sum() > -1e9 else x


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.counts, self.last = nn.Linear(8, 8), _CountsThreads(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.counts(self.first(x)))


@pytest.mark.parametrize("asked", [1, None])
def test_nodes_are_timed_on_the_threads_asked_and_the_profile_says_which(tmp_path, asked):
    """On a busy CPU a node timed on two threads read 100x its one-thread time: the profile runs on
    the threads each rank will run, when told, and records them; the caller's are set back after."""
    model, path = _Counted(), tmp_path / "times.json"
    _THREADS_SEEN.clear()
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = "" if asked is None else f" threads={asked}"
        spec = f"capture,profile{{path={path} warmup=0 repeats=1{threads}}},build-dag"
        run_pipeline(model, Pipeline.parse(spec), ExampleInputs((torch.randn(4, 8),)))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
    expected = asked or 2
    assert _THREADS_SEEN[-1] == expected  # the timed run (the first is the graph's own, to reach the node)
    assert json.loads(path.read_text())["settings"]["threads"] == expected


SIGNATURE_OF_TRANSFORMER_LM = """
from autoshard.capture import trace_with_leaves
from autoshard.costs.timing import graph_signature
from autoshard.examples import load_example
model, args, kwargs = load_example("transformer-lm")
print(graph_signature(trace_with_leaves(model, args, kwargs).graph_module))
"""


@pytest.mark.timeout(120)
def test_a_graphs_signature_is_the_same_in_another_process():
    """A saved time profile is matched to its graph by this signature; function targets once
    entered it by repr, which holds a per-process address (the transformer's relu)."""
    import subprocess

    def signature() -> str:
        run = subprocess.run([sys.executable, "-c", SIGNATURE_OF_TRANSFORMER_LM], capture_output=True, text=True,
                             check=True, timeout=110)
        return run.stdout.strip()

    assert signature() == signature()


class ShiftedIndex(nn.Module):
    """Shifts its indices in place, as T5's relative position buckets do (``buckets.add_(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.out = nn.Embedding(4, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        buckets = ids * 0
        buckets.add_(3)
        return self.out(self.table(buckets))


def test_timing_a_node_that_writes_its_inputs_in_place_leaves_them_as_the_model_does():
    """Each timed rerun of the in-place add shifted the indices again: the embedding after it
    failed (index out of range), blamed on the example inputs."""
    torch.manual_seed(0)
    model, ids = ShiftedIndex(), torch.randint(0, 4, (2, 5))
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids,), cost="time")
    assert torch.equal(sharded(ids), model(ids))


@pytest.mark.parametrize("saved,asked,message", [
    ("threads=2", "threads=1", "it was timed on 2 threads, not threads=1"),
    ("", "backward=true", "it timed the forward only, not backward=true"),
])
def test_a_loaded_profile_contradicting_the_options_asked_is_refused(tmp_path, saved, asked, message):
    """It was loaded as it was measured, under a spec saying otherwise: a plan balanced on two threads'
    times (up to 100x one's on a busy CPU) showed ``profile{threads=1}``."""
    path = tmp_path / "times.json"
    spec = "capture,profile{{path={path} warmup=0 repeats=1 {options}}},build-dag"
    run_pipeline(_Counted(), Pipeline.parse(spec.format(path=path, options=saved)), ExampleInputs((torch.randn(4, 8),)))
    with pytest.raises(InvalidArgumentError, match=f"measured otherwise than this profile pass asks: {message}; "
                                                   "delete it"):
        run_pipeline(_Counted(), Pipeline.parse(spec.format(path=path, options=asked)),
                     ExampleInputs((torch.randn(4, 8),)))
    again = spec.format(path=path, options=saved + " backward=false")  # what it was measured with still loads
    run_pipeline(_Counted(), Pipeline.parse(again), ExampleInputs((torch.randn(4, 8),)))
