"""Re-specialisation: a call that flips a size or branch the capture fixed is served by a new
capture under the same partition (``autoshard.specialize``)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import pickle
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DoublesWhen, FillsInItsProblemType
from torch import nn

import autoshard
from autoshard.capture.guard import check_condition
from autoshard.errors import (OTHER_CAPTURE, CallRefusedError, EmptyStageError, InputMismatchError, PlanError,
                              SpecializationMismatch)
from autoshard.runtime.replay import serving_plan
from autoshard.specialize import SpecializationLimitWarning, Specializer, _tensor_facts, holders


class SizeBranch(nn.Module):
    """A Python ``if`` on the batch size between four layers; batch norm to watch buffer updates."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.norm = nn.BatchNorm1d(8) if norm else nn.Identity()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.a(x) * scale
        if x.shape[0] > 2:
            x = self.b(x) * 2
        else:
            x = self.b(x) - 1
        return self.d(self.norm(self.c(x)))


def size_branch(**kwargs) -> tuple[nn.Module, autoshard.ShardedModel]:
    torch.manual_seed(0)
    model = SizeBranch().eval()
    return model, autoshard.shard_model(model, 2, (torch.randn(4, 8),), **kwargs)


def test_a_flipped_branch_is_served_exactly_with_every_weight_in_its_stage():
    model, sharded = size_branch()
    before = holders(sharded)
    x = torch.randn(1, 8)
    assert torch.equal(sharded(x), model(x))
    (made,) = sharded.specializations
    assert "x.shape[0] > 2" in made.guard and made.shapes == ((0, torch.Size([1, 8])),) and made.seconds > 0
    assert holders(made.sharded) == before
    # Later calls: the cached plan serves batch 1 and 2, the first one batch 5; nothing new is captured.
    for batch in (1, 2, 5, 1):
        x = torch.randn(batch, 8)
        assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1


class CheckpointsWithGrad(nn.Module):
    """Gradient checkpointing asked for as diffusers' blocks ask (``torch.is_grad_enabled() and
    self.gradient_checkpointing``) between layers whose output differs in each grad mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.a(x))
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            x = torch.utils.checkpoint.checkpoint(self.c, x, use_reentrant=False)
        elif torch.is_grad_enabled():
            x = self.c(x) * 2
        else:
            x = self.c(x)
        return self.d(x)


@pytest.mark.parametrize("sharded_in", [torch.enable_grad, torch.no_grad])
def test_a_call_in_the_other_grad_mode_is_served_by_a_capture_made_in_it(sharded_in):
    """A diffusers UNet sharded to serve is called under torch.no_grad(): the first plan's grad-mode
    guard fails, and a capture made in the call's mode serves it, as a flipped branch is served."""
    torch.manual_seed(0)
    model = CheckpointsWithGrad().eval()
    with sharded_in():
        sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    before = holders(sharded)
    x = torch.randn(3, 8)
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode, torch.no_grad, torch.enable_grad):
        with mode():
            assert torch.equal(sharded(x), model(x))
    (made,) = sharded.specializations
    assert "grad mode" in made.guard and holders(made.sharded) == before
    assert ("without grad" in made.describe()) == (sharded_in is torch.enable_grad)
    other = torch.no_grad if sharded_in is torch.enable_grad else torch.enable_grad
    for mode, rows, plan in ((sharded_in, 4, sharded), (other, 3, made.sharded), (other, 4, None)):
        with mode():  # chosen up front (a pipeline's microbatch) by the grad mode too
            assert sharded.specializer.made_for(sharded, (torch.randn(rows, 8),), {}) is plan
    with torch.enable_grad():  # the plan with grad trains: its gradients are the model's
        sharded(x).sum().backward()
        served = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), served))


class ComputesInItsInputDtype(nn.Module):
    """An RMSNorm-style step between layers: it reads its input's dtype, computes in float32 and casts
    back, so under ``torch.autocast`` (bf16 products) it casts to bf16, and without it to float32."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = (h.float() * 1.1).to(h.dtype)
        return self.c(self.b(h + x))


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("sharded_in, other", [(contextlib.nullcontext, bf16_autocast),
                                               (bf16_autocast, contextlib.nullcontext)])
def test_a_call_under_another_autocast_state_is_served_by_a_capture_made_under_it(sharded_in, other):
    """The capture answered ``h.dtype`` in its own autocast state: a plan captured outside autocast and
    called inside it cast to float32 where the model casts to bf16 (3.9e-3 off, silently), and the
    other way round. Every stage checks the state; the sharded model captures again under the call's."""
    torch.manual_seed(0)
    model, x = ComputesInItsInputDtype().eval(), torch.randn(4, 8)
    with sharded_in():
        sharded = autoshard.shard_model(model, 3, (x,))
    for context in (other, sharded_in, other):
        with context():
            assert torch.equal(sharded(x), model(x))
    (made,) = sharded.specializations
    assert "autocast" in made.guard
    for context, plan in ((sharded_in, sharded), (other, made.sharded)):
        with context():  # chosen up front (a pipeline's microbatch) by the autocast state too
            assert sharded.specializer.made_for(sharded, (x,), {}) is plan
    with sharded_in():
        vals = sharded.stages[0](x)
    with other(), pytest.raises(SpecializationMismatch, match="autocast"):  # a stage called as it is
        sharded.stages[1](*vals)


@pytest.mark.parametrize("sharded_in", [contextlib.nullcontext, torch.inference_mode])
def test_a_call_in_the_other_inference_mode_is_served_by_a_capture_made_in_it(sharded_in):
    """The trace answered ``torch.is_inference_mode_enabled()`` once and the plan took that branch in either mode,
    silently, verified or not (a helper probe); as for the grad mode, the graph checks it where the code asked."""
    torch.manual_seed(0)
    model, x = DoublesWhen("is_inference_mode_enabled", width=8).eval(), torch.randn(3, 8)
    with sharded_in():
        sharded = autoshard.shard_model(model, 2, (x,))
    for mode in (torch.inference_mode, contextlib.nullcontext, torch.inference_mode, contextlib.nullcontext):
        with mode():
            assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1
    with pytest.raises(InputMismatchError, match="chose its path by whether torch.inference_mode is on"):
        with torch.inference_mode() if sharded_in is contextlib.nullcontext else contextlib.nullcontext():
            sharded.stages[-1](*sharded.stages[0](x))


def test_a_plan_whose_code_never_asked_for_the_grad_mode_is_chosen_up_front_in_either_mode():
    model, sharded = size_branch()
    with torch.no_grad():
        assert sharded.specializer.made_for(sharded, (torch.randn(4, 8),), {}) is sharded


def test_in_training_mode_the_plans_for_each_grad_mode_alternate_without_running_the_other():
    """The plan for a call is looked up by its shapes and grad mode: a plan for the other mode would
    fail its guard after stage 0 updated its batch norm, which training mode refuses."""
    torch.manual_seed(0)
    model = CheckpointsWithGrad()
    model.a = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    model.load_state_dict(twin.state_dict())  # the statistics before the example's runs
    x = torch.randn(4, 8)
    with torch.no_grad(), pytest.raises(SpecializationMismatch, match="sharded.specialize"):
        sharded(x)
    with torch.no_grad():
        sharded.specialize(x)
    model.load_state_dict(twin.state_dict())
    for mode in (torch.no_grad, torch.enable_grad, torch.no_grad, torch.enable_grad):
        with mode():
            assert torch.equal(sharded(x), twin(x))
    assert torch.equal(model.a[1].running_mean, twin.a[1].running_mean)


def test_stages_run_in_turn_on_inputs_a_specialisation_serves_are_told_where_its_stages_are():
    """The README runs the stages in turn; on inputs the first capture refuses, the refusal says
    that the sharded model serves them, and whose stages do, not only to shard again."""
    model, sharded = size_branch()
    x = torch.randn(1, 8)
    with pytest.raises(SpecializationMismatch) as refused:
        sharded.stages[1](*sharded.stages[0](x))
    assert str(refused.value).endswith(OTHER_CAPTURE) and "x.shape[0] > 2" in refused.value.refusal
    stages = sharded.specialize(x).stages
    assert torch.equal(stages[1](*stages[0](x)), model(x))


class Labelled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, labels=None):
        out = self.second(self.first(x))
        return out if labels is None else (out - labels).pow(2).mean()


