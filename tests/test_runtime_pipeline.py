"""One training step on torch.distributed.pipelining (gloo, 2 and 4 processes) matches the unsplit model:
residual MLPs, a layer shared by every stage, and Hugging Face's GPT-2 with its head tied to the
embedding, its loss computed after the last stage or by the model itself (``labels=``).

Each launch runs several scenarios in the same processes (starting processes is the slow part on a
2-core machine); every test then checks one scenario against the model trained on this process.
The launches have a deadline, and every collective a timeout, so nothing here can hang.
"""

from __future__ import annotations

import resource
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import autoshard
from autoshard.errors import InvalidArgumentError, PipelineSetupError, VerificationError, WorldSizeError
from autoshard.examples import LongSkip, ResidualMLP
from autoshard.runtime import (
    MicrobatchSizeWarning,
    MicrobatchStatisticsWarning,
    TiedGradients,
    build_schedule,
    check_pipeline_step,
    local_stage_indices,
    materialize_stage,
    model_loss,
    pipeline_stage,
    run_local,
)

LAUNCH_DEADLINE_S = 420
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(LAUNCH_DEADLINE_S + 120)]
BATCH, MICROBATCHES = 8, 4


class SharedLayer(nn.Module):
    """One linear applied at every depth: with one application per stage, every stage holds it."""

    def __init__(self, depth: int = 4, width: int = 8) -> None:
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = torch.tanh(self.shared(x)) + x
        return x


def tiny_gpt2() -> nn.Module:
    """Hugging Face's GPT-2, 4 blocks of width 32, random weights; its LM head is tied to
    ``transformer.wte``. No dropout, so the split and unsplit steps see the same numbers."""
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=16, n_embd=32, n_layer=4, n_head=2, bos_token_id=0, eos_token_id=0,
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What GPT2LMHeadModel computes given ``labels``: each position predicts the next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@dataclass(frozen=True)
class Workload:
    """A model, one batch of it, the schedule's ``loss_fn``, and the unsplit model's loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[tuple, dict, torch.Tensor]]  # args, kwargs, target
    loss_fn: Callable[..., torch.Tensor]
    unsplit_loss: Callable[[Any, torch.Tensor], torch.Tensor]  # (model's output, target)


def _vectors(width: int):
    def make(gen: torch.Generator):
        return (torch.randn(BATCH, width, generator=gen),), {}, torch.randn(BATCH, width, generator=gen)
    return make


def _token_ids(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, 8), generator=gen)


def _ids(gen):
    ids = _token_ids(gen)
    return (ids,), {}, ids


def _ids_and_labels(gen):
    """The model gets ``labels`` and computes its loss; the schedule still needs a target."""
    ids = _token_ids(gen)
    return (ids,), {"labels": ids}, ids


WORKLOADS = {
    "residual-mlp": Workload(ResidualMLP, _vectors(16), F.mse_loss, F.mse_loss),
    "long-skip": Workload(LongSkip, _vectors(16), F.mse_loss, F.mse_loss),
    "shared-layer": Workload(SharedLayer, _vectors(8), F.mse_loss, F.mse_loss),
    # the last stage returns the logits; the loss is computed after it, as users write it
    "gpt2": Workload(tiny_gpt2, _ids, next_token_loss, lambda out, ids: next_token_loss(out.logits, ids)),
    # the model computes its loss (labels cross every boundary); its last stage returns (loss, logits)
    "gpt2-labels": Workload(tiny_gpt2, _ids_and_labels, model_loss, lambda out, _: out.loss),
}


def build(name: str) -> tuple[nn.Module, tuple, dict, torch.Tensor]:
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    model = workload.build()
    args, kwargs, target = workload.batch(torch.Generator().manual_seed(7))
    return model, args, kwargs, target


def reference_step(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model's loss and gradients (by every parameter name, tied names included)."""
    model, args, kwargs, target = build(name)
    loss = WORKLOADS[name].unsplit_loss(model(*args, **kwargs), target)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


