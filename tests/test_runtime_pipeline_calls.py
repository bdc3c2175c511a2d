"""How a pipeline step takes its inputs and its loss, and what every rank must agree on: one launch
of two processes (gloo), whose scenarios the tests then check."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import FillsInItsProblemType, Masked, StackedLSTMs
from torch import nn

import autoshard
from autoshard.errors import NO_SPECIALISATIONS, InputMismatchError, PipelineSetupError, SpecializationMismatch
from autoshard.runtime import TiedGradients, build_schedule, check_pipeline_step, model_loss, pipeline_stage, run_local

LAUNCH_DEADLINE_S = 300
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(LAUNCH_DEADLINE_S + 60)]


class LossAfterPrediction(nn.Module):
    """Returns its loss second, as a dict: ``{"pred": ..., "loss": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.second(torch.tanh(self.first(x)))
        return {"pred": pred, "loss": F.mse_loss(pred, y)}


class BranchOnBatch(nn.Module):
    """Takes another path for batches of more than two rows: a branch the capture fixes."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if x.shape[0] > 2:
            h = h * 2
        return self.second(h)


def branching() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return BranchOnBatch().eval(), torch.randn(4, 8)


def masked_inputs() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Masked().eval(), torch.randn(4, 8), torch.randn(4, 8), torch.rand(4, 8).round()


def regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return LossAfterPrediction(), torch.randn(4, 8), torch.randn(4, 1)


def scenarios(rank: int, world: int) -> dict[str, object]:
    found: dict[str, object] = {}
    model, x, b, mask = masked_inputs()
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), example_kwargs={"bias": b})
    group = dist.new_group([0, 1])
    stage = pipeline_stage(sharded, rank, 2, "cpu", group=group)
    found["ties group is the stages'"] = TiedGradients(sharded, [stage]).group is group
    schedule = build_schedule(stage, "gpipe", 2)
    with torch.no_grad():
        found["by name"] = schedule.step(*((x,) if rank == 0 else ()), **({"bias": b} if rank == 0 else {}))
    if rank == 0:  # refused before anything is sent; rank 1 would wait for it, so it does not step
        try:
            schedule.step(x, mask)
        except InputMismatchError as exc:
            found["by position"] = str(exc)
        try:  # the example passed bias; a call would capture again without it, a step cannot
            schedule.step(x)
        except SpecializationMismatch as exc:
            found["left out"] = str(exc)

    model, x, y = regression()
    stage = pipeline_stage(autoshard.shard_model(model, 2, example_inputs=(x, y)), rank, 2, "cpu")
    schedule = build_schedule(stage, "gpipe", 4, loss_fn=model_loss)
    losses: list[torch.Tensor] = []
    schedule.step(*((x, y) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses,
                  return_outputs=False)
    found["losses"] = [float(loss) for loss in losses]

    model, x = lstms()
    cut = "capture,shape-prop,build-dag,linearize,split{stages=2 cut-before=second},emit,verify"
    stage = pipeline_stage(autoshard.shard_model(model, 2, example_inputs=(x,), pipeline=cut), rank, 2, "cpu")
    schedule = build_schedule(stage, "gpipe", 2, loss_fn=lambda out, target: out.square().sum())
    schedule.step(*((x,) if rank == 0 else ()), target=x if rank == 1 else None)
    found["lstm gradients"] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    model, x = branching()  # planned at batch 4, stepped in microbatches of 2: the branch flips
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), cut_before=["second"])  # sends h * 2, then h
    stage = pipeline_stage(sharded, rank, 2, "cpu", microbatch=(x[:2],))
    found["boundaries"] = [sharded.plan.boundaries, *(s.sharded.plan.boundaries for s in sharded.specializations)]
    found["microbatch plan keys"] = sorted(stage.submod.state_dict())
    found["primary plan keys"] = sorted(sharded.stages[rank].state_dict())
    with torch.no_grad():
        found["microbatch step"] = build_schedule(stage, "gpipe", 2).step(*((x,) if rank == 0 else ()))
    try:  # rank 1 alone is given a microbatch the model refuses: both ranks refuse, neither waits
        pipeline_stage(sharded, rank, 2, "cpu", microbatch=(x[:2] if rank == 0 else x[:2, :5],))
    except PipelineSetupError as exc:
        found["microbatch refused"] = str(exc)
    try:  # stages that make no specialisations cannot choose one
        pipeline_stage(autoshard.shard_model(model, 2, example_inputs=(x,), respecialize=False), rank, 2, "cpu",
                       microbatch=(x[:2],))
    except PipelineSetupError as exc:
        found["no specialisations"] = str(exc)
    copied = copy.deepcopy(sharded)  # as materialize_stage copies: no specializer
    found["copy, the example's microbatch"] = pipeline_stage(copied, rank, 2, "cpu", microbatch=(x,)) is not None
    try:
        pipeline_stage(copied, rank, 2, "cpu", microbatch=(x[:2],))
    except PipelineSetupError as exc:
        found["copy, another microbatch"] = str(exc)
    advised = pipeline_stage(copy.deepcopy(sharded.specialize(x[:2])), rank, 2, "cpu", microbatch=(x[:2],))
    with torch.no_grad():  # as the refusal says: specialize before copying
        step = build_schedule(advised, "gpipe", 2).step(*((x,) if rank == 0 else ()))
    found["copy of the specialisation, step"] = step

    model, x, y = regression()  # switched to eval mode after sharding, before the stage is built
    sharded = autoshard.shard_model(model, 2, example_inputs=(x, y))
    model.eval()
    try:
        pipeline_stage(sharded, rank, 2, "cpu")
    except PipelineSetupError as exc:
        found["built after eval"] = str(exc)
    built = pipeline_stage(sharded, rank, 2, "cpu", microbatch=(x[:2], y[:2]))
    found["built after eval, for a microbatch"] = built is not None

    try:
        build_schedule(stage, "gpipe", 4 if rank == 0 else 2, loss_fn=model_loss)
    except PipelineSetupError as exc:
        found["microbatches differ"] = str(exc)
    return found


def lstms() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return StackedLSTMs(), torch.randn(4, 5, 4)


@pytest.fixture(scope="module")
def launched() -> list[dict[str, object]]:
    return run_local(scenarios, 2, timeout=LAUNCH_DEADLINE_S)


def test_step_binds_inputs_as_the_model_does(launched):
    """Positional inputs reached the first stage's parameters, the example's: step(x, mask)
    computed model(x, bias=mask)."""
    model, x, b, mask = masked_inputs()
    with torch.no_grad():
        assert torch.equal(launched[1]["by name"], model(x, bias=b))
    assert "the example left mask=None at the default" in launched[0]["by position"]


def test_a_step_leaving_out_an_argument_the_example_passed_says_to_build_the_stages_for_it(launched):
    """``sharded(x)`` captures the model again without ``bias``; a step runs the stages it was built
    with, so its refusal names ``pipeline_stage(..., microbatch=...)``, which serves such calls."""
    refusal = launched[0]["left out"]
    assert "the example passed 'bias', which these inputs leave out" in refusal
    assert "microbatch=one microbatch's inputs" in refusal


def test_model_loss_back_propagates_the_loss_entry_not_the_predictions(launched):
    model, x, y = regression()
    expected = [model(x[i:i + 1], y[i:i + 1])["loss"].item() for i in range(4)]
    assert launched[1]["losses"] == pytest.approx(expected, rel=1e-6)


def test_tied_gradients_sum_over_the_stages_group_by_default(launched):
    assert all(rank["ties group is the stages'"] for rank in launched)


def test_ranks_that_disagree_on_the_microbatches_fail_alike_instead_of_waiting(launched):
    for rank in launched:
        assert ("rank 0: schedule 'gpipe' over 4 microbatches, rank 1: schedule 'gpipe' over 2 microbatches"
                in rank["microbatches differ"])


def test_an_lstm_state_used_whole_by_the_next_stage_trains_like_the_model(launched):
    """The first LSTM's ``(h, c)`` crosses as its two tensors and is built again for the second."""
    model, x = lstms()
    (model(x).square().sum() / 2).backward()  # the schedule averages its 2 microbatches' gradients
    got = {**launched[0]["lstm gradients"], **launched[1]["lstm gradients"]}
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6)