def test_stages_run_in_turn_with_arguments_they_do_not_take_are_told_what_they_take_and_what_serves_them():
    """A first stage called with an argument its example left at its default (``labels=``, which the
    sharded model captures again for) raised Python's bare ``forward() got an unexpected keyword
    argument``; it is refused as the docs say, naming what the stage takes, still a ``TypeError``."""
    model, x = Labelled(), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    first, second = sharded.stages
    sent = f"({', '.join(inspect.signature(second.forward).parameters)})"
    for stage, args, kwargs, takes in ((first, (x,), {"labels": x}, "(x)"), (first, (), {}, "(x)"),
                                       (second, (x, x), {}, sent)):
        with pytest.raises(CallRefusedError) as refused:
            stage(*args, **kwargs)
        assert f"this stage takes {takes} and refuses" in str(refused.value) and isinstance(refused.value, TypeError)
        assert str(refused.value).endswith(OTHER_CAPTURE)
    stages = sharded.specialize(x, labels=x).stages
    assert torch.equal(stages[1](*stages[0](x, labels=x)), model(x, labels=x))


def test_specialize_gives_back_the_plan_made_for_these_inputs_rather_than_capturing_again():
    """Each call captured anew (1, 2, 3 specialisations for one shape): a training loop calling it before
    each step, as the docs advise, reached the limit."""
    model, sharded = size_branch()
    assert sharded.specialize(torch.randn(4, 8)) is sharded  # the example's own structure: these stages
    made = sharded.specialize(torch.randn(1, 8))
    assert sharded.specialize(torch.randn(1, 8)) is made and len(sharded.specializations) == 1
    x = torch.randn(1, 8)
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1


def test_specialize_gives_back_the_plan_made_for_a_nan_or_an_array_of_the_same_items():
    """A plan is found by its call's constants as its guard compares them (``same_constant``): by ``==``, a
    nan is no nan (each specialize captured again, up to the limit) and an array's items made no bool."""
    torch.manual_seed(0)
    model = SizeBranch().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),), {"scale": float("nan")})
    assert sharded.specialize(torch.randn(4, 8), scale=float("nan")) is sharded
    made = sharded.specialize(torch.randn(1, 8), scale=float("nan"))
    assert sharded.specialize(torch.randn(1, 8), scale=float("nan")) is made and len(sharded.specializations) == 1
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    arrays = autoshard.shard_model(TakesArrays().eval(), 2, (x,))
    assert arrays.specialize(x.copy()) is arrays and arrays.specializations == ()


