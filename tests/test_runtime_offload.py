"""The offload runner computes what the model computes, in inference and training, holding one
stage's weights on the compute device at a time."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Masked
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autoshard
from autoshard.emit import stage_device
from autoshard.errors import DeviceUnavailableError, InputMismatchError, InvalidArgumentTypeError
from autoshard.examples import GPTStyleLM, GPTStyleLMWithLoss, LongSkip, ResidualMLP, TransformerLM
from autoshard.examples.models import causal_mask
from autoshard.runtime import OffloadRunner


class NormedMLP(nn.Module):
    """BatchNorm between linears: training updates buffers the runner must write back."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def models():
    torch.manual_seed(0)
    return [
        pytest.param(ResidualMLP(), (torch.randn(4, 16),), id="residual-mlp"),
        pytest.param(LongSkip(), (torch.randn(4, 16),), id="long-skip"),
        pytest.param(GPTStyleLM(), (torch.randint(0, 100, (2, 8)),), id="gpt-lm"),
        pytest.param(TransformerLM(), (torch.randint(0, 100, (12, 3)), causal_mask(12)), id="transformer-lm"),
    ]


@pytest.mark.parametrize("model, args", models())
def test_inference_matches_the_model(model, args):
    model.eval()
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    with torch.no_grad():
        torch.testing.assert_close(OffloadRunner(sharded, "cpu")(*args), model(*args), rtol=0, atol=0)


@pytest.mark.parametrize("model, args", models())
def test_training_gives_the_models_gradients(model, args):
    """In train mode (dropout on for the transformer): the backward recomputation replays the
    random numbers of the forward, and gradients land in the model's own ``.grad``."""
    model.train()
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    runner = OffloadRunner(sharded, "cpu")
    expected = {}
    for run, store in ((model, expected), (runner, None)):
        model.zero_grad()
        torch.manual_seed(1)
        out = run(*args)
        out.float().pow(2).mean().backward()
        if store is not None:
            store.update({n: p.grad.clone() for n, p in model.named_parameters()})
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[param_name], msg=lambda m: f"{param_name}: {m}")


def test_a_training_step_with_a_tied_head_matches_the_unsplit_model():
    torch.manual_seed(0)
    reference, ids, target = GPTStyleLMWithLoss(), *torch.randint(0, 100, (2, 2, 8))
    model = copy.deepcopy(reference)
    runner = OffloadRunner(autoshard.shard_model(model, 2, example_inputs=(ids, target)), "cpu")
    for net, run in ((reference, reference), (model, runner)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        run(ids, target).backward()  # the model computes its loss
        optimizer.step()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")


def test_buffers_updated_in_training_are_written_back():
    torch.manual_seed(0)
    model, x = NormedMLP(), torch.randn(6, 8)
    twin = copy.deepcopy(model)
    runner = OffloadRunner(autoshard.shard_model(model, 2, example_inputs=(x,)), "cpu")
    F.mse_loss(runner(x), x).backward()
    F.mse_loss(twin(x), x).backward()
    for name, buffer in twin.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=0, atol=0)
    assert model.layers[1].num_batches_tracked.item() == 1  # the recomputation did not count twice
    for name, param in twin.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, param.grad)


def test_each_stage_weights_are_on_the_device_only_while_it_runs():
    """With ``meta`` as the compute device the copies are distinct objects we can watch: every
    linear sees its weight on the device, and a stage's copies are gone before the next runs."""
    torch.manual_seed(0)
    model = ResidualMLP()
    sharded = autoshard.shard_model(model, 4, example_inputs=(torch.randn(4, 16),))
    seen = []  # (stage, weakref to the weight the linear ran with, its device)

    def record(stage_index):
        def hook(module, args, output):
            gc.collect()
            earlier_alive = [ref() is not None for s, ref, _ in seen if s < stage_index]
            assert not any(earlier_alive), "an earlier stage's weights are still on the device"
            seen.append((stage_index, weakref.ref(module.weight), module.weight.device))
        return hook

    for index, stage in enumerate(sharded.stages):
        for module in stage.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(record(index))
    runner = OffloadRunner(sharded, "meta")
    for module in model.modules():  # the model itself keeps no hooks
        module._forward_hooks.clear()
    with torch.no_grad():
        out = runner(torch.randn(4, 16))
    gc.collect()
    assert out.is_meta and len(seen) == 8
    assert {stage for stage, _, _ in seen} == {0, 1, 2, 3}
    assert all(device.type == "meta" for _, _, device in seen)
    assert all(ref() is None for _, ref, _ in seen)
    assert all(not p.is_meta for p in model.parameters())