class TiedGradientsSeen(TiedGradients):
    """``TiedGradients`` keeping each holder's own part of a shared gradient, from before the sum."""

    def sync(self) -> None:
        self.before_sync = {(s, n): self._local[s].get_parameter(n).grad.clone()
                            for shared in self.shared for s, n in shared.holders if s in self._local}
        super().sync()


def pipeline_step(rank: int, world: int, name: str, num_stages: int, schedule: str) -> dict:
    """One step of ``name`` split into ``num_stages`` under ``schedule``, checked against the
    unsplit model (``check_pipeline_step``); what this rank saw."""
    model, args, kwargs, target = build(name)
    sharded = autoshard.shard_model(model, num_stages, example_inputs=args, example_kwargs=kwargs)
    mine = local_stage_indices(num_stages, rank, world)
    stages = [pipeline_stage(sharded, index, num_stages, "cpu") for index in mine]
    runner = build_schedule(stages, schedule, MICROBATCHES, loss_fn=WORKLOADS[name].loss_fn)
    ties = TiedGradientsSeen(sharded, stages)
    check = check_pipeline_step(runner, stages, model, args, kwargs, target=target, loss_fn=WORKLOADS[name].loss_fn,
                                ties=ties, raise_on_mismatch=False)
    return {
        "check": check,
        "before_sync": ties.before_sync,
        "grads": {s.stage_index: {n: p.grad for n, p in s.submod.named_parameters(remove_duplicate=False)}
                  for s in stages},
        "keys": {s.stage_index: sorted(s.submod.state_dict()) for s in stages},
        "the model's own": {s.stage_index: sorted(n for n, p in s.submod.named_parameters()
                                                  if any(p is q for q in model.parameters())) for s in stages},
        "boundaries": sharded.plan.boundaries,
        "receive buffers": {s.stage_index: receive_buffer_bytes(s) for s in stages},
    }


def receive_buffer_bytes(stage) -> int:
    """Bytes of the buffers a ``PipelineStage`` keeps after a step for receiving: the values it
    receives and the gradients of those it sends, every microbatch's."""
    storages = {info.buffer.untyped_storage().data_ptr(): info.buffer.untyped_storage().nbytes()
                for infos in (stage.args_recv_info, stage.grad_recv_info) for received in infos.values()
                for info in received if isinstance(getattr(info, "buffer", None), torch.Tensor)}
    return sum(storages.values())


