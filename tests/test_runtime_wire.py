"""What stages send and return: the items of a tuple, contiguous values and gradients, the
tensors of the model's output; and later stages that ignore the model's keyword inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import StackedLSTMs
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.costs.values import StructureMeta
from autoshard.errors import BoundaryValueError, PipelineSetupError
from autoshard.examples import GPTStyleLMWithLoss
from autoshard.graph import Partition
from autoshard.passes import Pipeline
from autoshard.passes.base import ExampleInputs, PassContext
from autoshard.passes.emit import EmitPass
from autoshard.runtime import model_loss
from autoshard.runtime.boundaries import boundary_wires
from autoshard.runtime.stage import stage_module
from autoshard.runtime.schedule import _model_loss_at
from autoshard.runtime.wire import OutputTensors, Wire, own_tensor


class Halves(nn.Module):
    """``x.chunk(2)`` makes a tuple; its second half is only read at the very end."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.late = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = x.chunk(2, dim=1)
        return self.second(self.first(halves[0])) + self.late(halves[1])


class WholeTuple(Halves):
    """The same tuple, but the last stage uses it whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = x.chunk(2, dim=1)
        return self.second(self.first(halves[0])) + torch.cat(halves, dim=1).sum()


def sharded_with_cut_after(model: nn.Module, x: torch.Tensor, last_of_stage_0: str):
    """The plan that cuts right after node ``last_of_stage_0``, whatever the splitter would do."""
    planning = Pipeline.parse("trace,shape-prop,build-dag")
    program = run_pipeline(model, planning, ExampleInputs((x,), {})).program
    order = list(program.dag.nodes)
    cut = order.index(last_of_stage_0) + 1
    assignment = {node: int(position >= cut) for position, node in enumerate(order)}
    partition = Partition.from_assignment(program.dag, assignment, 2)
    return EmitPass().run(dataclasses.replace(program, partition=partition), PassContext()).sharded


def test_a_tuple_read_by_item_crosses_as_its_items():
    torch.manual_seed(0)
    model, x = Halves(), torch.randn(3, 8)
    sharded = sharded_with_cut_after(model, x, "first")
    crossing = sharded.plan.boundaries[0]
    assert "chunk" in crossing and "getitem_1" not in crossing  # the tuple itself crosses
    wires = boundary_wires(sharded)[0]
    assert Wire("chunk", 1) in wires and Wire("chunk") not in wires
    first, last = (stage_module(sharded, i, torch.device("cpu")) for i in range(2))
    sent = first(x)
    assert all(isinstance(value, torch.Tensor) and value.is_contiguous() for value in sent)
    with torch.no_grad():
        torch.testing.assert_close(last(*sent), model(x), rtol=0, atol=0)


def test_a_tuple_used_whole_crosses_as_its_items_and_is_built_again():
    torch.manual_seed(0)
    model, x = WholeTuple(), torch.randn(3, 8)
    sharded = sharded_with_cut_after(model, x, "first")
    wires = [Wire("chunk", 0, "tuple"), Wire("chunk", 1, "tuple")]
    assert [w for w in boundary_wires(sharded)[0] if w.name == "chunk"] == wires
    first, last = (stage_module(sharded, i, torch.device("cpu")) for i in range(2))
    sent = first(x)
    assert all(isinstance(value, torch.Tensor) for value in sent)
    torch.testing.assert_close(last(*sent), model(x), rtol=0, atol=0)
    x.requires_grad_(True)
    sent = first(x)
    last(*sent).sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    model(expected).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=0, atol=0)


def test_an_lstm_state_handed_to_the_next_lstm_crosses_and_the_stages_match_the_model():
    torch.manual_seed(0)
    model, x = StackedLSTMs(), torch.randn(2, 5, 4)
    sharded = sharded_with_cut_after(model, x, "relu")
    state = next(name for name in sharded.plan.boundaries[0] if name != "relu")
    wires = [Wire(state, 0, "tuple"), Wire(state, 1, "tuple")]
    assert [w for w in boundary_wires(sharded)[0] if w.name == state] == wires
    first, last = (stage_module(sharded, i, torch.device("cpu")) for i in range(2))
    with torch.no_grad():
        torch.testing.assert_close(last(*first(x)), model(x), rtol=0, atol=0)


def test_a_nested_tuple_used_whole_is_refused():
    torch.manual_seed(0)
    sharded = sharded_with_cut_after(WholeTuple(), torch.randn(3, 8), "first")
    halves = sharded.plan.dag.nodes["chunk"]["value_meta"]
    sharded.plan.dag.nodes["chunk"]["value_meta"] = StructureMeta("tuple", (0, 1), (halves.items[0], halves))
    with pytest.raises(BoundaryValueError, match=r"'chunk' \(tuple .*A tuple or list of tensors crosses as its items"):
        boundary_wires(sharded)


class TransposedUse(nn.Module):
    """The first layer's output is read transposed: its gradient comes back transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x).transpose(0, 1) * self.scale


