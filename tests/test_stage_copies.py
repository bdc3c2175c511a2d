"""Stages saved and loaded (pickle, torch.save) or deep-copied keep their graph, checks included."""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.capture.structure import ArgumentStructure
from autoshard.errors import InputMismatchError
from autoshard.examples import load_example


def _through_torch_save(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"pickle": lambda value: pickle.loads(pickle.dumps(value)), "torch.save": _through_torch_save,
          "deepcopy": copy.deepcopy}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", ["gpt-lm", "transformer-lm"])
def test_a_copied_sharded_model_computes_the_model_and_checks_its_inputs(name, how):
    """fx's own pickling traces the stage's code again, which ran the input check on proxies."""
    model, args, _ = load_example(name)
    copied = COPIES[how](autoshard.shard_model(model, 3, args))
    with torch.no_grad():
        assert torch.equal(copied(*args), model(*args))
    with pytest.raises(InputMismatchError):
        copied(args[0].float(), *args[1:])


Pair = collections.namedtuple("Pair", "x y")


class ReadsTwo(nn.Module):
    """Reads two entries of one argument, under the keys (or positions) it is built with."""

    def __init__(self, keys: tuple) -> None:
        super().__init__()
        self.keys = keys
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch) -> torch.Tensor:
        return self.last(self.first(batch[self.keys[0]]) + batch[self.keys[1]])


LAYOUTS = {"str keys": ("x", "y"), "tuple keys": (("x", 0), ("y", 0)), "dtype keys": (torch.float32, torch.int64),
           "namedtuple": (0, 1)}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_of_a_structured_argument_is_copied_without_warnings_and_checks_it(layout, how, recwarn):
    """The captured layout travels as a value of it with numbered leaves: a pickled ``TreeSpec``
    warns when loaded (torch 2.13), once in every process a plan was sent to."""
    torch.manual_seed(0)
    keys = LAYOUTS[layout]
    model = ReadsTwo(keys).eval()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    batch = Pair(x, y) if layout == "namedtuple" else dict(zip(keys, (x, y)))
    sharded = autoshard.shard_model(model, 2, (batch,))
    recwarn.clear()
    copied = COPIES[how](sharded)
    assert [str(w.message) for w in recwarn] == []
    assert torch.equal(copied(batch), model(batch))
    if layout == "str keys":
        with pytest.raises(InputMismatchError, match="in another order"):
            copied({"y": y, "x": x})
        with pytest.raises(InputMismatchError, match="keys are fixed"):
            copied({"x": x})
    else:
        with pytest.raises(InputMismatchError):
            copied((x, y))