def setup_errors(rank: int, world: int) -> dict:
    """Misfits of world size, schedule and plan: each must raise here, on every rank, without
    leaving a rank waiting."""
    model, (inputs,), _, _ = build("residual-mlp")
    errors = {}
    four = autoshard.shard_model(model, 4, example_inputs=(inputs,))
    stages = [pipeline_stage(four, i, 4, "cpu") for i in local_stage_indices(4, rank, world)]
    try:
        build_schedule(stages[0], "gpipe", MICROBATCHES)
    except WorldSizeError as exc:
        errors["gpipe with 4 stages"] = str(exc)
    try:  # rank 1 forgets a stage: rank 0, whose call is right, must not wait for it
        build_schedule(stages if rank == 0 else stages[:1], "interleaved-1f1b", MICROBATCHES)
    except InvalidArgumentError as exc:
        errors["a stage left out"] = str(exc)
    three = autoshard.shard_model(model, 3, example_inputs=(inputs,))
    try:
        pipeline_stage(three, rank, 3, "cpu")
    except WorldSizeError as exc:
        errors["3 stages"] = str(exc)
    differs = autoshard.shard_model(ResidualMLP(num_blocks=8 - 2 * rank), 2, example_inputs=(inputs,))
    try:
        build_schedule(pipeline_stage(differs, rank, 2, "cpu"), "gpipe", MICROBATCHES)
    except PipelineSetupError as exc:
        errors["different plans"] = str(exc)
    torch.manual_seed(0)
    normed = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 8)).train()
    sharded = autoshard.shard_model(normed, 2, example_inputs=(torch.randn(4, 8),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_schedule(pipeline_stage(sharded, rank, 2, "cpu"), "gpipe", MICROBATCHES)
    errors["batch norm"] = [str(w.message) for w in caught if w.category is MicrobatchStatisticsWarning]
    errors["batch shapes"] = batch_shape_errors(rank)
    return errors


def batch_shape_errors(rank: int) -> list[str]:
    """Steps with 10 rows (not 4 equal microbatches), 8 rows (fine), then 12 rows (not the first
    step's shape): each rank refuses the bad ones on what it is given, before sending anything. The
    plan was made on the whole batch, so the first stage's rank also warns, once, that the plan's
    predictions count each microbatch of 2 rows as its example's 8."""
    model, (inputs,), _, _ = build("residual-mlp")
    width = inputs.shape[1]
    sharded = autoshard.shard_model(model, 2, example_inputs=(inputs,))
    schedule = build_schedule(pipeline_stage(sharded, rank, 2, "cpu"), "gpipe", MICROBATCHES, loss_fn=F.mse_loss)
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (10, 8, 12):
            batch = torch.randn(rows, width)
            try:
                schedule.step(*((batch,) if rank == 0 else ()), target=batch if rank == 1 else None,
                              return_outputs=False)
                found.append("ran")
            except InvalidArgumentError as exc:
                found.append(str(exc))
    return found + [str(w.message) for w in caught if w.category is MicrobatchSizeWarning]


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def wide_stack() -> nn.Module:
    """8 x 2048^2 float32 weights: 134 MB, 33.5 MB per stage of 4."""
    return nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(8)))


def meta_stage(rank: int, world: int, checkpoints: dict[str, str]) -> dict:
    """Plan on the meta device, load this rank's stage only, run a forward; resident memory before/after."""
    with torch.device("meta"):
        model = wide_stack()
    sharded = autoshard.shard_model(model, world)
    before = current_rss()
    source = checkpoints["full"] if rank < 2 else checkpoints[f"stage{rank}"]
    sharded = materialize_stage(sharded, rank, source)
    stage = pipeline_stage(sharded, rank, world, "cpu")
    schedule = build_schedule(stage, "gpipe", 2)
    with torch.no_grad():
        out = schedule.step(torch.ones(4, 2048)) if rank == 0 else schedule.step()
    return {
        "growth": current_rss() - before,
        "stage_bytes": sum(t.nbytes for t in stage.submod.state_dict().values()),
        "output": out,
        "meta_left": model[0].weight.is_meta,
    }


def scaled_gradient(rank: int, world: int) -> dict:
    """A step whose last stage doubles one weight's gradient (a hook): the check must catch it."""
    model, args, kwargs, target = build("residual-mlp")
    stage = pipeline_stage(autoshard.shard_model(model, 2, example_inputs=args), rank, 2, "cpu")
    runner = build_schedule(stage, "gpipe", MICROBATCHES, loss_fn=F.mse_loss)
    doubled = next(name for name, _ in stage.submod.named_parameters())
    if rank == 1:
        stage.submod.get_parameter(doubled).register_hook(lambda grad: grad * 2)
    try:
        check_pipeline_step(runner, stage, model, args, kwargs, target=target, loss_fn=F.mse_loss)
    except VerificationError as exc:
        return {"doubled": doubled, "message": str(exc), "check": exc.check}
    return {"doubled": doubled, "message": None}


def nan_loss(rank: int, world: int) -> str | None:
    """A loss that is nan on the batch: every rank refuses the check, before any collective."""
    model, args, kwargs, target = build("residual-mlp")
    stage = pipeline_stage(autoshard.shard_model(model, 2, example_inputs=args), rank, 2, "cpu")
    runner = build_schedule(stage, "gpipe", MICROBATCHES, loss_fn=F.mse_loss)
    try:
        check_pipeline_step(runner, stage, model, args, kwargs, target=torch.full_like(target, float("nan")),
                            loss_fn=F.mse_loss)
    except InvalidArgumentError as exc:
        return str(exc)
    return None