class Tabled(nn.Module):
    """A block with a buffer of its own shape, so copies of it can be counted."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(rows, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + self.table[: x.shape[0]]


def test_a_training_forward_keeps_no_stage_buffers_on_the_device_until_the_backward():
    """Each stage's device copies of its buffers stayed alive until the backward (the checkpoint
    keeps the call's record), so the device held every stage's buffers at once."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Tabled(rows=37 + i) for i in range(4)))
    sharded = autoshard.shard_model(model, 4, example_inputs=(torch.randn(4, 8),))

    def tables() -> list[int]:
        gc.collect()
        return sorted(o.shape[0] for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta
                      and o.dim() == 2 and o.shape[0] in range(37, 41) and o.shape[1] == 8)

    before = tables()
    out = OffloadRunner(sharded, "cpu")(torch.randn(4, 8))
    added = tables()
    for rows in before:
        added.remove(rows)
    # what is left is the state each stage started from, which its recomputation replays; it
    # stays where the model keeps its buffers (here the same CPU), one per stage
    assert out.requires_grad and added == [37, 38, 39, 40]


def test_the_runner_binds_arguments_as_the_model_does():
    """The runner bound positional arguments to the first stage's parameters (the example's):
    runner(x, mask) computed model(x, bias=mask)."""
    torch.manual_seed(0)
    model, x, b, mask = Masked(), torch.randn(4, 8), torch.randn(4, 8), torch.rand(4, 8).round()
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), example_kwargs={"bias": b})
    runner = OffloadRunner(sharded, "cpu")
    with torch.no_grad():
        assert torch.equal(runner(x, bias=b), model(x, bias=b))
        assert torch.equal(runner(x, None, b), model(x, None, b))  # mask at its default, by position
        assert torch.equal(runner(x, mask), model(x, mask))  # mask, not bias: a capture made with it
    assert len(sharded.specializations) == 1
    with torch.no_grad(), pytest.raises(InputMismatchError, match="the example left mask=None at the default"):
        OffloadRunner(autoshard.shard_model(model, 2, (x,), {"bias": b}, respecialize=False), "cpu")(x, mask)


def test_bad_runner_arguments():
    with pytest.raises(InvalidArgumentTypeError, match="ShardedModel"):
        OffloadRunner(ResidualMLP(), "cpu")
    sharded = autoshard.shard_model(ResidualMLP(), 2)
    with pytest.raises(DeviceUnavailableError):
        OffloadRunner(sharded, f"cuda:{torch.cuda.device_count()}")


class OutputDevices(TorchDispatchMode):
    """Records the device of every tensor any operation makes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.seen.setdefault(leaf.device.type, set()).add(str(func))
        return out


def test_a_plan_made_on_the_cpu_computes_everything_on_the_runners_device():
    """The capture freezes ``torch.arange(n, device=idx.device)`` as ``device=cpu``; on a GPU the
    embedding would then be indexed with a CPU tensor. ``meta`` stands in for the GPU here."""
    torch.manual_seed(0)
    model, ids = GPTStyleLM(), torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids,))
    made = [n for stage in sharded.stages for n in stage.graph.nodes if n.kwargs.get("device") is not None]
    assert made and all(n.kwargs["device"].target is stage_device for n in made)
    runner = OffloadRunner(sharded, "meta")
    with torch.no_grad(), OutputDevices() as devices:
        out = runner(ids)
    assert out.is_meta and set(devices.seen) == {"meta"}, devices.seen


def test_a_sharded_model_moved_by_hand_computes_where_its_inputs_are():
    """Moved with ``.to`` (no runner to name the device), each stage reads the device its
    ``torch.arange(n, device=idx.device)`` was captured with from its inputs again."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    moved = copy.deepcopy(autoshard.shard_model(GPTStyleLM(), 3, example_inputs=(ids,))).to("meta")
    with torch.no_grad(), OutputDevices() as devices:
        out = moved(ids.to("meta"))
        by_stage = moved.stages[2](*moved.stages[1](*moved.stages[0](ids.to("meta"))))
    assert out.is_meta and by_stage.is_meta and set(devices.seen) == {"meta"}, devices.seen


def test_stages_placed_on_devices_of_their_own_hand_their_values_on():
    """Naive model parallelism: stage 0 stays on the CPU, stage 1 goes to ``meta`` (standing in
    for a second GPU); the sharded model moves the boundary values to stage 1's device."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    sharded = copy.deepcopy(autoshard.shard_model(GPTStyleLM(), 2, example_inputs=(ids,)))
    sharded.stages[1].to("meta")
    with torch.no_grad(), OutputDevices() as devices:
        out = sharded(ids)
    assert out.is_meta and set(devices.seen) == {"cpu", "meta"}
    assert "aten.embedding.default" in devices.seen["cpu"]


def test_a_stage_without_tensor_inputs_keeps_the_captured_device():
    assert stage_device(torch.device("cpu"), None, (3, "x")) == torch.device("cpu")
    assert stage_device(torch.device("cpu"), 3, (torch.zeros(1, device="meta"),)) == torch.device("meta")
    # the first input holding a tensor decides, in a container or not
    assert stage_device(torch.device("cpu"), [torch.zeros(1, device="meta")], torch.zeros(1)) == torch.device("meta")
    assert stage_device(torch.device("meta"), None, torch.zeros(1), [torch.zeros(1, device="meta")]).type == "cpu"


def test_the_runner_follows_mode_switches_made_after_it_was_built():
    """It copies each stage's modules once: a later model.eval() did not reach the copies, which
    went on dropping out in training mode while sharded(x) and the model ran in eval mode. Now each
    mode is served by a capture made in it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).train()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 8),))
    runner = OffloadRunner(sharded, "cpu")
    x = torch.randn(4, 8)
    for mode in (False, True):
        model.train(mode)
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        assert torch.equal(runner(x), expected)
    assert len(sharded.specializations) == 1


