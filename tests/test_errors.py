"""Bad input gets a clear, typed error; never an AssertionError or a silent wrong answer."""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import networkx as nx
import numpy as np
import pytest
import torch

import autoshard
import autoshard.graph
from autoshard.errors import (
    AutoshardError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PassFailed,
    PipelineValidationError,
    SpecError,
    TooManyStagesError,
)
from autoshard.examples import BranchedNetwork, ResidualMLP


@pytest.mark.parametrize("bad", [0, -3])
def test_num_stages_below_one(bad):
    with pytest.raises(InvalidArgumentError, match="at least 1"):
        autoshard.shard_model(ResidualMLP(), bad)


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_num_stages_not_an_int(bad):
    with pytest.raises(InvalidArgumentTypeError, match="num_stages must be an int"):
        autoshard.shard_model(ResidualMLP(), bad)


def test_inputs_given_for_the_stage_count_are_shown_by_shape_not_by_their_numbers():
    """shard_model(model, (x,), 2) swaps two arguments: the message names the tuple of one tensor
    in a line, not the tensor's 2,048 numbers, and says which comes first."""
    x = torch.randn(8, 16, 16)
    with pytest.raises(InvalidArgumentTypeError) as caught:
        autoshard.shard_model(ResidualMLP(), (x,), 2)
    assert str(caught.value) == ("num_stages must be an int, got tuple (Tensor[8, 16, 16],), and example_inputs is 2: "
                                 "the stage count comes first, shard_model(model, num_stages, example_inputs)")
    alone = r"^num_stages must be an int, got tuple \(Tensor\[8, 16, 16\],\)$"  # (no swap to point out)
    with pytest.raises(InvalidArgumentTypeError, match=alone):
        autoshard.shard_model(ResidualMLP(), (x,))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("compile_", ["script", "trace"])
def test_a_torchscript_module_is_refused_naming_what_to_pass(compile_):
    """A scripted module's forward is compiled code: the capture failed inside it, and the message
    blamed the model for raising on its example inputs (a new user's finding)."""
    model, x = ResidualMLP().eval(), torch.randn(2, 16)
    scripted = torch.jit.script(model) if compile_ == "script" else torch.jit.trace(model, (x,))
    with pytest.raises(InvalidArgumentTypeError, match="got a TorchScript .*; pass the module it was made from"):
        autoshard.shard_model(scripted, 2, (x,))


def test_a_numpy_integer_is_a_stage_count():
    model = ResidualMLP()
    sharded = autoshard.shard_model(model, np.int64(2))
    assert sharded.num_stages == 2 and type(sharded.num_stages) is int
    dag = nx.DiGraph([("a", "b"), ("b", "c")])
    nx.set_node_attributes(dag, {"a": 1.0, "b": 1.0, "c": 1.0}, "cost")
    nx.set_node_attributes(dag, {"a": 4, "b": 4, "c": 4}, "bytes")
    assignment = autoshard.graph.split_dag(dag, np.int32(3))
    assert assignment == {"a": 0, "b": 1, "c": 2} and all(type(s) is int for s in assignment.values())


def test_num_stages_above_the_maximum_states_the_maximum():
    with pytest.raises(TooManyStagesError, match="maximum is 10") as info:
        autoshard.shard_model(BranchedNetwork(), 11)
    assert info.value.maximum == 10 and info.value.requested == 11


def test_num_stages_above_a_maximum_of_one_speaks_in_the_singular():
    with pytest.raises(TooManyStagesError) as info:
        autoshard.shard_model(torch.nn.Linear(2, 2), 3, example_inputs=(torch.ones(1, 2),))
    assert str(info.value).endswith("(the graph has 1 non-input node and each stage needs one); "
                                    "ask for at most 1 stage")


def test_not_a_module():
    with pytest.raises(InvalidArgumentTypeError, match="torch.nn.Module, got function; wrap your function in a Module"):
        autoshard.shard_model(lambda x: x, 2)
    with pytest.raises(InvalidArgumentTypeError, match="got str; pass the model"):
        autoshard.shard_model("gpt2", 2)
    with pytest.raises(InvalidArgumentTypeError, match=r"got the class Linear itself; pass a model made from it "
                                                       r"\(Linear\(\.\.\.\)\)"):
        autoshard.shard_model(torch.nn.Linear, 2)  # (it was told to wrap "your function" in a Module)


def test_a_state_dict_is_told_to_load_into_the_model():
    with pytest.raises(InvalidArgumentTypeError, match="got a state dict") as info:
        autoshard.shard_model(ResidualMLP().state_dict(), 2)
    assert "model.load_state_dict(state_dict)" in str(info.value) and "wrap your function" not in str(info.value)