class ReadsX(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.last(self.first(batch["x"]))


def test_a_defaultdict_argument_whose_factory_is_a_lambda_is_deep_copied():
    """Its layout holds the lambda, which a deep copy keeps as it is."""
    torch.manual_seed(0)
    model = ReadsX().eval()
    batch = collections.defaultdict(lambda: None, x=torch.randn(2, 8))
    copied = copy.deepcopy(autoshard.shard_model(model, 2, (batch,)))
    assert torch.equal(copied(batch), model(batch))


class DropsOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(F.dropout(self.first(x), 0.5, self.training))


@pytest.mark.parametrize("how", COPIES)
def test_a_copied_stage_still_refuses_the_other_mode(how):
    """The mode check reads only module flags: fx's re-trace ran it eagerly and left it out."""
    sharded = autoshard.shard_model(DropsOut().train(), 2, (torch.randn(4, 8),))
    stage = COPIES[how](sharded.stages[0])
    nn.Module.train(stage, False)  # around the stage's own refusal, as a runtime setting flags might
    with pytest.raises(InputMismatchError, match="captured in train mode"):
        stage(torch.randn(4, 8))


# -- what a plan fixes: its weights' dtypes and its mode ------------------------------------------
class CastsToItsWeights(nn.Module):
    """Reads its weights' dtype: the capture answers that once, for the example's float32."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x.to(self.first.weight.dtype)))


def test_weights_converted_after_sharding_are_refused_by_every_stage():
    model, x = CastsToItsWeights(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.half()  # the stages hold these parameters: they are converted too
    with pytest.raises(InputMismatchError, match=r"weights are float16, but the plan was captured with float32.*"
                                                 r"model.to\(torch.float16\)"):
        sharded(x)
    with pytest.raises(InputMismatchError, match="weights are float16"):
        sharded.stages[1](torch.randn(4, 8, dtype=torch.float16))


class ScalesWhenAsked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.first(x)
        return self.last(h if scale is None else h * scale)


def test_a_call_another_capture_would_serve_is_refused_as_well_after_the_weights_were_converted():
    """A call the plan does not serve (an argument the example left out) was captured again from the
    converted model and served, while the plan's own calls were refused (a GPT-2 without its labels)."""
    model, x = ScalesWhenAsked(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.half()
    for call in [(x.half(),), (x.half(), torch.ones(8, dtype=torch.float16))]:
        with pytest.raises(InputMismatchError, match="weights are float16, but the plan was captured with float32"):
            sharded(*call)
    assert not sharded.specializations


@pytest.mark.parametrize("convert, dtype", [(lambda m: m.half(), "float16"),
                                            (lambda m: m.to(torch.bfloat16), "bfloat16"),
                                            (lambda m: m.double(), "float64")])
def test_converting_a_sharded_model_or_a_stage_is_refused_before_anything_changes(convert, dtype):
    model, x = CastsToItsWeights(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    for target in (sharded, sharded.stages[0]):
        advice = rf"convert the model first \(model.to\(torch.{dtype}\)\), then shard it"
        with pytest.raises(autoshard.errors.InvalidArgumentError, match=advice):
            convert(target)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    sharded.to("cpu")  # a move to a device goes through
    assert torch.equal(sharded(x), model(x))


def test_a_stage_refuses_the_other_mode_before_switching_the_models_modules():
    model = DropsOut().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    with pytest.raises(InputMismatchError, match="captured in eval mode"):
        sharded.stages[1].train()
    assert not any(m.training for m in model.modules())
    sharded.stages[1].eval()  # staying in the mode is allowed


class Rotary(nn.Module):
    """Tables kept in float32 beside bfloat16 weights, made on the first call (kept whole: it
    writes state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(x.shape[-1], dtype=torch.float32).cos()
        return (x.float() * self.table).to(x.dtype)


class FillsACacheOnItsFirstCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.rotary, self.last = nn.Linear(8, 8), Rotary(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.rotary(self.first(x)))


def test_a_cache_of_another_dtype_filled_after_sharding_is_no_converted_weight():
    model = FillsACacheOnItsFirstCall().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert torch.equal(sharded(x), model(x))


def test_complex_weights_are_kept_as_they_are():
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.complex64), nn.Linear(4, 4, dtype=torch.complex64))
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 4, dtype=torch.complex64),))
    for dtype in (torch.complex128, torch.float32):  # the second would drop the imaginary parts
        with pytest.raises(autoshard.errors.InvalidArgumentError, match="convert the model first"):
            sharded.to(dtype)
    assert all(p.dtype == torch.complex64 for p in model.parameters())


def test_a_stage_torch_export_captured_is_refused_by_pickle_with_advice():
    exported = "export,shape-prop,build-dag,linearize,split,emit,verify"  # a graph of aten operators
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 4),), pipeline=exported)
    with pytest.raises(autoshard.errors.InvalidArgumentError, match="cannot pickle; build the stages in each process"):
        pickle.dumps(sharded.stages[0])
    assert torch.equal(copy.deepcopy(sharded)(torch.ones(2, 4)), sharded(torch.ones(2, 4)))


def test_the_pickle_refusal_names_a_way_to_make_a_plan_file():
    """It named save_plan, which takes a SavedPlan, not a sharded model (it refuses one): the plan
    file load_plan reads comes from the CLI's --out."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 4),), pipeline="export,shape-prop,build-dag,"
                                    "linearize,split,emit")
    with pytest.raises(autoshard.errors.InvalidArgumentError) as refused:
        pickle.dumps(sharded.stages[0])
    assert "save_plan" not in str(refused.value) and "autoshard split TARGET --stages K --out" in str(refused.value)


@dataclasses.dataclass
class CheckedPair:
    """A pytree node whose constructor takes only tensors: its layout cannot be rebuilt with
    numbered leaves, so it travels as the ``TreeSpec`` itself."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.x, torch.Tensor):
            raise TypeError("x must be a tensor")


torch.utils._pytree.register_dataclass(CheckedPair)


def test_a_layout_whose_node_checks_its_leaves_is_still_copied():
    layout = ArgumentStructure.of(CheckedPair(torch.zeros(2), torch.ones(2)))
    copied = pickle.loads(pickle.dumps(layout))
    assert copied.spec == layout.spec and copied.paths == layout.paths
