"""Pipeline: construction, validation, running, history and failure handling."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import pytest

from autoshard.errors import (
    AutoshardError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PassContractError,
    PassFailed,
    PipelineValidationError,
)
from autoshard.passes.base import ExampleInputs, Pass, PassContext, ShardProgram, option
from autoshard.passes.instruments import Instrument
from autoshard.passes.pipeline import Pipeline, PipelineResult
from autoshard.passes.registry import PassRegistry

REG = PassRegistry(entry_point_group=None)
CALLS: list[str] = []


@REG.register
@dataclass(frozen=True)
class OrderPass(Pass):
    """Fill `order` from the model's children."""

    name: ClassVar[str] = "order"
    requires: ClassVar[frozenset[str]] = frozenset({"model"})
    provides: ClassVar[frozenset[str]] = frozenset({"order"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        CALLS.append(self.name)
        return replace(program, order=tuple(program.model))


@REG.register
@dataclass(frozen=True)
class OtherOrderPass(Pass):
    """Another way to fill `order`."""

    name: ClassVar[str] = "other-order"
    requires: ClassVar[frozenset[str]] = frozenset({"model"})
    provides: ClassVar[frozenset[str]] = frozenset({"order"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return replace(program, order=("other",))


@REG.register
@dataclass(frozen=True)
class GroupPass(Pass):
    """Group the order into `stages` partitions."""

    name: ClassVar[str] = "group"
    requires: ClassVar[frozenset[str]] = frozenset({"order"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})

    stages: int = option(help="how many groups")
    fail_with: str = option("", help="exception class name to raise, for tests")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        CALLS.append(self.name)
        if self.fail_with == "ZeroDivisionError":
            1 / 0
        if self.fail_with == "InvalidArgumentError":
            raise InvalidArgumentError("too many stages")
        order = program.order
        return replace(program, partition=tuple(order[i :: self.stages] for i in range(self.stages)))


@REG.register
@dataclass(frozen=True)
class CheckPass(Pass):
    """Record a verification string; needs example inputs."""

    name: ClassVar[str] = "check"
    requires: ClassVar[frozenset[str]] = frozenset({"partition", "example_inputs"})
    provides: ClassVar[frozenset[str]] = frozenset({"verification"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return replace(program, verification=f"{len(program.partition)} groups ok")


@REG.register
@dataclass(frozen=True)
class LazyPass(Pass):
    """Declares `partition` but does not set it."""

    name: ClassVar[str] = "lazy"
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return program


@REG.register
@dataclass(frozen=True)
class SneakyPass(Pass):
    """Overwrites `order` without declaring it."""

    name: ClassVar[str] = "sneaky"
    provides: ClassVar[frozenset[str]] = frozenset({"verification"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return replace(program, order=("changed",), verification="ok")


@REG.register
@dataclass(frozen=True)
class NonePass(Pass):
    """Forgets to return the program."""

    name: ClassVar[str] = "returns-none"

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return None  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


def program(**kw) -> ShardProgram:
    return ShardProgram(model=("a", "b", "c", "d"), **kw)


def parse(text: str) -> Pipeline:
    return Pipeline.parse(text, registry=REG)


# ----------------------------------------------------------------------------------------------
# Construction and conveniences
# ----------------------------------------------------------------------------------------------
def test_python_and_parsed_pipelines_are_equal_and_hash_alike():
    built = Pipeline([OrderPass(), GroupPass(stages=2)])
    parsed = parse("order,group{stages=2}")
    assert built == parsed and hash(built) == hash(parsed)
    assert built != parse("order,group{stages=3}")
    assert {built: 1}[parsed] == 1


def test_sequence_conveniences():
    p = parse("order,group{stages=2 fail-with=\"\"}")
    assert len(p) == 2 and list(p) == [OrderPass(), GroupPass(stages=2)]
    assert p[0] == OrderPass() and isinstance(p[1:], Pipeline) and str(p[1:]) == 'group{stages=2 fail-with=""}'
    joined = Pipeline([OrderPass()]) + GroupPass(stages=2)
    assert joined == Pipeline([OrderPass(), GroupPass(stages=2)])
    assert str(p[:1] + p[1:]) == str(p)  # explicit options survive slicing and concatenation
    assert (Pipeline([OrderPass()]) + [GroupPass(stages=2)]) == joined
    assert repr(joined) == "Pipeline.parse('order,group{stages=2}')"


def test_constructor_rejects_classes_and_strings_with_a_hint():
    with pytest.raises(InvalidArgumentTypeError,
                       match=r"step 0 is the class OrderPass, not a pass: write OrderPass\(...\)"):
        Pipeline([OrderPass])
    with pytest.raises(InvalidArgumentTypeError, match=r"use Pipeline.parse"):
        Pipeline(["order"])


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def test_valid_pipeline_validates():
    parse("order,group{stages=2},check").validate(frozenset({"model", "example_inputs"}))


def test_missing_artifact_names_pass_position_and_the_provider_to_add():
    reg = PassRegistry([OrderPass, OtherOrderPass, GroupPass], entry_point_group=None)
    p = Pipeline([GroupPass(stages=2)], registry=reg)
    with pytest.raises(PipelineValidationError) as info:
        p.validate(frozenset({"model"}))
    assert str(info.value) == (
        "pass 'group' (position 0 in pipeline `group{stages=2}`) needs 'order', which nothing before it "
        "provides: add one of `order`, `other-order` before it (it provides 'order')"
    )


def test_single_provider_is_named_directly():
    with pytest.raises(PipelineValidationError,
                       match=r"pass 'check' \(position 1 .* needs 'partition'.*add `group` before it"):
        reg = PassRegistry([OrderPass, GroupPass, CheckPass], entry_point_group=None)
        Pipeline.parse("order,check", registry=reg).validate(frozenset({"model", "example_inputs"}))


def test_missing_example_inputs_says_to_pass_them():
    with pytest.raises(PipelineValidationError) as info:
        parse("order,group{stages=2},check").validate(frozenset({"model"}))
    msg = str(info.value)
    assert "pass 'check' (position 2" in msg and "needs 'example_inputs'" in msg
    assert "'example_inputs' comes from the inputs, not from a pass: pass example inputs" in msg


def test_provider_later_in_the_pipeline_is_pointed_out():
    with pytest.raises(PipelineValidationError,
                       match=r"'order' is provided by `order` at position 1, after it: move `order` before it"):
        parse("group{stages=2},order").validate(frozenset({"model"}))


def test_artifact_nobody_provides():
    reg = PassRegistry([GroupPass], entry_point_group=None)
    with pytest.raises(PipelineValidationError, match="no registered pass provides 'order'"):
        Pipeline.parse("group{stages=1}", registry=reg).validate(frozenset({"model"}))


def test_run_validates_before_running_anything():
    with pytest.raises(PipelineValidationError, match="pass 'check' .* needs 'example_inputs'"):
        parse("order,group{stages=2},check").run(program())
    assert CALLS == []


# ----------------------------------------------------------------------------------------------
# Running and history
# ----------------------------------------------------------------------------------------------
def test_run_threads_the_program_and_records_history():
    start = program(example_inputs=ExampleInputs(args=(1,)))
    pipeline = parse("order,group{stages=2 fail-with=\"\"},check")
    result = pipeline.run(start)
    assert isinstance(result, PipelineResult)
    assert result.program.partition == (("a", "c"), ("b", "d"))
    assert result.program.verification == "2 groups ok"
    assert [spec for spec, _ in result.history] == ["order", 'group{stages=2 fail-with=""}', "check"]
    assert result.history[0][1].order == ("a", "b", "c", "d") and result.history[0][1].partition is None
    assert result.history[-1][1] is result.program
    assert start.order is None  # the input program is untouched
    assert CALLS == ["order", "group"]


def test_run_accepts_an_explicit_context_and_rejects_non_programs():
    ctx = PassContext()
    assert parse("order").run(program(), ctx).program.order == ("a", "b", "c", "d")
    with pytest.raises(InvalidArgumentTypeError, match="expects a ShardProgram, got tuple"):
        parse("order").run(("a",))


# ----------------------------------------------------------------------------------------------
# Failures
# ----------------------------------------------------------------------------------------------
def test_foreign_exception_is_wrapped_in_pass_failed_from_the_cause():
    pipeline = parse("order,group{stages=2 fail-with=ZeroDivisionError}")
    with pytest.raises(PassFailed) as info:
        pipeline.run(program())
    exc = info.value
    assert (exc.pass_name, exc.index, exc.spec) == ("group", 1, "order,group{stages=2 fail-with=ZeroDivisionError}")
    assert isinstance(exc.__cause__, ZeroDivisionError)
    assert "pass 'group' (position 1 in the pipeline) failed: ZeroDivisionError: division by zero" in str(exc)
    assert "reproduce with pipeline: order,group{stages=2 fail-with=ZeroDivisionError}" in str(exc)


@pytest.mark.parametrize("fail", ["ZeroDivisionError", "InvalidArgumentError"])
def test_the_reproduction_names_the_memory_model_the_spec_does_not_carry(fail):
    """A run planned for SGD with 8 microbatches, reproduced with its spec alone, plans for Adam."""
    from autoshard.costs.memory_model import MemoryModel

    spec = f"order,group{{stages=2 fail-with={fail}}}"
    ctx = PassContext(memory_model=MemoryModel(optimizer="sgd", microbatches=8))
    with pytest.raises(Exception) as info:
        parse(spec).run(program(), ctx)
    told = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert f"reproduce with pipeline: {spec} with memory_model=MemoryModel(optimizer='sgd', microbatches=8)" in told


def test_autoshard_error_passes_through_with_a_note():
    with pytest.raises(InvalidArgumentError) as info:
        parse("order,group{stages=2 fail-with=InvalidArgumentError}").run(program())
    exc = info.value
    assert type(exc) is InvalidArgumentError and str(exc) == "too many stages"
    assert exc.__notes__ == [
        "in pass 'group' (position 1); reproduce with pipeline: order,group{stages=2 fail-with=InvalidArgumentError}"
    ]


def test_pass_that_does_not_provide_what_it_declares_is_named():
    with pytest.raises(PassContractError, match=r"pass 'lazy' \(position 1\) declares that it provides 'partition' "
                                                r"but left it unset") as info:
        parse("order,lazy").run(program())
    assert (info.value.pass_name, info.value.index) == ("lazy", 1)
    assert "reproduce with pipeline: order,lazy" in info.value.__notes__[0]


def test_pass_that_changes_an_undeclared_artifact_is_named():
    with pytest.raises(PassContractError, match=r"pass 'sneaky' \(position 1\) changed the artifact 'order', "
                                                r"which is not in its `provides` \(verification\)"):
        parse("order,sneaky").run(program())


def test_pass_that_returns_none_is_named():
    with pytest.raises(PassContractError,
                       match=r"pass 'returns-none' \(position 0\) returned NoneType, not a ShardProgram"):
        parse("returns-none").run(program())


class _Verified(tuple):
    def verify(self) -> None:
        if not self:
            raise ValueError("empty order")


@REG.register
@dataclass(frozen=True)
class VerifiedOrderPass(Pass):
    """Emit an order artifact that can verify itself."""

    name: ClassVar[str] = "verified-order"
    provides: ClassVar[frozenset[str]] = frozenset({"order"})
    empty: bool = False

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return replace(program, order=_Verified(() if self.empty else ("x",)))


def test_verify_each_checks_provided_artifacts_only_when_asked():
    parse("verified-order{empty=true}").run(program())  # verify_each off: not checked
    parse("verified-order").run(program(), PassContext(verify_each=True))
    with pytest.raises(PassContractError, match=r"pass 'verified-order' \(position 0\) produced an invalid 'order': "
                                                r"ValueError: empty order") as info:
        parse("verified-order{empty=true}").run(program(), PassContext(verify_each=True))
    assert isinstance(info.value.__cause__, ValueError)
    assert "raised by instrument VerifyEach.after_pass" in info.value.__notes__[0]


class _Broken(Instrument):
    def before_pass(self, pass_, index, program):
        raise RuntimeError("instrument bug")


def test_instrument_errors_propagate_with_a_note_and_are_not_blamed_on_the_pass():
    with pytest.raises(RuntimeError, match="instrument bug") as info:
        parse("order").run(program(), PassContext(instruments=[_Broken()]))
    assert info.value.__notes__ == [
        "raised by instrument _Broken.before_pass; in pass 'order' (position 0); reproduce with pipeline: order"
    ]
    assert CALLS == []


def test_all_errors_are_autoshard_errors():
    for cls in (PassFailed, PassContractError, PipelineValidationError):
        assert issubclass(cls, AutoshardError)


# -- options checked before anything runs ------------------------------------------------------
def _passes_run(spec: str, **shard_options) -> tuple[type[BaseException], list[str]]:
    """The error sharding the residual MLP with ``spec`` raises, and the passes that ran first."""
    import autoshard
    from autoshard.examples import load_example
    from autoshard.passes.instruments import Timing

    model, args, _ = load_example("residual-mlp")
    timing = Timing()
    with pytest.raises(AutoshardError) as caught:
        autoshard.shard_model(model, 2, example_inputs=args, pipeline=spec, instruments=[timing], **shard_options)
    return caught.value, [row.name for row in timing.rows()]


@pytest.mark.parametrize("spec, message", [
    ("trace,build-dag,linearize,split{strategy=mincut},emit", "unknown strategy 'mincut'"),
    ("trace,build-dag,linearize,split{cost=flopz},emit", "unknown cost model 'flopz'"),
    ("trace,build-dag,linearize,split{strategy=greedy tolerance=0.5},emit", "has no use for tolerance=0.5"),
    ("trace,build-dag,linearize,split{strategy=uniform tolerance=0.1},emit", "has no use for tolerance=0.1"),
    ("trace,build-dag,linearize,split{strategy=fixed-order moves=false},emit", "has no use for moves=False"),
    ("trace,build-dag,linearize,split,emit,verify{atol=-1}", "atol must be finite and >= 0"),
    ("trace,build-dag,linearize,split,emit,verify{rtol=nan}", "rtol must be finite and >= 0"),
])
def test_option_values_no_pass_can_use_are_refused_before_any_pass_runs(spec, message):
    error, ran = _passes_run(spec)
    assert isinstance(error, InvalidArgumentError) and message in str(error)
    assert ran == []


def test_a_pipeline_that_makes_no_stages_is_refused_before_capture():
    error, ran = _passes_run("trace,build-dag,linearize,split")
    assert isinstance(error, PipelineValidationError) and "end it with 'emit'" in str(error)
    assert ran == []


def test_arguments_of_the_wrong_type_get_typed_errors():
    import autoshard
    from autoshard.errors import SpecError
    from autoshard.examples import load_example
    from autoshard.passes import PrintAfter, SplitPass, default_registry
    from autoshard.passes.instruments import Timing

    with pytest.raises(SpecError, match="has no option 'bogus'"):
        Pipeline([SplitPass()]).with_options(0, bogus=1)
    with pytest.raises(InvalidArgumentTypeError, match="pass name is a str"):
        default_registry.get(5)
    with pytest.raises(InvalidArgumentTypeError, match="PrintAfter takes pass names"):
        PrintAfter(5)
    model, args, _ = load_example("residual-mlp")
    for instruments in (None, [Timing], [object()]):
        with pytest.raises(InvalidArgumentTypeError, match="Instrument"):
            autoshard.shard_model(model, 2, example_inputs=args, instruments=instruments)


def test_the_stage_count_is_decided_in_one_place():
    """The call's count fills every split that did not write one; a written count must agree with it.
    Conflicts, with the call or with what a run made, read alike, and are refused before any pass runs."""
    from autoshard.api import default_pipeline
    from autoshard.passes.stages import bind_stages, check_stages_made

    assert str(bind_stages(Pipeline.parse("trace,split,split-greedy"), 3)) == (
        "trace,split{stages=3},split-greedy{stages=3}")
    assert str(bind_stages(Pipeline.parse("split{stages=3}"), 3)) == "split{stages=3}"
    assert str(default_pipeline(3, verify=False, shapes=False)) == "capture,build-dag,linearize,split{stages=3},emit"
    error, ran = _passes_run("trace,build-dag,linearize,split{stages=3},emit")
    assert str(error).startswith("2 stages were asked for but the pipeline's `split{stages=3}` (position 3) has "
                                 "3 stages, not 2; make num_stages and the spec agree") and ran == []
    with pytest.raises(InvalidArgumentError, match="4 stages were asked for but the pipeline '.*' made 2 stages, not "):
        check_stages_made(4, 2, Pipeline.parse("trace"))
    with pytest.raises(InvalidArgumentError, match="--stages must be"):
        bind_stages(Pipeline.parse("split"), 0, "--stages")


def test_the_command_line_names_its_own_stage_count_in_the_same_refusal(capsys):
    from autoshard import cli

    code = cli.main(["inspect", "residual-mlp", "--stages", "2", "--pipeline",
                     "trace,build-dag,linearize,split{stages=3}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and ("2 stages were asked for but the pipeline's `split{stages=3}` (position 3) has 3 stages, "
                          "not 2; make --stages and the spec agree") in err