class ScalesByIdsDtype(nn.Module):
    """Reads its ids' dtype: a capture fixes it (the input guard checks it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)) * (2 if ids.dtype == torch.int64 else 3)


def test_specialize_for_the_examples_shapes_in_another_dtype_gives_a_plan_that_serves_them():
    """A plan is chosen by its call's structure (shapes, constants) only where its guard also passes the
    call: the example's plan, whose guard fixed int64 ids, was given back for int32 ids of the same shape,
    and its stages refused them."""
    torch.manual_seed(0)
    model = ScalesByIdsDtype().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randint(0, 10, (2, 5)),))
    ids = torch.randint(0, 10, (2, 5), dtype=torch.int32)
    stages = sharded.specialize(ids).stages
    assert torch.equal(stages[1](*stages[0](ids)), model(ids)) and len(sharded.specializations) == 1


def test_respecialize_false_keeps_the_refusal():
    _, sharded = size_branch(respecialize=False)
    with pytest.raises(SpecializationMismatch, match=r"x.shape\[0\] > 2"):
        sharded(torch.randn(1, 8))
    assert sharded.specializations == ()
    with pytest.raises(PlanError, match="respecialize=True"):
        sharded.specialize(torch.randn(1, 8))


def test_the_limit_warns_when_reached_and_then_refuses_naming_what_was_made():
    _, sharded = size_branch(max_specializations=1)
    with pytest.warns(SpecializationLimitWarning, match="made its 1 specialisation ") as caught:
        sharded(torch.randn(1, 8))
    assert caught[0].filename == __file__  # the warning points at the call
    sharded.specializer._last.clear()
    _, none_allowed = size_branch(max_specializations=0)
    with pytest.raises(InputMismatchError, match=r"made its 0 specialisations \(max_specializations; made for: none\)"):
        none_allowed(torch.randn(1, 8))
    with pytest.raises(InputMismatchError, match="larger max_specializations="):
        none_allowed(torch.randn(1, 8))


class _Settings:
    calls = 0


class CountsOnItsSettings(nn.Module):
    """Counts its calls on the object it keeps its settings in: each call the plan serves writes the
    count back, and the next call, reading another value, takes another capture."""

    def __init__(self) -> None:
        super().__init__()
        self.settings, self.a, self.b = _Settings(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.settings.calls += 1
        return self.b(torch.relu(self.a(x)))


def test_the_limit_reached_by_a_count_the_forward_moves_on_says_so_not_to_raise_the_limit():
    model, x = CountsOnItsSettings(), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), max_specializations=3)
    with pytest.warns(SpecializationLimitWarning):
        for calls in range(1, 5):
            assert torch.equal(sharded(x), model(x))  # (the model's call moves it too: by two a round)
            assert model.settings.calls == 2 * calls
    with pytest.raises(InputMismatchError, match=r"the forward changes settings\.calls on every call .*a larger "
                       r"max_specializations only puts this off\): count outside the forward"):
        sharded(x)


def test_the_plan_settled_for_a_setting_the_first_call_fills_in_runs_call_after_call_as_the_model():
    """A pipeline runs one plan's stages for every microbatch: the example's plan, captured with
    ``problem_type`` unset, wrote it on the first and refused the second (DistilBERT's classifier
    with labels failed its first step). ``settled`` sets it as the first call would and gives the plan
    made for it (kept: asked again, no capture), which serves call after call."""
    torch.manual_seed(0)
    model, x, labels = FillsInItsProblemType(), torch.randn(4, 8), torch.tensor([0, 2, 1, 0])
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (x[:2], labels[:2]))
    plan = sharded.specializer.settled(sharded, sharded)
    assert plan is not sharded and model.config.problem_type == "single"
    assert sharded.specializer.settled(sharded, sharded) is plan and len(sharded.specializations) == 1
    for rows in (slice(0, 2), slice(2, 4)):
        assert torch.equal(plan.run_stages((x[rows], labels[rows]), {}), twin(x[rows], labels[rows]))
    assert sharded.specializer.settled(sharded, plan) is plan


def test_a_plan_settled_for_a_count_the_forward_moves_on_is_refused():
    """Each call moves the count on, so no plan serves two calls in turn (a pipeline's microbatches)."""
    model, x = CountsOnItsSettings(), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    with pytest.raises(InputMismatchError, match=r"changes settings\.calls on every call.*count outside the forward"):
        sharded.specializer.settled(sharded, sharded)


def test_the_limit_reached_by_a_number_changing_every_call_says_to_pass_it_as_a_tensor():
    """A diffusion step's noise level passed as a float made a capture per value, then a refusal that
    said only to raise the limit."""
    model, sharded = size_branch(max_specializations=2)
    x = torch.randn(4, 8)
    with pytest.warns(SpecializationLimitWarning):
        for scale in (2.0, 3.0):
            assert torch.equal(sharded(x, scale=scale), model(x, scale=scale))
    with pytest.raises(InputMismatchError, match=r"a number passed as an argument \(scale\) is a constant of each "
                                                 r"capture, one plan per value: where the model only computes with it"):
        sharded(x, 4.0)
    as_tensor = autoshard.shard_model(model, 2, (x, torch.tensor(2.0)))
    for scale in (3.0, 4.0, 5.0):
        assert torch.equal(as_tensor(x, torch.tensor(scale)), model(x, torch.tensor(scale)))
    assert as_tensor.specializations == ()


def test_another_constant_is_served_by_a_capture_made_with_it_and_what_no_capture_changes_is_refused():
    """As torch.compile recompiles on a constant's guard: ``scale=3.0`` where the example left the
    default is captured again with it; an argument the model does not take is refused as before."""
    model, sharded = size_branch()
    x = torch.randn(4, 8)
    assert torch.equal(sharded(x, scale=3.0), model(x, scale=3.0))
    (made,) = sharded.specializations
    assert "scale=3.0" in made.guard and "scale=3.0" in made.describe() and holders(made.sharded) == holders(sharded)
    assert torch.equal(sharded(x, 3.0), model(x, 3.0)) and torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1  # by position or by name: the same plan; the default: the first
    with pytest.raises(InputMismatchError, match="unexpected keyword argument 'shift'") as unknown:
        sharded(x, shift=1.0)
    assert not isinstance(unknown.value, SpecializationMismatch) and len(sharded.specializations) == 1
    # the model itself refuses it: no capture would serve it, so no advice to shard again; a TypeError, as the
    # model's own call raises (a helper probe: ``except TypeError`` missed it)
    assert "the model's forward(x, scale) refuses these arguments" in str(unknown.value)
    assert isinstance(unknown.value, TypeError) and isinstance(unknown.value, autoshard.CallRefusedError)
    for call in (lambda: sharded(), lambda: sharded(x, 1.0, 2.0)):
        with pytest.raises(TypeError, match="refuses these arguments"):
            call()
    assert "shard the model again" not in str(unknown.value)
    # a misspelt keyword is named, as Python names it, not the argument it leaves missing
    with pytest.raises(InputMismatchError,
                       match=r"refuses these arguments \(got an unexpected keyword argument 'inp'\)") as typo:
        sharded(inp=x)
    assert "missing" not in str(typo.value)
    with pytest.raises(InputMismatchError, match=r"'scal' \(did you mean 'scale'\?\)"):
        sharded(x, scal=2.0)
    fixed = autoshard.shard_model(model, 2, (x,), respecialize=False)
    with pytest.raises(SpecializationMismatch, match="the example left scale=1.0 at the default"):
        fixed(x, scale=3.0)  # no specialisations made: refused, naming the constant


def test_a_call_the_model_itself_refuses_gets_the_models_error():
    model, sharded = size_branch()
    with pytest.raises(RuntimeError) as expected:
        model(torch.randn(1, 7))
    with pytest.raises(RuntimeError) as got:
        sharded(torch.randn(1, 7))
    assert str(got.value) == str(expected.value)
    assert sharded.specializations == ()


class RefusesSmallBatches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[0] < 3:
            raise LookupError("this model takes batches of 3 or more")
        return self.b(h)


def test_a_call_the_model_refuses_only_in_its_new_capture_gets_the_models_error():
    sharded = autoshard.shard_model(RefusesSmallBatches(), 2, (torch.randn(4, 8),))
    with pytest.raises(LookupError, match="batches of 3 or more"):
        sharded(torch.randn(2, 8))  # the plan's guard fails, then the model raises in the new capture
    assert sharded.specializations == ()


def test_a_call_runs_first_the_plan_that_last_served_its_shapes():
    """A cached plan costs its own guard check: the plans that refused these shapes are not run again."""
    model, sharded = size_branch()
    sharded(torch.randn(1, 8))  # a capture for the other branch
    sharded(torch.randn(4, 8))  # the first plan served a call alike last: a new size tries it first
    tried = []

    def run(plan: autoshard.ShardedModel, args: tuple, kwargs: dict) -> torch.Tensor:
        tried.append(plan)
        return plan.run_stages(args, kwargs)

    for _ in range(2):
        sharded.specializer.serve(sharded, (torch.randn(2, 8),), {}, run=run)
    made = sharded.specializations[0].sharded
    assert tried == [sharded, made, made]


def test_calls_switching_between_constants_or_dict_orders_run_first_the_plan_made_for_theirs():
    """Keyed by shapes alone, a call alternating ``scale`` (or a dict's key order) ran the other
    value's plan first, to its guard's refusal, on every call: 1.4x (1.7x) the model's time."""
    model, sharded = size_branch()
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    u, v = torch.randn(3, 8), torch.randn(3, 8)
    ordered = autoshard.shard_model(ConcatsInOrder().eval(), 2, ({"u": u, "v": v},), {"p": u, "q": v})
    calls = [(sharded, (x,), {"scale": 3.0}), (sharded, (x,), {"scale": 1.0}),
             (ordered, ({"v": v, "u": u},), {"p": u, "q": v}), (ordered, ({"u": u, "v": v},), {"p": u, "q": v})]
    for plan, args, kwargs in calls:  # the captures
        plan(*args, **kwargs)
    tried = []

    def run(plan: autoshard.ShardedModel, args: tuple, kwargs: dict) -> torch.Tensor:
        tried.append(plan)
        return plan.run_stages(args, kwargs)

    for _ in range(2):
        for plan, args, kwargs in calls:
            plan.specializer.serve(plan, args, kwargs, run=run)
    made, other = sharded.specializations[0].sharded, ordered.specializations[0].sharded
    assert tried == [made, sharded, other, ordered] * 2


class BranchesOnADictsLength(nn.Module):
    """A branch on the length of a dict's tensor in the last layers (as a decoder's on ``q_len > 1``):
    a plan made for the other length computes its first stage before its guard refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.c(self.b(self.a(batch["x"])))
        if batch["x"].shape[1] > 1:
            h = h.cumsum(1)
        return self.d(h)


class Resizes(nn.Module):
    """Convolutions around ``F.interpolate`` to a size argument, which a capture keeps as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return self.b(nn.functional.interpolate(self.a(x), size=size))


def _tried_per_call(sharded: autoshard.ShardedModel, calls: list[tuple[tuple, dict]]) -> list[list]:
    """The plans each call's ``serve`` ran, in turn (those whose guard refused first)."""
    tried: list[list] = []

    def run(plan: autoshard.ShardedModel, args: tuple, kwargs: dict) -> torch.Tensor:
        tried[-1].append(plan)
        return plan.run_stages(args, kwargs)

    for args, kwargs in calls:
        tried.append([])
        sharded.specializer.serve(sharded, args, kwargs, run=run)
    return tried


class ListInDict(nn.Module):
    """Takes its input as ``{"xs": [x]}``: the served key reads a dict's items one level deep, so calls of
    each batch size have one key."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SizeBranch()

    def forward(self, batch: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        return self.inner(batch["xs"][0])


def test_a_key_served_by_another_plan_than_its_first_runs_that_plan_first_on_the_next_call():
    """A call whose key's first plan refused it and another served runs that one first next time (a
    mutation test kept the first plan first: every such call ran a refused plan before its own)."""
    torch.manual_seed(0)
    model = ListInDict().eval()
    sharded = autoshard.shard_model(model, 2, ({"xs": [torch.randn(4, 8)]},))
    calls = [(({"xs": [torch.randn(n, 8)]},), {}) for n in (1, 4, 4)]
    tried = _tried_per_call(sharded, calls)
    assert tried[1][-1] is sharded and tried[2] == [sharded]


def sequences(*lengths: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [{"x": torch.randn(2, length, 8)} for length in lengths]


def test_calls_switching_a_dicts_sizes_or_a_size_argument_run_only_the_plan_made_for_theirs():
    """A dict was keyed by its keys, a tuple not at all: a call alternating its dict's length ran the
    other length's plan's first stage, to its guard's refusal, and a size argument cycling through
    values the other size's plan first, on every call (2.0x and 1.7x the model's time)."""
    long, short = sequences(4, 1)
    dicts = autoshard.shard_model(BranchesOnADictsLength().eval(), 2, (long,))
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    sizes = autoshard.shard_model(Resizes().eval(), 2, (x, (8, 8)))
    cycles = [(dicts, [((batch,), {}) for batch in (short, long)]),
              (sizes, [((x, size), {}) for size in ((8, 8), (12, 12), (6, 10))])]
    for sharded, calls in cycles:
        _tried_per_call(sharded, calls)  # the captures
        plans = [sharded.specializer.made_for(sharded, *call) for call in calls]
        assert len(set(map(id, plans))) == len(calls) and None not in plans
        assert _tried_per_call(sharded, calls * 3) == [[plan] for plan in plans * 3]


def test_a_plan_refused_after_a_stage_computed_is_walked_once_for_what_running_it_again_does(monkeypatch):
    """After every guard that failed past a stage, every node of the stages was walked again for draws
    and buffer writes (150-300 µs), though the stages stay as captured."""
    import autoshard.capture.reruns as reruns

    long, short = sequences(4, 1)
    sharded = autoshard.shard_model(BranchesOnADictsLength().eval(), 2, (long,))
    walked = []
    facts = reruns.node_facts
    monkeypatch.setattr(reruns, "node_facts", lambda node: walked.append(node) or facts(node))
    sharded(short)  # refused by the example's plan, then captured
    refusals = []

    def run(plan: autoshard.ShardedModel, args: tuple, kwargs: dict) -> torch.Tensor:
        try:
            return plan.run_stages(args, kwargs)
        except SpecializationMismatch as refused:
            refusals.append((plan, refused.stage, refused.before_compute))
            raise

    for _ in range(3):
        sharded.specializer._last.clear()  # each call tries the example's plan first
        sharded.specializer.serve(sharded, (short,), {}, run=run)
    (plan, stage, before_compute), = set(refusals)
    assert len(refusals) == 3 and plan is sharded and not before_compute
    before = list(sharded.stages)[:list(sharded.stages).index(stage)]
    check = max(i for i, node in enumerate(stage.graph.nodes) if node.target is check_condition)
    assert len(walked) == sum(len(each.graph.nodes) for each in before) + check  # one walk, up to the check


def test_a_call_served_by_the_one_plan_made_for_its_key_checks_the_models_state_once(monkeypatch):
    """With a specialisation made, every call asked the plan's first stage whether its check passed
    (``state_holds``), then ran the stage, which checks it again, and rebuilt the list of plans that
    served its key: 8-23 µs a call. A setting switched between calls still runs the plan made for it
    (``test_attribute_reads``)."""
    model, sharded = size_branch()
    sharded(torch.randn(1, 8)), sharded(torch.randn(4, 8))  # a capture, and each key served once
    asked, remembered = [], []
    holds, remember = autoshard.ShardedModel.state_holds, Specializer._remember
    monkeypatch.setattr(autoshard.ShardedModel, "state_holds", lambda plan: asked.append(plan) or holds(plan))
    monkeypatch.setattr(Specializer, "_remember", lambda *args: remembered.append(args) or remember(*args))
    for batch in (1, 4, 1, 4):
        x = torch.randn(batch, 8)
        assert torch.equal(sharded(x), model(x))
    assert asked == [] and remembered == []


class ReadsValues(nn.Module):
    """Branches on its input's values: kept whole, and fake tensors cannot run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if bool(x.abs().sum() >= 0) else -x