def test_the_gradient_sent_back_across_a_boundary_is_contiguous():
    """gloo sends only contiguous tensors; autograd would hand back a transposed gradient."""
    torch.manual_seed(0)
    sharded = sharded_with_cut_after(TransposedUse(), torch.randn(3, 4), "first")
    received = torch.randn(3, 4, requires_grad=True)
    stage = stage_module(sharded, 1, torch.device("cpu"))
    (sent_back,) = torch.autograd.grad(stage(received).sum(), received)
    (unfixed,) = torch.autograd.grad(sharded.stages[1](received).sum(), received)  # as PyTorch computes it
    assert not unfixed.is_contiguous() and sent_back.is_contiguous()
    torch.testing.assert_close(sent_back, unfixed)


class TransposedSent(nn.Module):
    def __init__(self, unsqueezed: bool) -> None:
        super().__init__()
        self.first, self.second, self.unsqueezed = nn.Linear(4, 6), nn.Linear(3, 5), unsqueezed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sent = self.first(x).t()
        return self.second(sent.unsqueeze(0) if self.unsqueezed else sent)


@pytest.mark.parametrize("unsqueezed, order, shape", [(False, (1, 0), (3, 6)), (True, (2, 0, 1), (3, 1, 6))])
def test_a_transposed_value_crosses_permuted_without_a_copy_and_arrives_as_the_model_laid_it_out(
        unsqueezed, order, shape):
    """A value that fills its storage in another order (a transpose; unsqueezed, its dimension of size
    1 has a stride ``empty_like`` would not give) crosses as ``permute(order)``, contiguous as it is:
    the sending stage sends its own storage rather than a copy, and the receiving stage permutes it
    back, so both stages hold it as the model did (and its memory model counted it)."""
    torch.manual_seed(0)
    model, x = TransposedSent(unsqueezed), torch.randn(3, 4)
    sharded = sharded_with_cut_after(model, x, "unsqueeze" if unsqueezed else "t")
    (wire,) = boundary_wires(sharded)[0]
    assert wire.order == order
    first, second = (stage_module(sharded, j, torch.device("cpu")) for j in range(2))
    (sent,) = first(x)
    kept = first.graph.find_nodes(op="call_method", target="permute")
    assert kept and sent.is_contiguous() and sent.shape == shape  # the Linear's own (3, 6) output
    received = sent.detach().clone().requires_grad_()
    out = second(received)
    torch.testing.assert_close(out, model(x))
    (back,) = torch.autograd.grad(out.sum(), received)
    assert back.is_contiguous() and back.shape == sent.shape


class Structured(nn.Module):
    """Returns nested tuples with a ``None``, like a ``ModelOutput`` with an unset field."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        hidden = self.first(x)
        return self.second(hidden), (hidden, None)


class OneTuple(Halves):
    def forward(self, x: torch.Tensor):
        return (super().forward(x),)


def test_the_last_stage_returns_the_tensors_of_the_models_output():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = Structured()
    sharded = sharded_with_cut_after(model, x, "first")
    last = stage_module(sharded, 1, torch.device("cpu"))
    out, (hidden, _) = model(x)
    with torch.no_grad():
        got = last(*stage_module(sharded, 0, torch.device("cpu"))(x))
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got, (out, hidden), rtol=0, atol=0)


def test_one_tensor_is_returned_as_itself_not_in_a_tuple():
    """PyTorch gives ``loss_fn`` a one-item tuple unwrapped when inferring shapes, as it is in a
    step: a single tensor is the same to ``loss_fn`` both times."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    model = OneTuple()
    sharded = sharded_with_cut_after(model, x, "first")
    with torch.no_grad():
        got = stage_module(sharded, 1, torch.device("cpu"))(*stage_module(sharded, 0, torch.device("cpu"))(x))
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, model(x)[0], rtol=0, atol=0)


def test_later_stages_take_their_inputs_by_position_and_ignore_keywords():
    """A schedule with two stages on a rank hands both the keywords of ``step`` (the model's
    inputs); a later stage receiving a value of the same name must not take it twice."""
    torch.manual_seed(0)
    model, (ids, targets) = GPTStyleLMWithLoss(layers=2), torch.randint(0, 100, (2, 2, 8))
    sharded = autoshard.shard_model(model, 3, example_inputs=(ids, targets))
    assert all("targets" in boundary for boundary in sharded.plan.boundaries)
    stages = [stage_module(sharded, i, torch.device("cpu")) for i in range(3)]
    with torch.no_grad():
        values = stages[0](ids, targets=targets)
        values = stages[1](*values, idx=ids, targets=targets)
        torch.testing.assert_close(stages[2](*values, targets=targets), model(ids, targets), rtol=0, atol=0)