@pytest.mark.parametrize("spec, error, close", [
    ("split{strategy=mincut}", InvalidArgumentError, "unknown strategy 'mincut' (did you mean 'min-cut'?)"),
    ("split{cost=param}", InvalidArgumentError, "unknown cost model 'param' (did you mean 'params'?)"),
    ("split{strateg=min-cut}", SpecError, "unknown option 'strateg' for pass 'split' (did you mean 'strategy'?)"),
])
def test_a_misspelt_name_in_a_spec_is_answered_with_the_closest_ones(spec, error, close):
    with pytest.raises(error) as info:
        autoshard.shard_model(ResidualMLP(), 2, pipeline=f"trace,build-dag,linearize,{spec},emit")
    assert close in str(info.value)


def test_unknown_pass_in_spec():
    with pytest.raises(SpecError, match="unknown pass 'trase'.*trace"):
        autoshard.shard_model(ResidualMLP(), 2, pipeline="trase,build-dag,linearize,split,emit")


def test_unknown_option_in_spec():
    with pytest.raises(SpecError, match="stagez"):
        autoshard.shard_model(ResidualMLP(), 2, pipeline="trace,build-dag,linearize,split{stagez=2},emit")


def test_spec_missing_a_required_artifact_says_what_to_add():
    with pytest.raises(PipelineValidationError, match="order.*linearize"):
        autoshard.shard_model(ResidualMLP(), 2, pipeline="trace,build-dag,split,emit")


def test_verify_without_example_inputs_is_refused_before_running():
    with pytest.raises(PipelineValidationError, match="example_inputs"):
        autoshard.shard_model(ResidualMLP(), 2, pipeline="trace,build-dag,linearize,split,emit,verify")


@pytest.mark.parametrize("asked, named", [
    (dict(cost="flops"), "cost='flops'"), (dict(cost="time"), "cost='time'"),
    (dict(max_memory="1GiB"), "max_memory='1GiB'"),
])
def test_a_cost_or_budget_that_measures_the_model_asks_for_example_inputs_by_its_own_name(asked, named):
    """The default pipeline leaves shape propagation out without inputs: the split's refusal spoke of
    passes, positions and 'facts', options the caller never gave."""
    with pytest.raises(InvalidArgumentError, match=rf"^{re.escape(named)} counts what the model computes on example "
                                                   r"inputs, and none were given: pass example_inputs="):
        autoshard.shard_model(ResidualMLP(), 2, **asked)


def test_contradicting_stage_counts():
    with pytest.raises(InvalidArgumentError, match="stages=3"):
        autoshard.shard_model(ResidualMLP(), 2, pipeline="trace,build-dag,linearize,split{stages=3},emit")


def test_unknown_cost_model():
    with pytest.raises(InvalidArgumentError, match="unknown cost model 'parms'.*params"):
        autoshard.shard_model(ResidualMLP(), 2, cost="parms")


def test_bad_example_inputs_type():
    with pytest.raises(InvalidArgumentTypeError, match="example_inputs"):
        autoshard.shard_model(ResidualMLP(), 2, example_inputs={"x": torch.randn(1, 16)})


def test_every_deliberate_error_is_an_autoshard_error():
    for cls in (InvalidArgumentError, InvalidArgumentTypeError, TooManyStagesError, SpecError, PipelineValidationError):
        assert issubclass(cls, AutoshardError) and not issubclass(cls, AssertionError)


def test_every_error_and_warning_the_readme_names_is_importable_from_autoshard():
    import inspect

    import autoshard.errors

    errors = {name for name, cls in vars(autoshard.errors).items()
              if inspect.isclass(cls) and issubclass(cls, AutoshardError)}
    for name in errors | {"HostRandomnessWarning", "StalePlanWarning", "UnmeasuredMemoryWarning", "SharedBufferWarning",
                          "MicrobatchStatisticsWarning", "TargetError"}:
        assert name in dir(autoshard), name
        assert inspect.isclass(getattr(autoshard, name)), name
    assert autoshard.InputMismatchError is autoshard.errors.InputMismatchError
    assert issubclass(autoshard.StalePlanWarning, UserWarning)


def test_public_subpackages_are_attributes_of_autoshard_and_load_only_when_used():
    """``autoshard.runtime.pipeline_stage`` works after ``import autoshard`` alone, yet that import
    leaves ``torch.distributed.pipelining`` unloaded (the runtime imports it on first use)."""
    import subprocess
    import sys

    code = ("import sys, autoshard\n"
            "assert 'torch.distributed.pipelining' not in sys.modules, 'import autoshard loaded the runtime'\n"
            "assert 'runtime' in dir(autoshard)\n"
            "assert callable(autoshard.runtime.pipeline_stage)\n"
            "assert 'torch.distributed.pipelining' in sys.modules\n"
            "for name in ('capture', 'costs', 'examples', 'graph', 'passes', 'plan_io', 'testing'):\n"
            "    assert getattr(autoshard, name).__name__ == 'autoshard.' + name\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'runtimes'"):
        autoshard.runtimes  # noqa: B018 - the lookup is the test