def test_a_microbatch_whose_branch_flips_gets_a_plan_of_its_own_on_every_rank(launched):
    """Planned at batch 4, stepped in microbatches of 2: each rank built the specialisation for the
    microbatch, holding the same weights as the plan's stage, and the step computed the model's
    smaller-batch branch."""
    model, x = branching()
    with torch.no_grad():
        expected = torch.cat([model(x[:2]), model(x[2:])])
    assert torch.equal(launched[1]["microbatch step"], expected)
    for rank in launched:
        assert rank["microbatch plan keys"] == rank["primary plan keys"]
        first, specialised = rank["boundaries"]  # one specialisation, made by pipeline_stage
        assert first != specialised  # the stages are wired with the values the chosen plan sends


def test_a_microbatch_one_rank_cannot_run_is_refused_on_every_rank(launched):
    for rank in launched:
        assert "no plan serves the microbatch on every rank (rank 1:" in rank["microbatch refused"]
        assert "rank 0:" not in rank["microbatch refused"]
        assert "rank 0: these stages make no specialisations" in rank["no specialisations"]


def test_a_copy_of_the_stages_serves_its_examples_microbatch_and_says_how_to_serve_another(launched):
    """A copy (deepcopy, materialize_stage) makes no specialisations: it is built for a microbatch of
    its example's shapes, which its own plan serves, and refuses another, saying to specialise the sharded
    model before copying it (what works: the copy of that specialisation steps as the model computes),
    not to shard with respecialize=True (the copy's origin was) nor to call the copy."""
    model, x = branching()
    with torch.no_grad():
        expected = torch.cat([model(x[:2]), model(x[2:])])
    assert torch.equal(launched[1]["copy of the specialisation, step"], expected)
    for rank in launched:
        assert rank["copy, the example's microbatch"]
        refusal = rank["copy, another microbatch"]
        assert NO_SPECIALISATIONS in refusal
        assert ("on the sharded model shard_model (or load_plan) returned, call sharded.specialize(*microbatch) "
                "before copying or materialising it") in refusal
        assert "with stages made by shard_model(..., respecialize=True)" not in refusal