def test_a_stage_names_its_own_device_where_the_capture_froze_the_planning_one():
    """``torch.arange(n, device=idx.device)`` is captured as ``device=cpu``; a stage placed
    elsewhere (``meta`` standing in for a GPU) makes that tensor on its own device."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(GPTStyleLMWithLoss(), 2, example_inputs=(ids, ids))
    graph = stage_module(sharded, 0, torch.device("meta")).graph
    devices = [value for node in graph.nodes for value in (*node.args, *node.kwargs.values())
               if isinstance(value, torch.device)]
    assert devices and set(devices) == {torch.device("meta")}


def test_model_loss_takes_the_loss_the_last_stage_returns():
    loss, logits = torch.tensor(2.5), torch.randn(2, 3)
    assert model_loss(loss, None) is loss                  # a model returning its loss alone
    assert model_loss(OutputTensors()({"loss": loss, "logits": logits, "past": None}), logits) is loss


def test_model_loss_finds_the_loss_entry_after_the_predictions_and_refuses_a_non_scalar():
    """A dict with its loss second handed the predictions to backward (a silent wrong loss when a
    microbatch has one row), or failed in PyTorch with an untyped error."""
    loss, pred = torch.tensor(0.5), torch.randn(1, 1)
    reader = OutputTensors()
    assert _model_loss_at(reader, reader({"pred": pred, "loss": loss})) is loss
    with pytest.raises(PipelineSetupError, match=r"model_loss needs the model's loss.*shape \[2, 3\]"):
        model_loss((torch.randn(2, 3), loss))


def test_the_last_stages_output_is_read_anew_on_every_microbatch():
    """A tensor or a container of tensors only is read in one step, any other through its leaves:
    a reader that met one structure gives each later call its own leaves and loss, whatever came
    before (``None`` fields dropped, the loss found by identity, the first place it is at)."""
    loss, pred = torch.tensor(0.5), torch.randn(1, 1)
    reader = OutputTensors()
    assert reader((pred, loss)) == (pred, loss) and reader.loss_index is None
    assert reader({"pred": pred, "loss": loss}) == (pred, loss) and reader.loss_index == 1
    assert reader({"loss": loss, "pred": (pred, None)}) == (loss, pred) and reader.loss_index == 0
    assert reader({"pred": loss, "loss": loss}) == (loss, loss) and reader.loss_index == 0
    assert reader(pred) is pred and reader.loss_index is None
    assert reader({"pred": pred, "loss": None}) is pred and reader.loss_index is None


class ReluInPlaceAfterCut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu_(self.first(x)))


def test_a_stage_may_write_in_place_to_a_value_it_received():
    """The received value was read through a view a custom Function made, which autograd forbids
    writing to: a ReLU(inplace=True) right after a cut failed every pipeline training step."""
    torch.manual_seed(0)
    model = ReluInPlaceAfterCut()
    sharded = sharded_with_cut_after(model, torch.randn(3, 4), "first")
    received = torch.randn(3, 4, requires_grad=True)
    (got,) = torch.autograd.grad(stage_module(sharded, 1, torch.device("cpu"))(received).sum(), received)
    again = received.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(model.second(torch.relu(again)).sum(), again)
    assert torch.equal(got, expected)


class WeightTransposeSent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.first, self.second = nn.Parameter(torch.randn(6, 4)), nn.Linear(4, 4), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.t()
        return self.second(self.first(x) @ w)


def test_a_view_of_a_weight_sent_gets_a_gradient_of_its_own_not_the_receive_buffer():
    """Handed the gradient received for a transpose of a weight, autograd kept the receive buffer, which
    ``PipelineStage`` receives into every step, as the weight's ``.grad``; the wire gives it a copy
    (``own_gradient``), as the memory model counts it, before the step ends."""
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    sharded = sharded_with_cut_after(WeightTransposeSent(), x, "first")
    stage = stage_module(sharded, 0, torch.device("cpu"))
    sent = stage(x)
    buffers = [torch.ones_like(t) for t in sent]  # as PipelineStage keeps them
    torch.autograd.backward(list(sent), buffers)
    weight = stage.get_parameter("w")
    assert weight.grad is not None
    assert weight.grad.untyped_storage().data_ptr() not in {b.untyped_storage().data_ptr() for b in buffers}


def test_a_value_sent_under_a_split_backward_is_a_tensor_of_its_own_that_detaching_leaves_the_stages_alone():
    """Zero-bubble schedules ``detach_()`` each value sent once its inputs' backward ran: a view (GPT-2's
    merged heads) raised. The value sent is an alias (no copy), detached in place of the stage's own
    values, whose gradient reaches them unchanged."""
    weight = torch.randn(4, 3, requires_grad=True)
    made = torch.tanh(weight * 2)
    merged = made.view(12)
    sent = own_tensor(merged)
    assert not sent._is_view() and sent.data_ptr() == merged.data_ptr()
    sent.detach_()
    assert merged.grad_fn is not None and made.grad_fn is not None
    grad = torch.arange(12.0)
    (weight_grad,) = torch.autograd.grad(merged, weight, grad)
    assert torch.equal(weight_grad, torch.autograd.grad(torch.tanh(weight * 2).view(12), weight, grad)[0])
    plain = torch.randn(3)[1:]  # a view without a gradient: sent as an alias too
    assert not own_tensor(plain)._is_view()
