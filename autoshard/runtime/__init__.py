"""Run a plan: ``torch.distributed.pipelining`` stages, an offload runner, checkpoints, device maps.

autoshard does not bring its own distributed runtime. ``pipeline_stage`` hands one stage to
PyTorch's ``PipelineStage``, driven by PyTorch's schedules; ``OffloadRunner`` runs every stage in
turn on one device too small for the model; ``check_pipeline_step`` compares one step with the
unsplit model (loss and every gradient); ``measure_stage_memory`` measures what a stage holds in
training (to check the memory model against); ``predict_step`` predicts a training step from the
stages timed whole and the runtime's costs on this machine (``calibrate_runtime``); the rest keeps
checkpoints under the model's own names and lets a rank build its stage from a model made on the
``meta`` device.
"""

from autoshard.errors import LaunchError
from autoshard.runtime.check import GradientDifference, StepCheck, check_pipeline_step
from autoshard.runtime.checkpoint import (
    load_distributed,
    load_stage_state,
    merge_stage_states,
    save_distributed,
    stage_part,
)
from autoshard.runtime.calibrate import RuntimeCalibration, calibrate_runtime
from autoshard.runtime.device_map import device_map, split_modules
from autoshard.runtime.launch import run_local
from autoshard.runtime.materialize import materialize_stage
from autoshard.runtime.memory import StageMemoryMeasurement, measure_stage_memory
from autoshard.runtime.offload import OffloadRunner
from autoshard.runtime.parallel import Parallelized, parallelize
from autoshard.runtime.machine_load import CalibrationLoadWarning
from autoshard.runtime.predict import EvalModeStepWarning, TimingSpreadWarning, predict_step
from autoshard.runtime.schedule import (
    SCHEDULES,
    MicrobatchSizeWarning,
    MicrobatchStatisticsWarning,
    build_schedule,
    check_world_size,
    local_stage_indices,
    model_loss,
)
from autoshard.runtime.stage import SharedBufferWarning, pipeline_stage
from autoshard.runtime.stage_time import StageTimeMeasurement, measure_stage_time
from autoshard.runtime.ties import SharedParameter, TiedGradients, shared_parameters

__all__ = [
    "EvalModeStepWarning",
    "TimingSpreadWarning",
    "CalibrationLoadWarning",
    "GradientDifference",
    "LaunchError",
    "MicrobatchSizeWarning",
    "MicrobatchStatisticsWarning",
    "OffloadRunner",
    "Parallelized",
    "RuntimeCalibration",
    "SCHEDULES",
    "SharedBufferWarning",
    "SharedParameter",
    "StageMemoryMeasurement",
    "StageTimeMeasurement",
    "StepCheck",
    "TiedGradients",
    "build_schedule",
    "calibrate_runtime",
    "check_pipeline_step",
    "check_world_size",
    "device_map",
    "load_distributed",
    "load_stage_state",
    "local_stage_indices",
    "materialize_stage",
    "measure_stage_memory",
    "measure_stage_time",
    "merge_stage_states",
    "model_loss",
    "parallelize",
    "pipeline_stage",
    "predict_step",
    "run_local",
    "save_distributed",
    "shared_parameters",
    "split_modules",
    "stage_part",
]