class NormFirst(SizeBranch):
    """``SizeBranch`` whose batch norm (or dropout, set as ``norm``) runs before the branch, in its stage,
    then a module reading values: the branch's condition cannot be written over the input's sizes
    (``capture.size_conditions``), so only its check, after the batch norm, checks it."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__(norm)
        self.gate = ReadsValues()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        x = self.gate(self.norm(self.a(x))) * scale
        x = self.b(x) * 2 if x.shape[0] > 2 else self.b(x) - 1
        return self.d(self.c(x))


def test_served_inputs_name_the_conditions_the_stages_check_as_they_run():
    """A condition the input guard cannot say over the inputs' sizes (here, after code reading values) is checked
    where the stages reach it: ``served_inputs`` names it too, with the value it must keep (it said nothing)."""
    torch.manual_seed(0)
    sharded = autoshard.shard_model(NormFirst().eval(), 2, (torch.randn(4, 8),))
    served = sharded.served_inputs()
    assert re.search(r"as the stages run, the condition at test_specialize\.py:\d+ \(`.*x\.shape\[0\] > 2.*`\) is "
                     r"True", served), served
    with pytest.raises(SpecializationMismatch, match=r"x\.shape\[0\] > 2.*is False for these inputs"):
        sharded.run_stages((torch.randn(2, 8),), {})


def test_in_training_mode_a_guard_failing_after_a_stage_ran_is_refused_and_specialize_serves_it():
    torch.manual_seed(0)
    model = NormFirst(norm=True).train()
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    x = torch.randn(2, 8)
    with pytest.raises(SpecializationMismatch, match=r"Call sharded.specialize\(\*args, \*\*kwargs\) with inputs"):
        sharded(x)  # (as the error table files it: a size the capture fixed, and no new specialisation made)
    # The refused call ran the stage that holds the batch norm: its statistics moved once more.
    sharded.specialize(torch.randn(2, 8))
    model.norm.running_mean.copy_(twin.norm.running_mean)
    assert torch.equal(sharded(x), twin(x))
    assert torch.equal(model.norm.running_mean, twin.norm.running_mean)


def test_in_training_mode_a_call_for_new_shapes_tries_first_the_plan_that_served_calls_alike():
    """New shapes try first the plan that last served a call alike but for its sizes: served where it
    serves them; where its guard fails after stage 0 ran, refused as on the first call (stage 0 updates a
    buffer), though another plan serving them exists."""
    torch.manual_seed(0)
    model = NormFirst().train()
    model.norm = AddsItsCallCount()
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    sharded.specialize(torch.randn(2, 8))
    x = torch.randn(1, 8)
    assert torch.equal(sharded(x), twin(x))
    with pytest.raises(SpecializationMismatch, match=r"Call sharded.specialize\(\*args, \*\*kwargs\)"):
        sharded(torch.randn(5, 8))
    assert len(sharded.specializations) == 1


def test_in_training_mode_new_shapes_refused_late_by_a_plan_that_drew_take_the_next_with_the_draws_rewound():
    """A plan tried for new shapes whose guard refuses them after its stages drew (dropout before the branch)
    is followed by the next with the generators set back: the call draws what the model draws. Before, the
    plan made for one shape (batch 2) was tried first for every new one and refused it, for good."""
    model = NormFirst().train()
    model.norm = nn.Dropout(0.5)
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    sharded.specialize(torch.randn(2, 8))
    for batch in (2, 4, 5, 1, 6):
        x = torch.randn(batch, 8)
        torch.manual_seed(batch)
        expected, after = model(x), torch.random.get_rng_state()
        torch.manual_seed(batch)
        assert torch.equal(sharded(x), expected), batch
        assert torch.equal(torch.random.get_rng_state(), after), batch
    assert len(sharded.specializations) == 1


class ReshapesTo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        h = self.b(self.a(x))
        return self.c(h if shape is None else h.reshape(shape))


@pytest.mark.parametrize("example", [torch.Size([1, 2, 8]), (1, 2, 8), None])
def test_a_shape_passed_as_a_torch_size_or_a_tuple_is_one_constant(example):
    """A ``torch.Size`` argument and a tuple of the same sizes are served alike: torch's pytree rebuilds a Size as
    a tuple when the inputs are copied, and a plan made with a Size refused its own example while sharding."""
    model = ReshapesTo().eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), {} if example is None else {"shape": example})
    for shape in (torch.Size([1, 2, 8]), (1, 2, 8), torch.Size([2, 1, 8])):
        assert torch.equal(sharded(x, shape=shape), model(x, shape=shape)), shape


def test_in_training_mode_a_guard_failing_after_stages_drew_is_served_with_the_draws_drawn_again():
    """The first call of new shapes, refused by a check after the stages drew (dropout before the branch), is
    served by a new capture with the generators set back (it was refused: call specialize first); the
    generators end as the model leaves them."""
    model = NormFirst().train()
    model.norm = nn.Dropout(0.5)  # no buffers: only the draws would differ from the model's
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    x = torch.randn(2, 8)
    torch.manual_seed(3)
    expected, after = model(x), torch.random.get_rng_state()
    torch.manual_seed(3)
    assert torch.equal(sharded(x), expected) and len(sharded.specializations) == 1
    assert torch.equal(torch.random.get_rng_state(), after)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_guard_failing_before_any_stage_that_updates_buffers_or_draws_ran_is_served(mode):
    """Only the stages up to the one whose guard failed ran: where none of them updates a buffer or
    draws, running them again is running them once (the batch norm and the dropout sit after the
    branch), so a new capture serves the call; before, training mode refused it."""
    torch.manual_seed(0)
    model = getattr(SizeBranch(norm=True), mode)()
    model.d = nn.Sequential(nn.Dropout(0.5), model.d)
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    model.norm.running_mean.copy_(twin.norm.running_mean)
    x = torch.randn(2, 8)
    torch.manual_seed(1)
    expected = twin(x)
    torch.manual_seed(1)
    assert torch.equal(sharded(x), expected) and len(sharded.specializations) == 1
    assert torch.equal(model.norm.running_mean, twin.norm.running_mean)


class CountsItsCalls(SizeBranch):
    """``SizeBranch`` that counts its calls in a buffer, in eval mode too (a step counter)."""

    def __init__(self) -> None:
        super().__init__(norm=True)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x + self.calls, scale)


def test_in_eval_mode_stages_that_write_a_buffer_or_draw_random_numbers_are_not_run_again():
    """Eval mode ran them again: the counter counted the call twice (and every later output differed),
    a sampling stage drew other numbers than the model. Batch norm in eval mode updates nothing, so
    ``NormFirst(norm=True)`` is served by a new capture."""
    torch.manual_seed(0)
    model = CountsItsCalls().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    with pytest.raises(SpecializationMismatch, match="update buffers"):
        sharded(torch.randn(2, 8))
    assert model.calls.item() == 1 and sharded.specializations == ()  # counted once, by the stage that ran
    sampling = NormFirst().eval()
    sampling.norm = Samples()
    sharded = autoshard.shard_model(sampling, 2, (torch.randn(4, 8),))
    with pytest.raises(SpecializationMismatch, match="draw random"):
        sharded(torch.randn(2, 8))
    model = NormFirst(norm=True).eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    x = torch.randn(2, 8)
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1


class AddsItsCallCount(nn.Module):
    """Updates a buffer of its own on every call, traced through (a batch norm refuses a batch of one in
    training mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + self.offset * self.calls


class Samples(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)


def test_in_training_mode_a_size_refused_before_any_stage_ran_is_served_by_a_new_capture():
    """export's guard refuses the size at the first node, before a stage computed: none runs twice."""
    torch.manual_seed(0)
    model = SizeBranch(norm=True).train()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),),
                                    pipeline="export,shape-prop,build-dag,linearize,split,emit")
    twin, x = copy.deepcopy(model), torch.randn(2, 8)
    assert torch.equal(sharded(x), twin(x))
    assert torch.equal(model.norm.running_mean, twin.norm.running_mean)  # updated once
    assert "outside what the plan serves" in sharded.specializations[0].guard


