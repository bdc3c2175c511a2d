"""The pass framework and the built-in passes, registered from one explicit tuple."""

from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram, option
from autoshard.passes.capture import CapturePass
from autoshard.passes.constrain import CutBeforePass, NoSplitPass, PinPass
from autoshard.passes.constraints import SplitConstraints
from autoshard.passes.dag import BuildDagPass
from autoshard.passes.emit import EmitPass
from autoshard.passes.export import ExportPass
from autoshard.passes.instruments import DumpDir, Instrument, ModelUnchanged, PrintAfter, Timing, VerifyEach
from autoshard.passes.linearize import LinearizePass
from autoshard.passes.pipeline import Pipeline, PipelineResult
from autoshard.passes.plan import LoadPartitionPass
from autoshard.passes.profile import ProfilePass
from autoshard.passes.registry import (
    PassRegistry,
    default_registry,
    function_pass,
    get_pass,
    register_pass,
    registered_passes,
)
from autoshard.passes.shapes import ShapePropPass
from autoshard.passes.split import (
    SplitExactPass,
    SplitFixedOrderPass,
    SplitGreedyPass,
    SplitPass,
    SplitUniformPass,
)
from autoshard.passes.trace import TracePass
from autoshard.passes.verify import VerifyPass

BUILTIN_PASSES = (
    CapturePass, TracePass, ExportPass, BuildDagPass, ShapePropPass, ProfilePass, LinearizePass,
    PinPass, NoSplitPass, CutBeforePass, SplitPass, SplitFixedOrderPass, SplitExactPass, SplitGreedyPass,
    SplitUniformPass, LoadPartitionPass, EmitPass, VerifyPass,
)

for _pass in BUILTIN_PASSES:
    default_registry.register(_pass)

__all__ = [
    "BUILTIN_PASSES", "BuildDagPass", "CapturePass", "CutBeforePass", "ExportPass", "LoadPartitionPass",
    "ProfilePass", "ShapePropPass", "SplitExactPass", "SplitFixedOrderPass", "SplitGreedyPass", "SplitUniformPass",
    "DumpDir", "EmitPass", "ExampleInputs", "Instrument", "LinearizePass", "ModelUnchanged", "NoSplitPass", "Pass",
    "PinPass", "PassContext", "PassRegistry", "Pipeline", "PipelineResult", "PrintAfter", "ShardProgram",
    "SplitConstraints", "SplitPass", "Timing", "TracePass", "VerifyEach", "VerifyPass", "default_registry",
    "function_pass", "get_pass", "option", "register_pass", "registered_passes",
]