def test_a_stage_built_for_a_model_changed_since_sharding_is_refused_on_every_rank_at_the_build(launched):
    """Without microbatch= the stage runs the plan itself, which the model in another mode no longer
    serves: refused when built, on every rank (at the first step rank 0 alone raised, and its peer died
    with "Connection closed by peer"), naming the change and what serves it, which builds."""
    for rank in launched:
        refusal = rank["built after eval"]
        assert refusal.startswith("the model changed after it was sharded, and this stage's plan no longer serves "
                                  "it: some of the modules the stage calls were switched to another mode")
        assert "build the stage with pipeline_stage(..., microbatch=one microbatch's inputs)" in refusal
        assert rank["built after eval, for a microbatch"]


def _step_flipping_a_branch(rank: int, world: int) -> str:
    """Both stages on this one rank, planned at batch 4 and stepped in microbatches of 2, which flip
    the model's branch: the step's refusal."""
    model, x = branching()
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), cut_before=["second"])
    schedule = build_schedule([pipeline_stage(sharded, j, 2, "cpu") for j in (0, 1)], "interleaved-1f1b", 2)
    try:
        with torch.no_grad():
            schedule.step(x)
    except SpecializationMismatch as exc:
        return str(exc)
    return "not refused"


def test_a_step_whose_microbatches_flip_a_guard_says_to_build_the_stages_for_them():
    """A call captures the model again for such inputs; a step cannot, half-way, so the refusal
    names what serves them: ``pipeline_stage(..., microbatch=...)``."""
    [refusal] = run_local(_step_flipping_a_branch, 1, timeout=LAUNCH_DEADLINE_S)
    assert "x.shape[0] > 2" in refusal and "microbatch=one microbatch's inputs" in refusal


def _step_filling_in_a_setting(rank: int, world: int) -> tuple[bool, object, int]:
    """Both stages on this one rank, two microbatches of the example's size: the check of the step."""
    torch.manual_seed(0)
    model, x, labels = FillsInItsProblemType(), torch.randn(4, 8), torch.tensor([0, 2, 1, 0])
    sharded = autoshard.shard_model(model, 2, example_inputs=(x[:2], labels[:2]))
    stages = [pipeline_stage(sharded, j, 2, "cpu") for j in (0, 1)]
    schedule = build_schedule(stages, "interleaved-1f1b", 2, loss_fn=model_loss)
    check = check_pipeline_step(schedule, stages, model, (x, labels), target=labels, loss_fn=model_loss)
    return check.ok, model.config.problem_type, len(sharded.specializations)


def _step_with_the_models_loss(rank: int, world: int) -> list[float]:
    """Both stages on this one rank, a step with ``model_loss`` not told ``return_outputs``."""
    torch.manual_seed(0)
    model, x, labels = FillsInItsProblemType(), torch.randn(4, 8), torch.tensor([0, 2, 1, 0])
    model.config.problem_type = "single"
    sharded = autoshard.shard_model(model, 2, example_inputs=(x[:2], labels[:2]))
    stages = [pipeline_stage(sharded, j, 2, "cpu") for j in (0, 1)]
    losses: list[torch.Tensor] = []
    build_schedule(stages, "interleaved-1f1b", 2, loss_fn=model_loss).step(x, labels, target=labels, losses=losses)
    halves = (slice(0, 2), slice(2, 4))
    return [float(loss) for loss in losses] + [float(model(x[rows], labels[rows])) for rows in halves]


def test_a_step_with_the_models_loss_does_not_merge_the_losses_unless_asked():
    """The model's loss is one number per microbatch: merging the outputs (PyTorch's default) failed on the
    last rank after every microbatch ran (zero-dimensional tensors cannot be concatenated), unless the
    step was told return_outputs=False (a new user's DistilBERT script)."""
    [found] = run_local(_step_with_the_models_loss, 1, timeout=LAUNCH_DEADLINE_S)
    assert found[:2] == found[2:]


def test_a_setting_the_first_call_fills_in_trains_through_a_pipeline_as_the_model():
    """Hugging Face's classifiers set ``config.problem_type`` on their first call with labels: the plan
    captured with it unset wrote it on the first microbatch and its check refused the second
    (DistilBERT's first training step failed). The stages are now those of the plan made for the
    model as its first call leaves it: loss and gradients are the model's."""
    [(ok, problem_type, made)] = run_local(_step_filling_in_a_setting, 1, timeout=LAUNCH_DEADLINE_S)
    assert ok and problem_type == "single" and made == 1