def test_in_training_mode_a_call_by_keyword_runs_the_plan_made_for_its_shapes_first():
    """Plans are looked up by the shapes of keyword arguments too: the other plan, tried first, would
    fail its guard after stage 0 ran, which training mode refuses."""
    torch.manual_seed(0)
    model = SizeBranch(norm=True).train()
    sharded = autoshard.shard_model(model, 2, example_kwargs={"x": torch.randn(4, 8)})
    sharded.specialize(x=torch.randn(2, 8))
    twin = copy.deepcopy(model)
    for batch in (4, 2, 4):
        x = torch.randn(batch, 8)
        assert torch.equal(sharded(x=x), twin(x=x))


def test_a_new_capture_holding_a_weight_in_another_stage_is_refused():
    """The capture is given every weight's stage as a pin; what it returns is checked all the same."""
    model, sharded = size_branch()
    elsewhere = autoshard.shard_model(model, 4, (torch.randn(1, 8),))
    sharded.specializer = Specializer(model, lambda *_: elsewhere, example=((torch.randn(4, 8),), {}))
    with pytest.raises(InputMismatchError, match=r"a new capture for these inputs holds '.*' in stage\(s\) \[\d\], "
                                                 r"but the plan holds it in stage\(s\) \[\d\]"):
        sharded(torch.randn(1, 8))
    assert sharded.specializations == ()


class ShapeReadMask(nn.Module):
    """Cuts an optional mask to its position table's length, read from the table's shape (as
    SigLIP's text embeddings read ``position_embedding.weight.shape[0]``), in the layers the split
    puts in stage 0; the table itself is looked up in stage 1. ``values``: the mask is scaled by the
    table's values instead, a real read of a weight stage 1 holds."""

    def __init__(self, values: bool = False) -> None:
        super().__init__()
        self.values = values
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 32)
        self.pos, self.c = nn.Embedding(16, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:
            table = self.pos.weight
            h = h * (mask[..., None] * table.mean() if self.values else
                     mask[:, :table.shape[0], None] * table.size(1) / table.numel() * table.dim())
        h = self.b(h)
        return self.c(h + self.pos(torch.arange(x.shape[1], device=x.device)))


def shape_read_mask(values: bool = False) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    return ShapeReadMask(values).eval(), torch.randn(2, 5, 8), mask


def test_a_branch_reading_only_a_weights_shape_in_another_stage_keeps_every_weight_in_its_stage():
    """The new capture reads the table's shape in stage 0: a constant there, not a reason to hold
    the table, so the call is served with every weight where the plan holds it. A plan made with
    the mask holds the table in one stage too."""
    model, x, mask = shape_read_mask()
    sharded = autoshard.shard_model(model, 2, (x,))
    before = holders(sharded)
    assert before["pos.weight"] == {1}
    assert torch.equal(sharded(x, mask), model(x, mask))
    (made,) = sharded.specializations
    assert holders(made.sharded) == before
    assert "torch.Size((16, 32))" in made.sharded.stages[0].code
    with_mask = autoshard.shard_model(model, 2, (x, mask))
    assert holders(with_mask)["pos.weight"] == {1} and torch.equal(with_mask(x, mask), model(x, mask))


def test_a_branch_computing_with_a_weight_in_another_stage_is_still_refused():
    model, x, mask = shape_read_mask(values=True)
    sharded = autoshard.shard_model(model, 2, (x,))
    with pytest.raises(InputMismatchError, match=r"A new capture for these inputs, with every weight in the stage "
                                                 r"that holds it, failed \(.*'pos.weight' \(pinned to stage 1\).*\); "
                                                 r"shard the model again with an example like these inputs$"):
        sharded(x, mask)
    assert sharded.specializations == ()


class _Cache:
    """Holds a tensor and compares by identity, as a generation cache does."""

    def __init__(self, kept: torch.Tensor) -> None:
        self.kept = kept


class _CacheOnRequest(nn.Module):
    """Returns an object holding a tensor when asked (a generation cache, ``use_cache=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, keep: bool = False):
        y = self.b(self.a(x))
        return (y, _Cache(y)) if keep else y


def test_a_call_the_capture_refuses_is_not_told_to_shard_again_after_the_reason():
    """Sharding again with such an example is refused for the same reason: the advice after it was
    wrong (it is the guard's, once, before the capture's own reason and what to do)."""
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(_CacheOnRequest(), 2, (x,))
    with pytest.raises(InputMismatchError) as refused:
        sharded(x, keep=True)
    message = str(refused.value)
    assert "returns a _Cache holding values its forward computed" in message
    assert "shard the model again" not in message  # (sharding with such an example fails the same way)


def test_a_refused_call_is_refused_again_without_capturing_again_until_the_model_changes():
    """A serving loop falling back to the model on a refusal paid a full capture (seconds on a real model)
    for each such call."""
    model, x = _CacheOnRequest(), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    captures = []
    capture = sharded.specializer._capture
    sharded.specializer._capture = lambda *args: (captures.append(1), capture(*args))[1]
    for _ in range(3):
        with pytest.raises(InputMismatchError, match="returns a _Cache holding values its forward computed"):
            sharded(torch.randn(2, 8), keep=True)
    assert len(captures) == 1
    with pytest.raises(InputMismatchError, match=r"refused when first tried.*sharded\.specialize\(\) with these"):
        sharded(x, keep=True)
    assert len(captures) == 1
    # another shape, layout, or an input requiring grad: tried
    for another in (torch.randn(3, 8), x.t().contiguous().t(), x.clone().requires_grad_()):
        with pytest.raises(InputMismatchError):
            sharded(another, keep=True)
    assert len(captures) == 4
    changed = [lambda: setattr(model, "note", "set since"), lambda: model.table.update(mode=2)]
    model.table = {"mode": 1}
    for change in changed:  # a number, flag or string on a module, or in a dict or list of them: tried
        change()
        with pytest.raises(InputMismatchError):
            sharded(x, keep=True)
    assert len(captures) == 6
    with pytest.raises(InputMismatchError):
        sharded.specialize(x, keep=True)  # asked for: tried (where the model changed elsewhere, a global)
    assert len(captures) == 7
    assert torch.equal(sharded(x), model(x))


class _RowsChecked(nn.Module):
    """Refuses inputs of more rows than it is set to take, as a vision model checks its image size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.most = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.most:
            raise ValueError(f"this model takes at most {self.most} rows")
        return self.b(self.a(x))


def test_a_call_the_model_itself_refused_asks_the_model_first_without_capturing_again():
    """Each such call (a serving loop's bad request) took a capture attempt, 1.3-2.2 s on a tiny ViT, to
    end in the model's own error; what decides may change, so the model is asked again each time."""
    model = _RowsChecked()
    sharded = autoshard.shard_model(model, 2, (torch.rand(2, 8),))
    captures = []
    capture = sharded.specializer._capture
    sharded.specializer._capture = lambda *args: (captures.append(1), capture(*args))[1]
    for _ in range(3):
        with pytest.raises(ValueError, match="at most 2 rows"):
            sharded(torch.rand(3, 8))
    assert len(captures) == 1
    model.most = 4  # the same call, now taken: captured and served
    served = torch.rand(3, 8)
    assert torch.equal(sharded(served), model(served)) and len(captures) == 2


def test_a_refusal_is_remembered_by_its_tensors_layout_sparse_ones_too():
    """A sparse CSR tensor has no ``is_contiguous``: asking it failed the call before any capture."""
    dense = torch.eye(3)
    facts = {_tensor_facts((t,), {}) for t in (dense, dense.t(), dense.to_sparse(), dense.to_sparse_csr())}
    assert len(facts) == 4


def test_copies_and_pickles_serve_what_their_own_guards_allow():
    """A copy keeps no specializer: its refusals (a call, an offload runner's, its own specialize) say so
    and to specialise the sharded model before copying it, not to call the copy (what failed) or run
    its specialize (which raises); doing as they say serves the call. It still knows its example."""
    model, sharded = size_branch()
    small = torch.randn(1, 8)
    for copied in (copy.deepcopy(sharded), pickle.loads(pickle.dumps(sharded))):
        assert copied.specializer is None and copied.captured_for.structure == sharded.captured_for.structure
        for run in (copied, autoshard.runtime.OffloadRunner(copied, "cpu")):
            with pytest.raises(SpecializationMismatch, match=r"these stages make no specialisations \(a copy of "
                                                             r"them: .*call specialize\(\*inputs\) before copying "
                                                             "it") as refused:
                run(small)
            assert OTHER_CAPTURE not in str(refused.value)
        with pytest.raises(PlanError, match=r"a copy of them: copy.deepcopy, a pickle, materialize_stage; or made with "
                                            r"respecialize=False\), nor do stages made without example inputs.*"
                                            r"Call specialize on the sharded model .* before copying"):
            copied.specialize(small)
    advised = copy.deepcopy(sharded.specialize(small))
    assert torch.equal(advised(small), model(small))


def test_the_offload_runner_serves_the_specialisations_too():
    model, sharded = size_branch()
    runner = autoshard.runtime.OffloadRunner(sharded, "cpu")
    for batch in (1, 4, 2):
        x = torch.randn(batch, 8)
        assert torch.equal(runner(x), model(x))
    assert len(sharded.specializations) == 1


def test_a_loaded_plan_specialises_under_its_partition(tmp_path):
    model, sharded = size_branch()
    path = sharded.save_plan(tmp_path / "plan.json")
    loaded = autoshard.load_plan(path, model, (torch.randn(4, 8),))
    x = torch.randn(1, 8)
    assert torch.equal(loaded(x), model(x))
    (made,) = loaded.specializations
    assert holders(made.sharded) == holders(sharded)


def test_a_loaded_plan_takes_its_limit_of_specialisations_as_shard_model_does(tmp_path):
    """load_plan had no max_specializations: a loaded plan refused its ninth new capture, naming a
    limit its caller could not raise (a training loop over a few sequence lengths and modes meets it)."""
    model, sharded = size_branch()
    path = sharded.save_plan(tmp_path / "plan.json")
    with pytest.warns(SpecializationLimitWarning):
        none_more = autoshard.load_plan(path, model, (torch.randn(4, 8),), max_specializations=1)
        none_more(torch.randn(1, 8))
    with pytest.raises(InputMismatchError, match=r"made its 1 specialisation.*shard the model \(or load its plan\) "
                                                 "with a larger max_specializations="):
        none_more(torch.randn(1, 8), scale=2.0)
    with pytest.raises(ValueError, match="max_specializations must be"):
        autoshard.load_plan(path, model, (torch.randn(4, 8),), max_specializations=-1)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_specializations=-1), "max_specializations must be"), (dict(respecialize="yes"), "respecialize must be")])