def untied_step(rank: int, world: int) -> str | None:
    """GPT-2's head and embedding (one weight under two names) on two ranks, checked without
    ``ties``: the check refuses and says to pass them."""
    model, args, kwargs, target = build("gpt2")
    stage = pipeline_stage(autoshard.shard_model(model, 2, example_inputs=args), rank, 2, "cpu")
    runner = build_schedule(stage, "gpipe", MICROBATCHES, loss_fn=next_token_loss)
    try:
        check_pipeline_step(runner, stage, model, args, kwargs, target=target, loss_fn=next_token_loss)
    except VerificationError as exc:
        return str(exc)
    return None


class WeightViewSent(nn.Module):
    """Stage 0 sends weights without a copy (``how``: a transpose of ``w``, a view of it, ``w`` and
    ``v`` stacked), which stage 1 reads: autograd hands the weights slices of the gradient received."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.first, self.last = how, nn.Linear(8, 8), nn.Linear(8, 8)
        self.w, self.v = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
        self.product = Product()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = {"t": self.w.t, "view": lambda: self.w.view(8, 8), "stack": lambda: torch.stack([self.w, self.v])}
        return self.last(self.product(torch.tanh(self.first(x)), w[self.how]()))


class Product(nn.Module):
    def forward(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h @ w[0] + h @ w[1] if w.dim() == 3 else h @ w


class ReturnsAWeight(nn.Module):
    """Returns its weight ``scale`` beside its prediction; the loss uses both."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x), self.scale


def scaled_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    prediction, scale = output
    return F.mse_loss(prediction * scale, target)


KEPT_GRADIENTS = {  # how -> (model, loss_fn, schedule, zero_grad(set_to_none=False) before each step, options)
    "t": (lambda: WeightViewSent("t"), F.mse_loss, "1f1b", True, {}),
    "view": (lambda: WeightViewSent("view"), F.mse_loss, "1f1b", True, {}),
    "stack": (lambda: WeightViewSent("stack"), F.mse_loss, "1f1b", True, {}),
    "accumulated": (lambda: WeightViewSent("t"), F.mse_loss, "gpipe", False, {}),
    "returned weight": (ReturnsAWeight, scaled_loss, "1f1b", True, {}),
    # PyTorch's own mean over microbatches, asked for: the loss's gradient is left as it is
    "scale_grads": (lambda: WeightViewSent("t"), F.mse_loss, "1f1b", True, {"scale_grads": True}),
}


def kept_gradients_model(how: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return KEPT_GRADIENTS[how][0](), torch.randn(BATCH, 8), torch.randn(BATCH, 8)


def kept_gradients(rank: int, world: int) -> dict:
    """Two steps keeping the gradients between them (zeroed in place, or accumulated over both) of
    plans whose stage 0 sends weights without a copy, and of a model returning a weight: each rank's
    gradients after the second step."""
    found = {}
    for how, (_, loss_fn, schedule_name, zeroed, options) in KEPT_GRADIENTS.items():
        model, x, y = kept_gradients_model(how)
        pins = None if how == "returned weight" else {"w": 0, "first": 0, "product": 1}
        if how == "stack":
            pins["v"] = 0
        sharded = autoshard.shard_model(model, 2, example_inputs=(x,), pin=pins)
        stage = pipeline_stage(sharded, rank, 2, "cpu")
        schedule = build_schedule(stage, schedule_name, MICROBATCHES, loss_fn=loss_fn, **options)
        for _ in range(2):
            if zeroed:
                stage.submod.zero_grad(set_to_none=False)
            schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, return_outputs=False)
        found[how] = {"sent": sharded.plan.boundaries[0], "model's weights trainable": all(
                          p.requires_grad for p in model.parameters()),
                      "grads": {n: p.grad.clone() for n, p in stage.submod.named_parameters()}}
    return found


