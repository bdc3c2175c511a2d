"""Launch mistakes are typed errors raised before any process sends or waits.

These checks need no process group: they run first in ``pipeline_stage`` and ``build_schedule``,
on every rank alike. (The world-size checks against a real group run in test_runtime_pipeline.)
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.errors import (
    BoundaryValueError,
    DeviceUnavailableError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PipelineSetupError,
    WorldSizeError,
)
from autoshard.examples import ResidualMLP
from autoshard.runtime import check_world_size, pipeline_stage
from autoshard.runtime.boundaries import value_kind


class SizeUsedAtTheEnd(nn.Module):
    """``x.size(0)`` is taken first and used last, so an int crosses every cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        return self.c(self.b(self.a(x))).reshape(n, 2, 2)


@pytest.fixture
def two_stages():
    torch.manual_seed(0)
    return autoshard.shard_model(ResidualMLP(), 2, example_inputs=(torch.randn(4, 16),))


@pytest.mark.parametrize("schedule, stages, world", [
    ("gpipe", 2, 2), ("1f1b", 4, 4), ("interleaved-1f1b", 4, 2), ("looped-bfs", 6, 3),
    ("interleaved-1f1b", 2, 2), ("1F1B", 2, 2), ("GPipe", 2, 2),
])
def test_world_sizes_that_fit(schedule, stages, world):
    check_world_size(stages, world, schedule)


@pytest.mark.parametrize("schedule, stages, world, advice", [
    ("gpipe", 4, 2, "--nproc-per-node 4"),
    ("1f1b", 2, 4, "--nproc-per-node 2"),
    ("interleaved-1f1b", 3, 2, "multiple of 2"),
    ("interleaved-1f1b", 2, 4, "multiple of 4"),
    ("gpipe", 4, 2, "or use the schedule 'interleaved-1f1b' or 'looped-bfs' with several stages per process"),
    (torch.distributed.pipelining.ScheduleZBVZeroBubble, 4, 2, "use the schedule 'interleaved-1f1b' or 'looped-bfs'"),
])
def test_world_sizes_that_do_not_fit_say_what_to_launch(schedule, stages, world, advice):
    with pytest.raises(WorldSizeError, match=advice) as refused:
        check_world_size(stages, world, schedule)
    assert "ScheduleInterleaved1F1B" not in str(refused.value)  # build_schedule takes the name, not the class


def test_a_refusal_names_the_schedule_as_build_schedule_takes_it():
    with pytest.raises(WorldSizeError, match="^schedule '1f1b' runs one stage per process"):
        check_world_size(2, 4, torch.distributed.pipelining.Schedule1F1B)
    with pytest.raises(WorldSizeError, match="^ScheduleZBVZeroBubble places stages in a V"):  # not in SCHEDULES
        check_world_size(4, 2, torch.distributed.pipelining.ScheduleZBVZeroBubble)


def test_an_unknown_schedule_name_is_suggested():
    with pytest.raises(InvalidArgumentError, match="did you mean '1f1b'"):
        check_world_size(2, 2, "1fb1")


def test_a_non_tensor_crossing_a_boundary_is_refused_before_any_process_group(two_stages):
    sharded = autoshard.shard_model(SizeUsedAtTheEnd(), 2)
    crossing = [name for boundary in sharded.plan.boundaries for name in boundary]
    assert "size" in crossing  # the plan really sends the int
    assert value_kind(sharded, "size") == "the result of .size()"
    crossing_int = r"'size' \(the result of .size\(\)\) from stage 0 to stage 1"
    with pytest.raises(BoundaryValueError, match=crossing_int):
        pipeline_stage(sharded, 0, 2, "cpu")


class ReturnsItsBatchSize(SizeUsedAtTheEnd):
    """Returns an int beside the tensor: nothing a last stage can hand to ``loss_fn``."""

    def forward(self, x: torch.Tensor):
        return self.c(self.b(self.a(x))), x.size(0)