def test_bad_specialisation_arguments_are_refused_before_any_capture(kwargs, message):
    model = SizeBranch()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises((InputMismatchError, ValueError, TypeError), match=message):
        autoshard.shard_model(model, 2, (torch.randn(4, 8),), **kwargs)
    assert not calls


class Switch(nn.Module):
    """A module whose branch on the batch size runs one of two submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.shape[0] > 2 else self.b(x)


class Switched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.switch, self.post = nn.Linear(8, 8), Switch(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.switch(self.pre(x)))


def test_a_users_pin_on_a_module_the_new_branch_does_not_run_pins_nothing_there():
    torch.manual_seed(0)
    model = Switched().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 8),), pin={"switch.b": 1})
    assert holders(sharded)["switch.b.weight"] == {1}
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1


SPLIT = "capture,shape-prop,build-dag,linearize,split{%s},emit,verify"


@pytest.mark.parametrize("constraint", [{"no_split": ["switch.b"]}, {"cut_before": ["switch.b"]},
                                        {"pipeline": SPLIT % "no-split=switch.b"},
                                        {"pipeline": SPLIT % "cut-before=switch.b"}])
def test_a_users_no_split_or_cut_on_a_module_the_new_branch_does_not_run_holds_nothing_there(constraint):
    """The plan keeps ``switch.b`` whole or starts a stage at it; the batch-3 branch runs ``switch.a``
    instead, and its specialisation is made without that constraint, weights in their stages."""
    torch.manual_seed(0)
    model = Switched().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 8),), **constraint)
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1
    before, after = holders(sharded), holders(sharded.specializations[0].sharded)
    assert set(before) - set(after) == {"switch.b.weight", "switch.b.bias"}
    assert all(after[name] == held for name, held in before.items() if name in after)


class StepsOverTheLength(nn.Module):
    """Loops over the sequence length, turned into a Python number (as Funnel's ``int()`` of a
    length does): the capture pins the length and guards it."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(x[:, 0])
        for step in range(int(x.shape[1])):
            state = torch.tanh(self.cell(state) + x[:, step])
        return self.head(state)


def test_a_length_turned_into_a_number_is_served_at_other_lengths_by_new_captures():
    torch.manual_seed(0)
    model = StepsOverTheLength().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 3, 4),))
    for length in (5, 3, 2):
        x = torch.randn(2, length, 4)
        assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 2
    assert all(holders(made.sharded) == holders(sharded) for made in sharded.specializations)


class RankBranch(nn.Module):
    """Takes an input with or without its batch dimension (``x.dim()``), and a timestep as a number
    or one per sample (diffusers' ``len(timestep.shape) == 0``): the fx trace answers both from the
    example, so the plan must guard the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x[None]
        if len(t.shape) == 0:
            t = t[None]
        return self.b(self.a(x) + t[:, None, None]).sum(0)


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_an_input_of_another_number_of_dimensions_is_served_by_a_new_capture(front_end):
    torch.manual_seed(0)
    model = RankBranch().eval()
    pipeline = f"{front_end},shape-prop,build-dag,linearize,split{{stages=2}},emit,verify"
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 8), torch.tensor(3.0)), pipeline=pipeline)
    for x, t in [(torch.randn(3, 2, 8), torch.tensor(3.0)), (torch.randn(2, 8), torch.tensor([1.0])),
                 (torch.randn(5, 8), torch.tensor(2.0))]:
        assert torch.equal(sharded(x, t), model(x, t))
    assert len(sharded.specializations) == 2


def test_a_plan_that_serves_one_number_of_dimensions_says_so():
    model = RankBranch().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 8), torch.tensor(3.0)), respecialize=False)
    with pytest.raises(SpecializationMismatch, match=r"x is not a 2-dimensional tensor\. The plan serves "
                                                     r"x: float32 of shape \(any, any\), t: float32 of shape \(\)"):
        sharded(torch.randn(3, 2, 8), torch.tensor(3.0))


class NestedSizeBranch(SizeBranch):
    """``SizeBranch`` taking its input inside a dict: the branch's size is a nested input's."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch["x"])


def test_a_plan_chosen_up_front_matches_nested_shapes_too():
    """``plan_for`` (``pipeline_stage(..., microbatch=)``) chooses by every tensor's shape: a
    microbatch whose top-level arguments look like the example's (one dict) but whose nested tensor
    flips the branch gets a plan captured for it, which then runs it with no guard refusing."""
    torch.manual_seed(0)
    model = NestedSizeBranch().eval()
    sharded = autoshard.shard_model(model, 2, ({"x": torch.randn(4, 8)},))
    example, small = {"x": torch.randn(4, 8)}, {"x": torch.randn(2, 8)}
    assert sharded.specializer.plan_for(sharded, (example,), {}) is sharded
    chosen = sharded.specializer.plan_for(sharded, (small,), {})
    assert chosen is not sharded and [s.sharded for s in sharded.specializations] == [chosen]
    assert torch.equal(chosen.run_stages((small,), {}), model(small))
    assert sharded.specializer.plan_for(sharded, ({"x": torch.randn(2, 8)},), {}) is chosen  # kept, not made again


class AddsTwoEntries(nn.Module):
    """Takes one dict argument and reads its ``x`` and ``y``: a layout inside an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.last(self.first(batch["x"]) + batch["y"])


def test_with_a_stage_on_meta_the_plan_made_for_the_nested_shapes_serves():
    """Where no stage may run to choose (one is on the meta device), a measurement takes the plan
    made for the call's structure, nested shapes included: the example's own shapes are the plan
    itself, not the specialisation that last served the same top-level arguments (one dict)."""
    torch.manual_seed(0)
    model = NestedSizeBranch().eval()
    sharded = autoshard.shard_model(model, 2, ({"x": torch.randn(4, 8)},))
    made = sharded.specialize({"x": torch.randn(2, 8)})
    sharded.stages[1].to("meta")
    assert serving_plan(sharded, ({"x": torch.randn(4, 8)},), {}) is sharded
    assert serving_plan(sharded, ({"x": torch.randn(2, 8)},), {}) is made
    assert serving_plan(sharded, ({"x": torch.randn(3, 8)},), {}) is sharded  # none made for it


class ConcatsInOrder(nn.Module):
    """Reads a dict and its ``**kwargs`` in their order: a call giving them in another order than
    the example's computes something else."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(32, 4)

    def forward(self, feats: dict[str, torch.Tensor], **more: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cat([self.a(v) for v in (*feats.values(), *more.values())], dim=-1))


