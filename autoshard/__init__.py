"""autoshard: split any PyTorch ``nn.Module`` into k balanced, verified pipeline stages.

Attributes load lazily so that ``autoshard.graph`` (the splitter) works with networkx alone,
without importing torch, and so that ``import autoshard`` does not import ``torch.distributed``
(``autoshard.runtime`` does, on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "shard_model": "autoshard.api",
    "default_pipeline": "autoshard.api",
    "Pass": "autoshard.passes",
    "PassContext": "autoshard.passes",
    "Pipeline": "autoshard.passes",
    "ShardProgram": "autoshard.passes",
    "register_pass": "autoshard.passes",
    "ShardedModel": "autoshard.sharded",
    "StagePlan": "autoshard.sharded",
    "load_plan": "autoshard.plan_io",
    "save_plan": "autoshard.plan_io",
    "read_plan": "autoshard.plan_io",
    "SavedPlan": "autoshard.plan_io",
    "plan_report": "autoshard.plan_reporting",
    "PlanReport": "autoshard.plan_reporting",
    "CostNode": "autoshard.passes.analyses",
    "MemoryModel": "autoshard.costs.memory_model",
    "DeviceModel": "autoshard.costs.estimate",
    "StepTimeModel": "autoshard.costs.step_time",
    # warnings a user may want to filter or turn into errors
    "HostRandomnessWarning": "autoshard.capture.host_random",
    "CheckpointTracedWarning": "autoshard.capture.meta",
    "StateNotReplayedWarning": "autoshard.verify",
    "GraphInBufferWarning": "autoshard.verify",
    "UncheckedGradientsWarning": "autoshard.verify",
    "StalePlanWarning": "autoshard.plan_format.fits",
    "UnmeasuredMemoryWarning": "autoshard.plan_format.fits",
    "SharedBufferWarning": "autoshard.runtime.stage",
    "MicrobatchSizeWarning": "autoshard.runtime.schedule",
    "MicrobatchStatisticsWarning": "autoshard.runtime.schedule",
    "TimingSpreadWarning": "autoshard.runtime.predict",
    "CalibrationLoadWarning": "autoshard.runtime.machine_load",
    "EvalModeStepWarning": "autoshard.runtime.predict",
    "TargetError": "autoshard.targets",
    "SpecializationLimitWarning": "autoshard.specialize",
}
#: Every typed error, so that ``except autoshard.InputMismatchError`` works as the docs write it.
_ERRORS = (
    "AutoshardError", "InvalidArgumentError", "InvalidArgumentTypeError", "TooManyStagesError",
    "InfeasibleSplitError", "EmptyStageError", "PinConflictError", "InvalidGraphError", "SpecError",
    "PipelineValidationError",
    "PassFailed",
    "TraceError", "VerificationError", "PassContractError", "PlanError",
    "ShapePropagationError", "ExampleInputsError", "InputMismatchError", "SpecializationMismatch",
    "CallRefusedError", "PipelineSetupError",
    "WorldSizeError", "BoundaryValueError", "DeviceUnavailableError", "ModuleSplitError",
    "CheckpointMismatchError", "LaunchError", "MissingDependencyError",
)
_LAZY.update(dict.fromkeys(_ERRORS, "autoshard.errors"))

#: Public subpackages, reachable as ``autoshard.runtime`` without importing them by name (as
#: ``torch.distributed`` is); left out of ``__all__`` so that ``from autoshard import *`` imports none.
_SUBPACKAGES = frozenset({"capture", "costs", "examples", "graph", "passes", "plan_io", "runtime", "testing"})

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"autoshard.{name}")
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBPACKAGES])