def two_process_worker(rank: int, world: int, scenarios: list[tuple]) -> dict:
    results = {"errors": setup_errors(rank, world), "scaled": scaled_gradient(rank, world),
               "untied": untied_step(rank, world), "nan": nan_loss(rank, world),
               "kept gradients": kept_gradients(rank, world)}
    for scenario in scenarios:
        results[scenario] = pipeline_step(rank, world, *scenario)
    return results


def four_process_worker(rank: int, world: int, scenarios: list[tuple], checkpoints: dict[str, str]) -> dict:
    results = {"meta": meta_stage(rank, world, checkpoints)}  # first: memory measured in a fresh process
    for scenario in scenarios:
        results[scenario] = pipeline_step(rank, world, *scenario)
    return results


TWO_PROCESS = [
    ("residual-mlp", 2, "gpipe"),
    ("residual-mlp", 2, "1f1b"),
    ("gpt2", 2, "gpipe"),
    ("gpt2-labels", 2, "1f1b"),
    ("gpt2-labels", 4, "interleaved-1f1b"),
    ("long-skip", 4, "looped-bfs"),
    ("shared-layer", 4, "interleaved-1f1b"),
    # the backward of the inputs apart from the weights': PyTorch ``detach_()``-es every value sent, which
    # raised for GPT-2's (a view, heads merged) until stages sent tensors of their own (``wire.own_tensor``)
    ("gpt2", 4, "interleaved-zero-bubble"),
]
FOUR_PROCESS = [
    ("residual-mlp", 4, "1f1b"),
    ("gpt2", 4, "gpipe"),
    ("gpt2-labels", 4, "1f1b"),
]


@pytest.fixture(scope="module")
def two_processes():
    return run_local(two_process_worker, 2, args=(TWO_PROCESS,), timeout=LAUNCH_DEADLINE_S)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    model = wide_stack()
    paths = {"full": str(directory / "model.pt")}
    torch.save(model.state_dict(), paths["full"])
    sharded = autoshard.shard_model(model, 4)
    for index in (2, 3):
        paths[f"stage{index}"] = str(directory / f"stage{index}.pt")
        torch.save(sharded.stages[index].state_dict(), paths[f"stage{index}"])
    with torch.no_grad():
        expected = model(torch.ones(4, 2048))
    return paths, expected, sum(t.nbytes for t in model.state_dict().values())


@pytest.fixture(scope="module")
def four_processes(checkpoints):
    paths, _, _ = checkpoints
    return run_local(four_process_worker, 4, args=(FOUR_PROCESS, paths), timeout=LAUNCH_DEADLINE_S)


def check_step(results: list[dict], scenario: tuple) -> list[dict]:
    """The loss and every gradient of every stage equal the unsplit model's: ``check_pipeline_step``
    compared them on every rank, which all reached the same verdict."""
    name = scenario[0]
    seen = [r[scenario] for r in results]
    check = seen[0]["check"]
    assert all(r["check"] == check for r in seen)
    assert check.ok, str(check)
    expected_loss, expected_grads = reference_step(name)
    assert {g.name for g in check.gradients} == set(expected_grads)
    assert check.expected_loss == pytest.approx(expected_loss.item())  # the workers ran the model as this process
    return seen


def carried_past_a_stage(boundaries) -> set[str]:
    """Values that cross at least two consecutive boundaries: skips over a whole stage."""
    return {v for here, there in zip(boundaries, boundaries[1:]) for v in set(here) & set(there)}


@pytest.mark.parametrize("scenario", TWO_PROCESS, ids=lambda s: "-".join(map(str, s)))
def test_two_processes_train_like_the_unsplit_model(two_processes, scenario):
    seen = check_step(two_processes, scenario)
    model = build(scenario[0])[0]
    keys = [k for r in seen for ks in r["keys"].values() for k in ks]
    assert set(keys) == set(model.state_dict())  # the runtime's stages keep the model's names