def test_a_dict_or_keywords_in_another_order_get_a_plan_of_their_own():
    """They were served by the example's plan, whose graph read them in the example's order: a
    silently wrong answer. ``plan_for`` tells the orders apart too."""
    torch.manual_seed(0)
    model = ConcatsInOrder().eval()
    u, v = torch.randn(3, 8), torch.randn(3, 8)
    sharded = autoshard.shard_model(model, 2, ({"u": u, "v": v},), {"p": u, "q": v})
    assert torch.equal(sharded({"u": u, "v": v}, p=u, q=v), model({"u": u, "v": v}, p=u, q=v))
    for feats, more in [({"v": v, "u": u}, {"p": u, "q": v}), ({"u": u, "v": v}, {"q": v, "p": u})]:
        assert torch.equal(sharded(feats, **more), model(feats, **more))
    assert len(sharded.specializations) == 2
    assert sharded.specializer.plan_for(sharded, ({"v": v, "u": u},), {"p": u, "q": v}) is \
        sharded.specializations[0].sharded
    assert sharded.specializer.plan_for(sharded, ({"u": u, "v": v},), {"q": v, "p": u}) is \
        sharded.specializations[1].sharded
    assert sharded.specializer.plan_for(sharded, ({"u": v, "v": u},), {"p": v, "q": u}) is sharded


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.b(self.a(x) * mask)


def test_a_microbatch_by_name_is_the_plan_made_from_positions():
    """``pipeline_stage(microbatch=)`` takes a tuple or a dict, so an example of ``(x,)`` with a
    keyword ``mask`` is given as ``{"x": ..., "mask": ...}``: the same call, so the same plan."""
    torch.manual_seed(0)
    model = WithMask().eval()
    x, mask = torch.randn(4, 8), torch.rand(4, 8).round()
    sharded = autoshard.shard_model(model, 2, (x,), {"mask": mask})
    assert sharded.specializer.plan_for(sharded, (), {"mask": mask, "x": x}) is sharded
    assert sharded.specializer.plan_for(sharded, (x, mask), {}) is sharded
    assert sharded.specializations == ()


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0, gate: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x) * scale
        return self.b(h if gate is None else h * gate)


def test_an_argument_given_its_default_is_the_plan_that_left_it_out():
    """A microbatch that passes an argument's default (``use_cache=False`` where the example left it
    out) is the call the plan already serves, as the call's binding takes it: no capture is spent."""
    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    for args, kwargs in [((x,), {"scale": 1.0}), ((x, 1.0), {}), ((x,), {"gate": None}), ((), {"x": x, "scale": 1.0})]:
        assert sharded.specializer.plan_for(sharded, args, kwargs) is sharded
    assert sharded.specializations == ()
    assert torch.equal(sharded(x, scale=1.0), model(x))


def test_a_microbatch_with_other_constants_or_arguments_gets_a_plan_of_its_own_which_calls_reach_too():
    """``pipeline_stage(microbatch=...)`` chooses the plan up front: another constant, an argument the
    example passed left out, or one it left out passed, is captured with it, as a call would be."""
    torch.manual_seed(0)
    model = Scaled().eval()
    x, gate = torch.randn(4, 8), torch.rand(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,), {"scale": 2.0, "gate": gate})
    tripled = sharded.specializer.plan_for(sharded, (x,), {"scale": 3.0, "gate": gate})
    ungated = sharded.specializer.plan_for(sharded, (x[:2],), {"scale": 2.0})
    default = sharded.specializer.plan_for(sharded, (x[:2],), {"gate": gate[:2]})
    assert len({id(p) for p in (sharded, tripled, ungated, default)}) == 4 and len(sharded.specializations) == 3
    assert "gate" not in inspect.signature(ungated.stages[0].forward).parameters
    for kwargs, plan in [({"scale": 3.0, "gate": gate}, tripled), ({"scale": 2.0}, ungated), ({"gate": gate}, default)]:
        rows = x if plan is tripled else x[:2]
        kwargs = {k: (v if k != "gate" or plan is tripled else v[:2]) for k, v in kwargs.items()}
        assert sharded.specializer.plan_for(sharded, (rows,), kwargs) is plan
        assert torch.equal(sharded(rows, **kwargs), model(rows, **kwargs))
    assert len(sharded.specializations) == 3  # every call above was served by a plan made for it
    as_int = sharded.specializer.plan_for(sharded, (x,), {"scale": 2, "gate": gate})  # equal by ==, but an int
    assert as_int is not sharded and len(sharded.specializations) == 4  # as the guard compares it
    passed_default = autoshard.shard_model(model, 2, (x,), {"scale": 1.0})  # the default, passed: the same
    assert passed_default.specializer.plan_for(passed_default, (x,), {}) is passed_default


class NormsInAList(nn.Module):
    """Two norms kept in a plain list, outside the module tree: the capture lifts their tensors under
    names it numbers afresh each time; a branch on the batch size skips the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.extra = [nn.BatchNorm1d(4).eval(), nn.LayerNorm(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[0] > 4:
            h = self.extra[0](h)
        return self.d(self.extra[1](self.c(self.b(h))))


def test_tensors_lifted_from_outside_the_module_tree_do_not_pin_a_new_capture():
    """The first capture's ``lifted_tensor_0`` is the batch norm's; the second's, the layer norm's.
    Pinning such names to the first plan's stages contradicted the new graph's order."""
    torch.manual_seed(0)
    model = NormsInAList().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),))
    x = torch.randn(2, 4)
    assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1


class TiedLM(nn.Module):
    """GPT-2's layout in small: the head reads the embedding's weight, so the first and last stages
    both hold it (under its two names), and a branch on the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.b1, self.b2 = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if ids.shape[1] > 1:
            h = h + 1
        return self.head(self.b2(torch.relu(self.b1(h))))


def test_a_weight_tied_across_stages_is_held_as_before_by_each_specialisation():
    """The tied weight is held by stage 0 as ``emb.weight`` and by stage 1 as ``head.weight``: one
    tensor in two stages, left to the split (pinning each name to its stage pinned the one tensor to
    both, and every new capture was refused)."""
    torch.manual_seed(0)
    model = TiedLM().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randint(0, 50, (2, 8)),))
    before = holders(sharded)
    assert before["emb.weight"] == before["head.weight"] == {0, 1}
    for ids in (torch.randint(0, 50, (2, 1)), torch.randint(0, 50, (3, 5))):
        assert torch.equal(sharded(ids), model(ids))
    sharded.specialize(torch.randint(0, 50, (2, 12)))  # made ahead, no guard flipped
    assert len(sharded.specializations) == 2
    assert all(holders(made.sharded) == before for made in sharded.specializations)


def test_a_specialisation_names_the_tensors_it_was_made_for_inside_its_arguments():
    """What the limit's refusal lists: ``batch['x']: (1, 8)``, not "no tensor arguments"."""
    torch.manual_seed(0)
    sharded = autoshard.shard_model(NestedSizeBranch().eval(), 2, ({"x": torch.randn(4, 8)},))
    sharded({"x": torch.randn(1, 8)})
    (made,) = sharded.specializations
    assert made.describe().startswith("batch['x']: (1, 8) (")


class SharedBuffer(nn.Module):
    """A buffer both stages read, and a branch on the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("shared", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            x = x * 2
        return self.c(torch.relu(self.a(x)) + self.shared) + self.shared


def test_a_stage_holding_its_own_copy_of_a_shared_buffer_still_respecialises():
    """``stages[1].to(device)`` gives that stage its own copy of the buffer both stages read, under
    the same name: still held by both (before, the last stage's tensor won, the buffer was pinned
    to stage 1 alone, and no split met that)."""
    torch.manual_seed(0)
    model = SharedBuffer().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),), cut_before=["c"])
    sharded.stages[1]._apply(lambda t: t.clone())  # what .to(another device) does to the stage's buffers
    assert holders(sharded)["shared"] == {0, 1}
    x = torch.randn(2, 4)
    assert torch.allclose(sharded(x), model(x)) and len(sharded.specializations) == 1


class TakesArrays(nn.Module):
    """Converts what it is given (a numpy array) to a tensor: to a capture the array is a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x) -> torch.Tensor:
        return self.b(self.a(torch.as_tensor(x, dtype=torch.float32)))


def test_a_numpy_array_is_a_constant_compared_by_its_items_and_named_by_its_shape():
    """An array's == compares items: the capture's constant check read that as 'changed in place' and
    refused even the example array, printing both arrays whole. Now the same items serve the plan,
    other items a new capture, and a refusal names the array by shape and says to pass a tensor."""
    import numpy as np

    torch.manual_seed(0)
    model = TakesArrays().eval()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert torch.equal(sharded(x.copy()), model(x)) and sharded.specializations == ()
    other = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    assert torch.equal(sharded(other), model(other)) and len(sharded.specializations) == 1
    fixed = autoshard.shard_model(model, 2, (x,), respecialize=False)
    with pytest.raises(SpecializationMismatch) as refused:
        fixed(other)
    assert "x=array[3, 4] of float32" in str(refused.value) and "torch.from_numpy" in str(refused.value)
    assert len(str(refused.value)) < 800