def test_a_model_returning_a_non_tensor_is_refused_before_any_process_group():
    sharded = autoshard.shard_model(ReturnsItsBatchSize(), 2, example_inputs=(torch.randn(3, 4),))
    with pytest.raises(BoundaryValueError, match=r"last stage may return only tensors.*'size' holding int 3"):
        pipeline_stage(sharded, 1, 2, "cpu")


class TupleMeta:
    """Stands in for the plan's metadata of a tuple of two tensors."""

    kind = "tuple"

    def __str__(self) -> str:
        return "(float32[4, 16], float32[4, 16])"


@pytest.mark.parametrize("attrs, described", [
    ({"value_meta": TupleMeta()}, r"tuple \(float32\[4, 16\], float32\[4, 16\]\)"),
    ({"value_meta": None, "tensor": False}, "a non-tensor value"),
])
def test_boundary_metadata_marking_a_non_tensor_is_refused(two_stages, attrs, described):
    name = two_stages.plan.boundaries[0][0]
    assert value_kind(two_stages, name) in ("tensor", None)
    two_stages.plan.dag.nodes[name].update(attrs)
    with pytest.raises(BoundaryValueError, match=f"'{name}' \\({described}\\)"):
        pipeline_stage(two_stages, 0, 2, "cpu")


def test_a_missing_device_is_refused(two_stages):
    absent = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(DeviceUnavailableError, match="cuda"):
        pipeline_stage(two_stages, 0, 2, absent)
    with pytest.raises(InvalidArgumentError, match="not a device"):
        pipeline_stage(two_stages, 0, 2, "gpu0")


@pytest.mark.parametrize("args, error, message", [
    ((0, 3, "cpu"), InvalidArgumentError, "the plan has 2 stages"),
    ((2, 2, "cpu"), InvalidArgumentError, "outside the plan's stages 0..1"),
    ((0, 2.0, "cpu"), InvalidArgumentTypeError, "num_stages must be an int"),
    ((0, 2, "meta"), PipelineSetupError, "meta device"),
])
def test_bad_stage_choices(two_stages, args, error, message):
    with pytest.raises(error, match=message):
        pipeline_stage(two_stages, *args)


def test_not_a_sharded_model():
    with pytest.raises(InvalidArgumentTypeError, match="ShardedModel"):
        pipeline_stage(ResidualMLP(), 0, 2, "cpu")


@pytest.mark.parametrize("whole", [int, np.int64])  # numpy integers pass the argument checks
def test_without_a_process_group_the_error_says_how_to_start_one(two_stages, whole):
    assert not dist.is_initialized()
    with pytest.raises(PipelineSetupError, match="init_process_group"):
        pipeline_stage(two_stages, whole(0), whole(2), "cpu")


def test_a_stage_still_on_the_meta_device_says_how_to_load_it():
    with torch.device("meta"):
        model = ResidualMLP()
    sharded = autoshard.shard_model(model, 2)
    from autoshard.runtime.stage import stage_module

    with pytest.raises(PipelineSetupError, match="materialize_stage"):
        stage_module(sharded, 0, torch.device("cpu"))


@pytest.mark.parametrize("count, error", [(0, InvalidArgumentError), (-1, InvalidArgumentError),
                                          ("4", InvalidArgumentTypeError), (True, InvalidArgumentTypeError)])
def test_build_schedule_checks_the_microbatch_count_first(count, error):
    from autoshard.runtime import build_schedule
    with pytest.raises(error, match="n_microbatches"):
        build_schedule([], "gpipe", count)