@pytest.mark.parametrize("scenario", TWO_PROCESS + FOUR_PROCESS, ids=lambda s: "-".join(map(str, s)))
def test_the_memory_model_counts_the_receive_buffers_the_runtime_keeps(two_processes, four_processes, scenario):
    """``PipelineStage`` keeps a buffer for every microbatch's received values and sent values'
    gradients; the memory model's ``buffer_bytes`` (for the plan's example, the whole batch: each
    microbatch is a quarter of it) is what each stage holds, but for the first stage's batch, which
    the caller hands ``schedule.step`` (counted there too, as the caller's tensors)."""
    model, args, kwargs, _ = build(scenario[0])
    sharded = autoshard.shard_model(model, scenario[1], example_inputs=args, example_kwargs=kwargs)
    predicted = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=MICROBATCHES)).stages
    results = two_processes if scenario in TWO_PROCESS else four_processes
    held = {j: nbytes for rank in results for j, nbytes in rank[scenario]["receive buffers"].items()}
    batch = predicted[0].memory.received_bytes * MICROBATCHES
    assert held == {j: (stage.memory.buffer_bytes - (batch if j == 0 else 0)) / MICROBATCHES
                    for j, stage in enumerate(predicted)}
    assert all(held[j] > 0 for j in held)


@pytest.mark.parametrize("scenario", FOUR_PROCESS, ids=lambda s: "-".join(map(str, s)))
def test_four_processes_train_like_the_unsplit_model(four_processes, scenario):
    check_step(four_processes, scenario)


def test_skip_connections_cross_non_adjacent_stages(two_processes, four_processes):
    for results, scenario in ((two_processes, ("gpt2-labels", 4, "interleaved-1f1b")),
                              (two_processes, ("long-skip", 4, "looped-bfs")),
                              (four_processes, ("gpt2", 4, "gpipe")),
                              (four_processes, ("gpt2-labels", 4, "1f1b"))):
        assert carried_past_a_stage(results[0][scenario]["boundaries"]), scenario


def test_a_width_read_alone_crosses_ranks_as_a_zero_byte_carrier(two_processes, four_processes):
    """GPT-2 reads its embedding's width to reshape the last output: a carrier of no elements crosses
    every boundary instead of the embedding (``lowering.shape_carriers``), sent and received by gloo in
    steps that match the unsplit model's (``test_..._train_like_the_unsplit_model``)."""
    for results, scenario in ((two_processes, ("gpt2", 2, "gpipe")), (four_processes, ("gpt2", 4, "gpipe"))):
        for boundary in results[0][scenario]["boundaries"]:
            assert "transformer_drop_shape" in boundary and "transformer_drop" not in boundary, scenario


def test_labels_for_a_loss_the_model_computes_cross_every_boundary(two_processes, four_processes):
    """Integer labels reach the last stage as a boundary value (their shape inference must not
    index with uninitialised memory), and its loss is the model's; with two stages per rank the
    later one ignores the ``labels=`` keyword the schedule hands it too."""
    for results, scenario in ((two_processes, ("gpt2-labels", 2, "1f1b")),
                              (two_processes, ("gpt2-labels", 4, "interleaved-1f1b")),
                              (four_processes, ("gpt2-labels", 4, "1f1b"))):
        assert all("labels" in boundary for boundary in results[0][scenario]["boundaries"]), scenario