class NormedSizeBranch(nn.Module):
    """A batch norm before a branch on the batch size: the plan for 8 rows serves more than 5 only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x))
        return self.b(h * 2 if x.shape[0] > 5 else h)


def test_the_runner_serves_a_call_whose_guard_flips_before_a_batch_norm_as_a_call_does():
    """The runner refused, in training mode, a batch size ``sharded(x)`` serves: its guard's refusal
    named no stage, so every stage counted as run, the batch norm's update included, and the call as
    one no plan could take again."""
    torch.manual_seed(0)
    model, x = NormedSizeBranch().train(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    runner = OffloadRunner(autoshard.shard_model(model, 2, example_inputs=(torch.randn(8, 8),)), "cpu")
    torch.testing.assert_close(runner(x), twin(x), rtol=0, atol=1e-6)
    assert torch.equal(model.norm.running_mean, twin.norm.running_mean)
    assert len(runner.sharded.specializations) == 1


def step_alike(runner: OffloadRunner, model: nn.Module, twin: nn.Module) -> None:
    """One training step through the runner (on ``model``) and through the unsplit ``twin``, on the
    same fresh batch: the gradients must match."""
    x = torch.randn(4, 8)
    model.zero_grad()
    twin.zero_grad()
    runner(x).pow(2).mean().backward()
    twin(x).pow(2).mean().backward()
    for name, param in twin.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, param.grad, msg=lambda m: f"{name}: {m}")


class StepScaled(nn.Module):
    """Keeps state for its next call, kept whole by the capture: a step count it rebinds as a
    buffer or as a Python number on ``self``, which scales its output."""

    def __init__(self, in_buffer: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.in_buffer = in_buffer
        self.register_buffer("steps", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_buffer:
            self.steps = self.steps + 1
            return self.lin(x) * self.steps
        self.calls += 1
        return self.lin(x) * self.calls


@pytest.mark.parametrize("in_buffer", [True, False], ids=["buffer", "number"])
def test_state_a_kept_whole_module_writes_reaches_the_model_and_the_backward_replays_it(in_buffer):
    """The runner ran stages on copies: a rebound buffer was dropped (every call computed with the
    first count) and a number advanced on the copy only, and again when the backward recomputed
    the stage (which then computed its gradient with the next count)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), StepScaled(in_buffer), nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 8),))
    assert [w.name for w in sharded.plan.wrapped] == ["1"]
    runner = OffloadRunner(sharded, "cpu")
    for _ in range(3):
        step_alike(runner, model, twin)
        assert model[1].calls == twin[1].calls and torch.equal(model[1].steps, twin[1].steps)
    model[1].calls = twin[1].calls = 10  # the model's state, set by hand, is what the next call starts from
    model[1].steps.fill_(10)
    twin[1].steps.fill_(10)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), twin(x))


class KeepsPrevious(nn.Module):
    """Scales by what its previous call returned, kept as a plain tensor attribute (None at first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.previous = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * (1.0 if self.previous is None else self.previous.mean())
        self.previous = out.detach()
        return out


def test_a_tensor_a_kept_whole_module_keeps_for_its_next_call_reaches_the_model_and_the_backward():
    """The runner dropped ``self.previous`` (never written back) and its backward recomputation
    ran with the value the forward had just stored: wrong gradients, or from None a failed
    recomputation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), KeepsPrevious(), nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    runner = OffloadRunner(autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 8),)), "cpu")
    for _ in range(3):
        step_alike(runner, model, twin)
        assert torch.equal(model[1].previous, twin[1].previous)


class ScaledOnceSet(nn.Module):
    """Counts its calls (so the capture keeps it whole) and scales by ``self.scale`` once that is
    set: a dict of settings until then, which the runner does not copy (a module's registries are
    dicts too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.scale: Any = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * (1.0 if isinstance(self.scale, dict) else self.scale)


def test_an_attribute_that_becomes_a_number_after_calls_reaches_the_stage():
    """The runner reads every module's plain state on every call, whatever it held before: an
    attribute that was a dict (not copied) and is set to a number since is copied in, as a
    choice made once by name would have missed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ScaledOnceSet(), nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(4, 8),))
    assert [w.name for w in sharded.plan.wrapped] == ["1"]
    runner = OffloadRunner(sharded, "cpu")
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), twin(x))
        model[1].scale = twin[1].scale = 3.0
        torch.testing.assert_close(runner(x), twin(x))
    assert model[1].calls == twin[1].calls == 2