class SharedNorm(nn.Module):
    """One batch norm applied after every layer: its buffers end up in several stages."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(self.norm(layer(x)))
        return x


@pytest.mark.parametrize("training", [True, False])
def test_a_pipeline_stage_warns_of_buffers_other_stages_update_too(training):
    from autoshard.runtime import SharedBufferWarning
    from autoshard.runtime.rebuild import shared_across_stages
    from autoshard.runtime.stage import _warn_of_shared_buffers
    model = SharedNorm().train(training)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 8),))
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_of_shared_buffers(sharded, shared_across_stages(sharded), 0)
    found = [w for w in caught if issubclass(w.category, SharedBufferWarning)]
    assert len(found) == (1 if training else 0)
    if training:
        assert "norm.running_mean" in str(found[0].message)


def test_a_container_given_to_a_pipeline_step_by_position_is_refused_before_sending():
    """PyTorch's stages take positional arguments as tensors only: a dict failed inside torch on the
    first rank (untyped) while the next one lost its connection."""
    from autoshard.runtime.schedule import _BatchShapes

    shapes = _BatchShapes(n_microbatches=2, chunked_by_rows=True)
    batch = {"x": torch.randn(4, 8)}
    with pytest.raises(InvalidArgumentError, match=r"args\[0\] \(dict\) by position.*schedule.step\(batch=...\)"):
        shapes.check((batch,), {}, None)
    shapes.check((), {"batch": batch}, None)  # by name it goes through


def test_a_step_whose_microbatches_hold_unequal_numbers_of_labels_warns_its_loss_is_not_the_batch_average():
    """Padding marked -100 unevenly across microbatches: each microbatch's loss averaged its own labels, so
    the step's gradients were 2.4x off the unsplit model's on GPT-2 (half, with a nan loss, where one
    microbatch held none), silently (runtime probe)."""
    from autoshard.runtime.schedule import MicrobatchStatisticsWarning, _BatchShapes

    ids = torch.randint(0, 50, (4, 6))
    padded = ids.clone()
    padded[0, 1:] = -100  # the first microbatch (rows 0 and 1) holds 7 labels, the second 12
    with pytest.warns(MicrobatchStatisticsWarning, match=r"2 microbatches hold 7, 12 labels other than -100"):
        _BatchShapes(n_microbatches=2, chunked_by_rows=True).check((ids,), {"labels": padded}, padded)
    with pytest.warns(MicrobatchStatisticsWarning, match=r"hold 7, 12 labels"):  # the labels passed, no target
        _BatchShapes(n_microbatches=2, chunked_by_rows=True).check((ids,), {"labels": padded}, None)
    causal = ids.clone()
    causal[:2, 0] = -100  # 10 and 12 as given, but 10 and 10 as a causal LM scores them (labels[:, 1:])
    padded[2, 1:] = -100  # as many in each: the average of the averages is the batch's
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicrobatchStatisticsWarning)
        for target in (padded, causal, torch.randn(4, 6)):
            _BatchShapes(n_microbatches=2, chunked_by_rows=True).check((ids,), {"labels": target}, target)


def test_a_step_guard_names_each_call_structure_as_the_first_step_of_it_did():
    """The guard works out the names of a step's tensors once per call structure: later steps of that
    structure, and of another (a nested batch, a target added), are named and refused as before."""
    from autoshard.runtime.schedule import _BatchShapes, _named_tensors

    shapes = _BatchShapes(n_microbatches=2, chunked_by_rows=True)
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    steps = [((x,), {"mask": None, "labels": y}, y), ((x,), {"mask": None, "labels": y}, y),
             ((), {"batch": {"x": x, "y": [y, 1]}}, None), ((), {"batch": {"x": x, "y": [y, 1]}}, None),
             ((x,), {"labels": y}, None)]
    for args, kwargs, target in steps:
        assert shapes._named_tensors(args, kwargs, target) == _named_tensors(args, kwargs, target)
    assert len(shapes._named) == 2  # the nested batch is named anew each step
    shapes.check((x,), {"mask": None, "labels": y}, y)
    with pytest.raises(InvalidArgumentError, match=r"argument 0 \[6, 8\] \(first step: \[4, 8\]\), labels \[6, 3\] "
                                                   r"\(first step: \[4, 3\]\), target \[6, 3\]"):
        shapes.check((torch.randn(6, 8),), {"mask": None, "labels": torch.randn(6, 3)}, torch.randn(6, 3))
    with pytest.raises(InvalidArgumentError, match=r"batch\['y'\]\[0\] has 5 rows"):
        shapes.check((), {"batch": {"x": x, "y": [torch.randn(5, 3), 1]}}, None)