@pytest.mark.parametrize("results, scenario", [
    ("two_processes", ("gpt2", 2, "gpipe")),
    ("two_processes", ("gpt2-labels", 4, "interleaved-1f1b")),
    ("four_processes", ("gpt2", 4, "gpipe")),
], ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_tied_head_and_embedding_on_different_ranks_get_the_summed_gradient(request, results, scenario):
    """GPT-2's head reuses ``transformer.wte.weight``: stage 0 holds the embedding, the last stage
    the head, on different ranks; each computes only its part, ``TiedGradients`` sums them."""
    seen = [r[scenario] for r in request.getfixturevalue(results)]
    last_stage = scenario[1] - 1
    embedding_rank, head_rank = seen[0], seen[last_stage % len(seen)]
    assert embedding_rank is not head_rank
    assert "transformer.wte.weight" in embedding_rank["grads"][0]
    assert "lm_head.weight" not in embedding_rank["grads"][0]
    assert "lm_head.weight" in head_rank["grads"][last_stage]
    assert "transformer.wte.weight" not in head_rank["grads"][last_stage]
    _, expected = reference_step(scenario[0])
    embedding_part = embedding_rank["before_sync"][0, "transformer.wte.weight"]
    head_part = head_rank["before_sync"][last_stage, "lm_head.weight"]
    assert not torch.allclose(embedding_part, expected["lm_head.weight"])  # neither part is enough
    assert not torch.allclose(head_part, expected["lm_head.weight"])
    torch.testing.assert_close(embedding_part + head_part, expected["lm_head.weight"])
    torch.testing.assert_close(embedding_rank["grads"][0]["transformer.wte.weight"],
                               head_rank["grads"][last_stage]["lm_head.weight"])


def test_a_weight_every_stage_holds_is_summed_over_local_and_remote_stages(two_processes):
    scenario = ("shared-layer", 4, "interleaved-1f1b")
    holders = [stage for r in two_processes for stage, grads in r[scenario]["grads"].items()
               if "shared.weight" in grads]
    assert sorted(holders) == [0, 1, 2, 3]
    # the first stage of a rank holds the model's own weight, the other a copy (trained alike, by the sum)
    assert [r[scenario]["the model's own"] for r in two_processes] == [
        {0: ["shared.bias", "shared.weight"], 2: []}, {1: ["shared.bias", "shared.weight"], 3: []}]


@pytest.mark.parametrize("how", list(KEPT_GRADIENTS))
def test_gradients_kept_between_steps_are_the_unsplit_models(two_processes, how):
    """Autograd kept slices of the buffer a ``PipelineStage`` receives gradients into every step as the
    gradients of the weights a stage sent without a copy (a transpose, a view, a stack): the second
    step's gradient, received into it, was off (0.05-0.09 here) where steps keep gradients
    (``zero_grad(set_to_none=False)``). PyTorch's schedules divided the gradients accumulated over earlier
    steps by the microbatch count at each step's end (``scale_grads``). And a weight the model returns,
    the last stage's output, was detached in place by PyTorch after the first microbatch's backward,
    the user's model's own weight too."""
    model, x, y = kept_gradients_model(how)
    loss_fn = KEPT_GRADIENTS[how][1]
    for _ in range(2):
        if KEPT_GRADIENTS[how][3]:
            model.zero_grad(set_to_none=False)
        sum(loss_fn(model(xs), ys) for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))).div(
            MICROBATCHES).backward()
    found = {}
    for rank in two_processes:
        seen = rank["kept gradients"][how]
        assert seen["model's weights trainable"]
        sent = {"accumulated": "t", "scale_grads": "t"}.get(how, how)
        assert isinstance(model, ReturnsAWeight) or sent in seen["sent"]
        found.update(seen["grads"])
    trained = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}  # (not ``v`` but stacked)
    assert found.keys() == trained.keys()
    for name, grad in trained.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_check_pipeline_step_refuses_a_batch_whose_loss_is_nan_on_every_rank(two_processes):
    assert [r["nan"] for r in two_processes] == [
        "the unsplit model's loss is nan on this batch, so there is nothing to compare the step with; check with a "
        "batch whose loss is finite"] * 2


def test_check_pipeline_step_catches_a_stage_whose_gradient_is_scaled(two_processes):
    """Every rank raises alike, naming the one weight whose gradient is off and by how much; the
    other gradients and the loss (which the hook does not touch) still agree."""
    doubled = two_processes[1]["scaled"]["doubled"]
    for rank_result in two_processes:
        scaled = rank_result["scaled"]
        assert scaled["message"] is not None, "the doubled gradient went unnoticed"
        check = scaled["check"]
        assert [(g.name, g.stages) for g in check.failing] == [(doubled, (1,))]
        assert check.loss_ok and check.failing[0].max_rel > 0.9  # twice the gradient: about 100% off
        assert f"{doubled} (stage 1): max abs difference" in scaled["message"]


