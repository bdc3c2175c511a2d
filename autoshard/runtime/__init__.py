"""Run a plan: ``torch.distributed.pipelining`` stages, an offload runner, checkpoints, device maps.

autoshard does not bring its own distributed runtime. ``pipeline_stage`` hands one stage to
PyTorch's ``PipelineStage``, driven by PyTorch's schedules; ``OffloadRunner`` runs every stage in
turn on one device too small for the model; ``check_pipeline_step`` compares one step with the
unsplit model (loss and every gradient); ``measure_stage_memory`` measures what a stage holds in
training (to check the memory model against); ``predict_step`` predicts a training step from the
stages timed whole and the runtime's costs on this machine (``calibrate_runtime``); the rest keeps
checkpoints under the model's own names and lets a rank build its stage from a model made on the
``meta`` device.

Attributes load lazily, as ``autoshard``'s do: ``torch.distributed.pipelining``, FSDP and
distributed checkpointing take seconds to import, and a command that only plans or reads a plan
(the CLI imports ``predict_step``) needs none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

#: What each module gives, by name (loaded on first use).
_EXPORTS = {
    "autoshard.errors": ("LaunchError",),
    "autoshard.runtime.check": ("GradientDifference", "StepCheck", "check_pipeline_step"),
    "autoshard.runtime.checkpoint": (
        "load_distributed", "load_stage_state", "merge_stage_states", "save_distributed", "stage_part",
    ),
    "autoshard.runtime.calibrate": ("RuntimeCalibration", "calibrate_runtime"),
    "autoshard.runtime.device_maps": ("TiedAcrossDevicesWarning", "device_map", "split_modules"),
    "autoshard.runtime.launch": ("leave_process_group", "run_local"),
    "autoshard.runtime.materialize": ("materialize_stage",),
    "autoshard.runtime.memory": ("StageMemoryMeasurement", "measure_stage_memory"),
    "autoshard.runtime.offload": ("OffloadRunner",),
    "autoshard.runtime.parallel": ("Parallelized", "parallelize"),
    "autoshard.runtime.machine_load": ("CalibrationLoadWarning",),
    "autoshard.runtime.predict": ("EvalModeStepWarning", "TimingSpreadWarning", "predict_step"),
    "autoshard.runtime.schedule": (
        "SCHEDULES", "MicrobatchSizeWarning", "MicrobatchStatisticsWarning", "build_schedule",
        "check_world_size", "local_stage_indices", "model_loss",
    ),
    "autoshard.runtime.stage": ("SharedBufferWarning", "pipeline_stage"),
    "autoshard.runtime.stage_time": ("StageTimeMeasurement", "measure_stage_time"),
    "autoshard.runtime.ties": ("SharedParameter", "TiedGradients", "shared_parameters"),
}
_LAZY = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # (a module named as one of its functions would shadow it once imported: none is)
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autoshard.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