def test_the_cli_and_the_planner_load_neither_the_pipelining_runtime_nor_memtracker():
    """What takes seconds to import waits for its first use: ``torch.distributed.pipelining`` (the
    runtime's stages and schedules) and ``torch.distributed._tools`` (``MemTracker``, which pulls in
    torch's compiler stack), so ``autoshard --help`` or ``inspect plan.json`` starts in the time
    torch does. A plan's training probe loads ``MemTracker``; a runtime name, the runtime."""
    import subprocess
    import sys

    code = ("import sys, autoshard.cli, autoshard.runtime\n"
            "heavy = ('torch.distributed.pipelining', 'torch.distributed._tools')\n"
            "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]\n"
            "from autoshard.examples import ResidualMLP\n"
            "import torch, autoshard\n"
            "autoshard.shard_model(ResidualMLP(), 2, (torch.randn(4, 16),), verify=False)\n"
            "assert 'torch.distributed._tools' in sys.modules\n"
            "assert 'torch.distributed.pipelining' not in sys.modules\n"
            "assert callable(autoshard.runtime.pipeline_stage)\n"
            "assert 'torch.distributed.pipelining' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_lazy_runtime_name_is_what_its_module_defines_once_every_module_is_imported():
    """Importing a submodule binds it on its package under its own name: a function named as its
    module (``device_map`` in ``device_map.py``) then read as the module, once the lazy package no
    longer imported the function over it."""
    import importlib
    import types

    import autoshard.runtime as runtime

    for module in runtime._EXPORTS:
        importlib.import_module(module)
    shadowed = [name for name in runtime.__all__ if isinstance(getattr(runtime, name), types.ModuleType)]
    assert not shadowed


def test_pipeline_cost_is_kept_when_the_call_leaves_cost_at_its_default():
    sharded = autoshard.shard_model(ResidualMLP(), 2, pipeline="trace,build-dag,linearize,split{cost=nodes},emit")
    assert len(sharded.stages) == 2


def test_contradicting_cost_models():
    with pytest.raises(InvalidArgumentError, match="cost='nodes'"):
        autoshard.shard_model(ResidualMLP(), 2, cost="nodes",
                              pipeline="trace,build-dag,linearize,split{cost=params},emit")


def test_a_model_with_nothing_to_split_is_not_told_to_ask_for_zero_stages():
    with pytest.raises(TooManyStagesError, match="no computation to split") as caught:
        autoshard.shard_model(torch.nn.Identity(), 1, (torch.randn(2),))
    assert "at most 0" not in str(caught.value)


def test_a_pass_whose_check_options_raises_a_builtin_error_is_named_with_a_reproducing_spec():
    """docs/pipelines.md invites a pass of the user's to refuse option values in ``check_options``; one that
    does so with a plain ``ValueError`` is named, with its position and a spec, like a failing ``run``."""
    from dataclasses import dataclass

    from autoshard.passes import Pass, PassRegistry, Pipeline, option

    registry = PassRegistry(autoshard.passes.BUILTIN_PASSES, entry_point_group=None)

    @registry.register
    @dataclass(frozen=True)
    class PickyPass(Pass):
        """Refuses a negative n."""

        name: ClassVar[str] = "picky"
        n: int = option(0, help="a count")

        def check_options(self) -> None:
            if self.n < 0:
                raise ValueError(f"n must be >= 0, got {self.n}")

        def run(self, program, ctx):
            return program

    spec = "trace,picky{n=-1},build-dag,linearize,split{stages=2},emit"
    with pytest.raises(PassFailed) as info:
        Pipeline.parse(spec, registry).validate()
    assert (info.value.pass_name, info.value.index) == ("picky", 1)
    assert "ValueError: n must be >= 0, got -1" in str(info.value)
    assert f"reproduce with pipeline: {spec}" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert any("check_options" in note for note in info.value.__notes__)


def test_a_misspelt_keyword_of_shard_model_names_the_one_meant():
    with pytest.raises(autoshard.InvalidArgumentTypeError,
                       match=r"unexpected keyword argument 'max_memroy' \(did you mean 'max_memory'\?\)"):
        autoshard.shard_model(torch.nn.Linear(2, 2), 1, (torch.randn(1, 2),), max_memroy="1GiB")


@pytest.mark.parametrize("build, typo, meant", [
    (autoshard.MemoryModel, "micro_batches", "microbatches"),
    (autoshard.StepTimeModel, "link_bandwith", "link_bandwidth"),
])
def test_a_misspelt_keyword_of_a_model_of_training_names_the_one_meant(build, typo, meant):
    """Python's own TypeError for a dataclass names no alternative."""
    with pytest.raises(autoshard.InvalidArgumentTypeError,
                       match=rf"{build.__name__}\(\) got an unexpected keyword argument '{typo}' \(did you mean "
                             rf"'{meant}'\?\); it takes ") as info:
        build(**{typo: 4})
    assert str(info.value).split("it takes ")[1].split(", ") == [f.name for f in dataclasses.fields(build)]
