"""The pass framework and the built-in passes, registered from one explicit tuple."""

from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram, option
from autoshard.passes.dag import BuildDagPass
from autoshard.passes.emit import EmitPass
from autoshard.passes.instruments import DumpDir, Instrument, ModelUnchanged, PrintAfter, Timing, VerifyEach
from autoshard.passes.linearize import LinearizePass
from autoshard.passes.pipeline import Pipeline, PipelineResult
from autoshard.passes.registry import (
    PassRegistry,
    default_registry,
    function_pass,
    get_pass,
    register_pass,
    registered_passes,
)
from autoshard.passes.split import SplitPass
from autoshard.passes.trace import TracePass
from autoshard.passes.verify import VerifyPass

BUILTIN_PASSES = (TracePass, BuildDagPass, LinearizePass, SplitPass, EmitPass, VerifyPass)

for _pass in BUILTIN_PASSES:
    default_registry.register(_pass)

__all__ = [
    "BUILTIN_PASSES", "BuildDagPass", "DumpDir", "EmitPass", "ExampleInputs", "Instrument", "LinearizePass",
    "ModelUnchanged", "Pass", "PassContext", "PassRegistry", "Pipeline", "PipelineResult", "PrintAfter",
    "ShardProgram", "SplitPass", "Timing", "TracePass", "VerifyEach", "VerifyPass", "default_registry",
    "function_pass", "get_pass", "option", "register_pass", "registered_passes",
]