def test_check_pipeline_step_says_to_sum_a_tied_weight_held_under_two_names(two_processes):
    for rank_result in two_processes:
        assert rank_result["untied"] is not None, "an unsummed tied gradient went unnoticed"
        assert "pass ties=TiedGradients(sharded, stages)" in rank_result["untied"]


def test_world_size_misfits_fail_on_every_rank_before_blocking(two_processes):
    for rank_result in two_processes:
        errors = rank_result["errors"]
        assert "--nproc-per-node 4" in errors["gpipe with 4 stages"]
        assert "3 stages cannot be spread evenly over 2 processes" in errors["3 stages"]
        assert "the processes split the model differently" in errors["different plans"]
        assert "rank 1 runs stages [1, 3] but was given [1]" in errors["a stage left out"]
    warned = [message for r in two_processes for message in r["errors"]["batch norm"]]
    assert len(warned) == 1 and ": 1)" in warned[0] and f"{MICROBATCHES} microbatches" in warned[0]
    for rank, rank_result in enumerate(two_processes):
        uneven, fine, changed, *warned = rank_result["errors"]["batch shapes"]
        given = "x" if rank == 0 else "target"
        assert len(warned) == (1 if rank == 0 else 0)  # the first stage's rank knows the example
        assert all(f"an example of {BATCH} rows and this step's microbatches have {BATCH // MICROBATCHES}" in w
                   and f"{MICROBATCHES}x these rows" in w for w in warned)
        assert f"{given} has 10 rows, which does not split into {MICROBATCHES} equal microbatches" in uneven
        assert fine == "ran"
        assert f"differ in shape from the first step's: {given} [12, 16] (first step: [8, 16])" in changed
    assert all(("residual-mlp", 2, "gpipe") in r for r in two_processes)  # and the ranks carried on


def test_a_rank_builds_its_stage_from_a_meta_model_with_memory_tracking_its_stage(
        four_processes, checkpoints):
    _, expected, model_bytes = checkpoints
    for rank_result in four_processes:
        meta = rank_result["meta"]
        assert meta["meta_left"]  # the user's meta model was not materialised
        assert meta["stage_bytes"] == model_bytes // 4
        assert 0.7 * meta["stage_bytes"] < meta["growth"] < meta["stage_bytes"] + model_bytes / 4
    torch.testing.assert_close(four_processes[3]["meta"]["output"], expected)


def normed_model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                          nn.BatchNorm1d(8), nn.Linear(8, 8)).train()
    return model, torch.randn(8, 8, generator=gen) + 3, torch.randn(8, 8, generator=gen)


def batch_norm_statistics_after_steps(rank: int, world: int, steps: int) -> dict[str, torch.Tensor]:
    model, x, y = normed_model_and_batch()
    stage = pipeline_stage(autoshard.shard_model(model, 2, example_inputs=(x,)), rank, 2, "cpu")
    schedule = build_schedule(stage, "gpipe", 1, loss_fn=F.mse_loss)
    for _ in range(steps):
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, return_outputs=False)
    return {name: value.clone() for name, value in stage.submod.state_dict().items()
            if "running" in name or "num_batches" in name}


def test_shape_inference_before_the_first_step_leaves_batch_norm_statistics_alone():
    """PyTorch runs each stage once before the first step to learn the shapes; in training mode
    a batch norm counted that run in its running statistics (on zeros, in later stages)."""
    model, x, y = normed_model_and_batch()
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    expected = {name: value for name, value in model.state_dict().items() if "running" in name or "num_batches" in name}
    found = {}
    for state in run_local(batch_norm_statistics_after_steps, 2, args=(2,), timeout=LAUNCH_DEADLINE_S):
        found.update(state)
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.allclose(found[name], value, rtol=0, atol=1e-6), name