class TwoMarkers(nn.Module):
    """Asserts a count read off its input's values (``torch._check``): torch.export keeps the check."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n = (ids == 2).sum().item()
        torch._check(n == 2, lambda: "two markers, please")
        return self.b(self.a(x)) * 2


@pytest.mark.parametrize("respecialize", [True, False])
def test_a_check_export_kept_and_a_call_breaks_gets_the_models_error_or_a_typed_refusal(respecialize):
    """The stage raised torch's 'Runtime assertion failed for expression ...' (a RuntimeError from
    inside its code; BART's classification head met it, sweep finding). A sharded model captures
    again for such a call, which shows the model's own error; without re-specialisation the
    refusal is typed."""
    torch.manual_seed(0)
    model, x = TwoMarkers().eval(), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, 2, (x, torch.tensor([[1, 2, 3], [2, 1, 1]])), respecialize=respecialize,
                                    pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    three = torch.tensor([[2, 2, 3], [2, 1, 1]])
    if respecialize:
        with pytest.raises(RuntimeError, match="^two markers, please$"):
            sharded(x, three)
    else:
        with pytest.raises(SpecializationMismatch, match=r"a condition the model's code asserted .*torch.export kept"):
            sharded(x, three)
    again = torch.tensor([[2, 3, 3], [2, 1, 1]])  # two again: served
    assert torch.equal(sharded(x, again), model(x, again))


class FewerLayers(nn.Module):
    def __init__(self, count: int = 4, act: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(count))
        self.act = act

    def forward(self, x: torch.Tensor, n: int | None = None) -> torch.Tensor:
        for layer in self.layers[:n]:
            x = torch.tanh(layer(x)) if self.act else layer(x)
        return x


@pytest.mark.parametrize("count,act,k,example,call,left", [
    (4, False, 2, {}, 2, r"stage 1 of 2 with nothing to compute"),
    (6, True, 3, {}, 1, r"only 1 node to compute for the stages 1\.\.2 of 3"),
    (6, True, 3, {"n": 6}, 1, r"only 1 node to compute for the stages 1\.\.2 of 3"),
])
def test_inputs_that_run_no_weight_of_a_stage_say_so_in_the_users_terms(count, act, k, example, call, left):
    """Every weight stays in its stage, so a call running only the first layers leaves the last stages
    nothing: said as what the inputs run, not as the splitter's pins (the user pinned nothing), and
    without the guard's advice to pass the argument in the example (the third case does, and fails
    alike); the advice given (an example like the call) works."""
    torch.manual_seed(0)
    model, x = FewerLayers(count, act).eval(), torch.randn(2, 4)
    sharded = autoshard.shard_model(model, k, (x,), example)
    with pytest.raises(InputMismatchError, match=r"These inputs run too few of the model's weights and nodes to give "
                                                 rf"every stage work under the plan's placement: .*leaves {left}\. "
                                                 r"Shard the model again with an example like these inputs") as info:
        sharded(x, n=call)
    message = str(info.value)
    assert "stage_ranges" not in message and "pin" not in message and "passes these arguments" not in message
    assert isinstance(info.value.__cause__, EmptyStageError)
    like_the_call = autoshard.shard_model(model, k, (x,), {"n": call})
    assert torch.equal(like_the_call(x, n=call), model(x, n=call))


class CountsThroughAView(SizeBranch):
    """Counts its calls through a view of the buffer, and samples from a generator of its own."""

    def __init__(self, sampling: bool) -> None:
        super().__init__()
        self.sampling = sampling
        self.register_buffer("calls", torch.zeros(2))
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.sampling:
            x = x + torch.randn(x.shape, generator=self.generator)
        else:
            self.calls[:1].add_(1)
        return super().forward(x + self.calls[0], scale)


@pytest.mark.parametrize("sampling", [False, True])
def test_a_buffer_written_through_a_view_or_a_draw_from_a_generator_of_its_own_is_not_run_again(sampling):
    """Shape propagation sees only the default generators draw, and the write lands on a view of the
    buffer: both were run again, counting the call twice or drawing twice (a helper's probe)."""
    model = CountsThroughAView(sampling).eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    with pytest.raises(SpecializationMismatch, match="update buffers|draw random"):
        sharded(torch.randn(2, 8))


class _BranchesOnADictsLength(nn.Module):
    """Drops out, then branches on the length of its dict's tensor (a decoder's ``q_len > 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.b(self.drop(self.a(batch["x"])))
        if batch["x"].shape[1] > 1:
            h = h.cumsum(1)
        return self.c(h)


def test_a_dict_of_new_sizes_in_training_tries_first_the_plan_that_served_calls_alike():
    """Once the tensors inside a dict told plans apart, a batch of a size no plan had served tried the first
    plan first, whose guard failed after its dropout drew: refused in training mode, though the plan made
    for such calls (sharded.specialize) serves them (adversarial review)."""
    torch.manual_seed(0)
    model = _BranchesOnADictsLength().train()
    sharded = autoshard.shard_model(model, 2, ({"x": torch.randn(2, 4, 8)},))
    sharded.specialize({"x": torch.randn(2, 1, 8)})
    for rows in (2, 3, 5):
        batch = {"x": torch.randn(rows, 1, 8)}
        torch.manual_seed(rows)
        served = sharded(batch)
        torch.manual_seed(rows)
        assert torch.equal(served, model(batch))
    assert len(sharded.specializations) == 1


class EncoderBetweenLinears(nn.Module):
    """An ``nn.TransformerEncoder`` split between its layers in eval mode; called with a padding mask, its
    fast path's code is kept as one piece by a new capture."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(16, 32)
        self.t = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 3)
        self.o = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.o(self.t(self.p(x), src_key_padding_mask=src_key_padding_mask))


def test_a_capture_running_as_one_piece_what_the_plan_split_says_so():
    """It said 'pin 't.layers.0.self_attn.in_proj_weight' holds node 't' in stage 0 but pin ... in stage 1;
    pin them to one stage': pins the user never made."""
    from autoshard.errors import PinConflictError

    torch.manual_seed(0)
    model, x = EncoderBetweenLinears().eval(), torch.randn(2, 6, 16)
    sharded = autoshard.shard_model(model, 3, (x,))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = True
    refusal = r"runs t as one piece .* holds its weights in stages \d and \d"
    with pytest.raises(InputMismatchError, match=refusal) as info:
        sharded(x, src_key_padding_mask=mask)
    assert isinstance(info.value.__cause__, PinConflictError) and "pin them" not in str(info.value)


class NoiseOfItsOwn(nn.Module):
    """Adds noise from a generator of its own (not torch's default ones, which a refused call sets back)."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = torch.Generator().manual_seed(5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.randn(h.shape, generator=self.noise)


def test_in_training_mode_a_guard_failing_after_a_draw_from_a_generator_of_the_models_is_refused():
    """Running the stages again would draw twice from the module's generator, which no rewind sets back (a mutation
    probe: letting it through answered other noise than the model's). Refused, as a buffer update is."""
    torch.manual_seed(0)
    model = NormFirst().train()
    model.norm = NoiseOfItsOwn()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    with pytest.raises(SpecializationMismatch, match=r"draw random numbers are not run again"):
        sharded(torch.randn(2, 8))


class FunctionalBatchNorm(nn.Module):
    """A batch norm written with ``F.batch_norm`` over buffers of its own: traced through, its kernel updates
    the statistics without moving their version counters, so only its name says it writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(h, self.mean, self.var, training=self.training)


def test_in_training_mode_a_guard_failing_after_a_functional_batch_norm_is_refused():
    """Running the stages again would update the statistics twice (a mutation probe, P24: without the name
    of the normalisation the call was run again on a new capture after the first stage had updated them)."""
    torch.manual_seed(0)
    model = NormFirst().train()
    model.norm = FunctionalBatchNorm()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    assert any("batch_norm" in str(node.target) for stage in sharded.stages for node in stage.graph.nodes)
    with pytest.raises(SpecializationMismatch, match=r"update buffers .* are not run again"):
        sharded(torch.randn(2, 8))


class DividesBy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(self.a(x)) / scale


def test_numpy_scalar_arguments_are_served_as_the_values_they_are():
    """A helper probe: an ``np.float64`` example or call (a float to fx, which wrote ``np.float64(2.0)`` into code
    without ``np`` as the argument's default) failed with a NameError; an ``np.float32`` nan was captured again on
    every call (nan != nan) until the limit refused it, and its -0.0 was served by the +0.0 plan (inf for -inf),
    as a Python float's are not."""
    torch.manual_seed(0)
    model, x = DividesBy().eval(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert torch.equal(sharded(x, np.float64(3.0)), model(x, np.float64(3.0)))
    assert torch.equal(autoshard.shard_model(model, 2, (x, np.float64(2.0)))(x), model(x))
    nan = autoshard.shard_model(model, 2, (x, np.float32("nan")))
    for _ in range(3):
        assert torch.isnan(nan(x, np.float32("nan"))).all()
    assert not nan.specializations
    zero = autoshard.shard_model(model, 2, (x, np.float32(0.0)))
    assert torch.equal(zero(x, np.float32(-0.0)), model(x, np.float32(-0.0)))
    assert len(zero.specializations) == 1
