"""A weightless value computed from the model's inputs (a decoder's attention mask) is computed again in each
stage that reads it instead of crossing every boundary (``lowering.remade``), and each such stage pays for it."""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch
from test_capture_gradients import assert_same_gradients
from torch import nn

import autoshard
from autoshard.costs.estimate import DeviceModel, node_times
from autoshard.costs.models import summed_per_stage
from autoshard.graph.partition import also_run
from autoshard.plan_io import read_plan
from autoshard.runtime import measure_stage_memory

BATCH, SEQ, WIDTH = 2, 32, 8


class MaskedLayers(nn.Module):
    """Builds a causal mask from its input's length (and padding) before its layers, as a decoder does;
    ``mask`` picks how: ``"causal"``, ``"random"`` (drawn: must be sent), ``"written"`` (made in place) or
    ``"source-written"`` (made from a tensor written in place after it)."""

    def __init__(self, mask: str = "causal") -> None:
        super().__init__()
        self.mask = mask
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[1]
        positions = torch.arange(n, device=x.device)
        if self.mask == "random":
            mask = torch.rand_like(positions[:, None] * positions, dtype=torch.float) > 0.5
        elif self.mask == "written":
            mask = positions[:, None] >= 0 * positions
            mask.logical_and_(positions[:, None] >= positions)
        elif self.mask == "source-written":  # its source written in place after it: made where it stands
            causal = positions[:, None] >= positions
            mask = causal.repeat(BATCH, 1, 1)
            causal.logical_not_()
        else:
            mask = positions[:, None] >= positions
        if pad is not None:
            mask = mask & pad[:, None, :].bool()
        weights = mask.float()  # each layer's product saves it for its backward
        for layer in self.layers:
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


def _sharded(mask: str = "causal", pad: bool = False, training: bool = False):
    torch.manual_seed(0)
    model = MaskedLayers(mask).train(training)
    x = torch.randn(BATCH, SEQ, WIDTH)
    kwargs = {"pad": torch.ones(BATCH, SEQ, dtype=torch.long)} if pad else {}
    return model, autoshard.shard_model(copy.deepcopy(model), 2, (x,), kwargs), x, kwargs


def _crossing(sharded: autoshard.ShardedModel) -> dict[str, int]:
    return {value.name: value.nbytes for value in sharded.plan.boundary_values(0)}


def _calls(stage: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for node in stage.graph.nodes
               if node.op != "placeholder" and name in (node.target, getattr(node.target, "__name__", None)))


def test_a_mask_of_the_inputs_size_is_made_again_in_the_next_stage_not_sent():
    model, sharded, x, _ = _sharded()
    hidden = BATCH * SEQ * WIDTH * 4
    assert sum(_crossing(sharded).values()) == hidden  # before: the (SEQ, SEQ) mask crossed beside the hidden states
    assert [_calls(stage, "arange") for stage in sharded.stages] == [1, 1]  # each stage makes its own
    for length in (SEQ, 5):  # the example's length, and another each stage makes its mask for
        y = torch.randn(BATCH, length, WIDTH)
        with torch.no_grad():
            assert torch.equal(sharded(y), model(y))


def test_under_torch_export_the_mask_is_made_again_from_a_carrier_of_the_inputs_size():
    """export reads the length with an operator (``aten.sym_size``), which weighed all of ``x``: the positions
    (no more bytes than ``x``) crossed, and a (batch, 1, 8, 8) mask, as Jamba's, no more than its sources."""
    torch.manual_seed(0)
    model = MaskedLayers().eval()
    x = torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(copy.deepcopy(model), 2, (x,),
                                    pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    crossing = _crossing(sharded)
    assert crossing.pop("x_shape") == 0 and sum(crossing.values()) == BATCH * SEQ * WIDTH * 4  # the hidden states
    y = torch.randn(3, 5, WIDTH)
    with torch.no_grad():
        assert torch.equal(sharded(y), model(y))


def test_a_mask_of_the_padding_is_made_again_from_the_padding_which_crosses_instead():
    model, sharded, x, kwargs = _sharded(pad=True)
    crossing = _crossing(sharded)
    assert sum(crossing.values()) == BATCH * SEQ * WIDTH * 4 + BATCH * SEQ  # hidden states + the padding as bools
    pad = torch.ones(BATCH, SEQ, dtype=torch.long)
    pad[0, :5] = 0
    with torch.no_grad():
        assert torch.equal(sharded(x, pad=pad), model(x, pad=pad))


@pytest.mark.parametrize("mask", ["random", "written"])
def test_a_mask_drawn_at_random_or_written_in_place_is_sent(mask):
    model, sharded, x, _ = _sharded(mask)
    assert sum(_crossing(sharded).values()) >= BATCH * SEQ * WIDTH * 4 + SEQ * SEQ  # the bool mask crosses
    assert _calls(sharded.stages[1], "rand_like") == _calls(sharded.stages[1], "logical_and_") == 0
    torch.manual_seed(1)
    with torch.no_grad():
        ours = sharded(x)
    torch.manual_seed(1)
    with torch.no_grad():
        assert torch.equal(ours, model(x))


def test_a_mask_whose_source_is_written_after_it_is_made_where_it_stands():
    model, sharded, x, _ = _sharded("source-written")
    assert _calls(sharded.stages[1], "repeat") == 0  # made again after the write, it would be the mask negated
    with torch.no_grad():
        assert torch.equal(sharded(x), model(x))


def test_training_through_a_mask_made_again_gives_the_models_gradients():
    torch.manual_seed(0)
    model = MaskedLayers().train()
    x = torch.randn(BATCH, SEQ, WIDTH)
    assert_same_gradients(autoshard.shard_model(model, 2, (x,)), model, x)


def test_each_stage_making_the_mask_is_charged_its_time():
    _, sharded, _, _ = _sharded()
    plan, device = sharded.plan, DeviceModel(peak_flops=1e11, bandwidth=1e10)
    seconds = node_times(plan.dag, device).seconds
    made_again = [v for v, stages in also_run(plan.dag, plan.assignment).items() if 1 in stages]
    assert "ge" in made_again and seconds["ge"] > 0
    report = autoshard.plan_report(sharded, device=device)
    assert report.stages[1].seconds == pytest.approx(
        sum(seconds[v] for v in plan.stage_nodes(1)) + sum(seconds[v] for v in made_again))


def test_the_memory_model_counts_the_mask_each_stage_keeps():
    _, sharded, x, _ = _sharded(training=True)
    report = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=2))
    for stage in range(2):
        measured = measure_stage_memory(sharded, stage, (x,), microbatches=2).peak
        assert report.stages[stage].memory.total == pytest.approx(measured, rel=0.01), stage


class MultipliedThenAdded(nn.Module):
    """Weighs its first two layers' scores by the mask and adds it to the last two's: a product saves it, a sum
    does not (nor does the first product, which reads nothing that requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        weights = (positions[:, None] >= positions).float()
        for i, layer in enumerate(self.layers):
            scores = x @ x.transpose(1, 2)
            scores = scores * weights if i < 2 else scores + weights
            x = x + layer(scores.softmax(-1) @ x)
        return x


def test_a_stage_whose_readers_of_the_mask_save_none_of_it_is_not_charged_it():
    # a layer a stage: the first stage, where the mask is placed, and the last two make it but keep none of it
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(MultipliedThenAdded().train(), 4, (x,))
    report = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=4))
    for stage in range(4):
        measured = measure_stage_memory(sharded, stage, (x,), microbatches=4).peak
        assert report.stages[stage].memory.total == pytest.approx(measured, rel=0.01), stage


def test_a_saved_plan_counts_the_mask_each_stage_keeps_as_the_live_plan_does(tmp_path):
    _, sharded, _, _ = _sharded(training=True)
    saved = read_plan(sharded.save_plan(tmp_path / "plan.json"))
    live = autoshard.plan_report(sharded).stages
    assert [stage.total for stage in saved.training_memory()] == [stage.memory.total for stage in live]
    assert saved.stage_seconds() == pytest.approx([stage.seconds for stage in live])  # the step predicted from it


def test_also_run_names_every_reader_stage_of_a_chain_made_again():
    dag = nx.DiGraph()
    dag.add_nodes_from(["x", "a", "b", "c", "d"])
    dag.nodes["a"]["readers"] = ("b",)  # a is read by b, itself read in stages 0 and 2
    dag.nodes["b"]["readers"] = ("c", "d")
    assignment = {"x": 0, "a": 0, "b": 0, "c": 0, "d": 2}
    assert also_run(dag, assignment) == {"a": frozenset({2}), "b": frozenset({2})}
    costs = {"x": 0.0, "a": 1.0, "b": 10.0, "c": 0.0, "d": 0.0}
    assert summed_per_stage(costs, assignment, 3, also_run(dag, assignment)) == [11.0, 0.0, 11.0]


class EmbeddedMask(nn.Module):
    """Builds its mask from its embedding's length, as Hugging Face decoders do: each stage reads the
    embedding's shape alone, through a carrier (``shape_carriers``), and nothing saves the embedding's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        positions = torch.arange(x.shape[1], device=x.device)
        weights = (positions[:, None] >= positions).float()
        h = x + 1  # (an add saves neither addend)
        for layer in self.layers:
            h = h + layer(((h @ h.transpose(1, 2)) * weights).softmax(-1) @ h)
        return h


def test_a_carrier_sent_for_the_mask_is_not_charged_the_tensor_it_carries_the_shape_of(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (BATCH, SEQ))
    sharded = autoshard.shard_model(EmbeddedMask().train(), 2, (ids,))
    assert "embed_shape" in _crossing(sharded)  # for the next stage's mask
    report = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=2))
    for stage in range(2):
        measured = measure_stage_memory(sharded, stage, (ids,), microbatches=2).peak
        assert report.stages[stage].memory.total == pytest.approx(measured, rel=0.01), stage
    saved = read_plan(sharded.save_plan(tmp_path / "plan.json"))  # which knows no carrier's tensor
    assert [stage.total for stage in saved.training_memory()] == [
        stage.memory.total for stage in autoshard.plan_report(sharded).stages]


class WrittenPositions(nn.Module):
    """Builds its mask from positions it then shifts in place between its layers: a stage that made the mask
    again from the positions it received would see them shifted."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        weights = ((positions[:, None] + positions) >= SEQ).float()
        for i, layer in enumerate(self.layers):
            if i == 2:
                positions.add_(3)
                x = x + positions[None, :, None].float()
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


@pytest.mark.parametrize("stages", [2, 4])
def test_a_mask_of_values_written_in_place_later_is_sent_not_made_again(stages):
    torch.manual_seed(0)
    model, x = WrittenPositions().eval(), torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(copy.deepcopy(model), stages, (x,))  # (verified: its outputs are the model's)
    with torch.no_grad():
        assert torch.equal(sharded(x), model(x))


class InputScaled(nn.Module):
    """Weighs its scores by a column of its input, expanded: no FLOPs, more bytes than the column, but it carries
    the input's gradient, which a stage making it again would add up in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = x[:, :, :1].expand(-1, -1, x.shape[1])
        for layer in self.layers:
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


def test_a_value_carrying_an_inputs_gradient_is_sent_and_the_inputs_gradient_is_the_models():
    torch.manual_seed(0)
    model, x = InputScaled().train(), torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(copy.deepcopy(model), 2, (x.clone().requires_grad_(),))
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    sharded(ours).square().sum().backward()
    model(theirs).square().sum().backward()
    assert torch.equal(ours.grad, theirs.grad)


class Tabled(nn.Module):
    """Weighs each layer's input by a table made from its length and inverse frequencies, as a rotary
    embedding makes its cosines: ``frequencies`` picks what they are, a ``"buffer"``, a ``"parameter"`` (the
    table carries its gradient) or a ``"written"`` buffer (shifted in place after the table is made)."""

    def __init__(self, frequencies: str = "buffer") -> None:
        super().__init__()
        inverse = 1.0 / 10 ** (torch.arange(WIDTH) / WIDTH)
        if frequencies == "parameter":
            self.inverse = nn.Parameter(inverse)
        else:
            self.register_buffer("inverse", inverse, persistent=False)
        self.written = frequencies == "written"
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        table = (positions[:, None].float() * self.inverse.float()).cos()
        if self.written:
            self.inverse.add_(1.0)
        for layer in self.layers:
            x = x + layer(x * table)
        return x


def _tabled(frequencies: str):
    torch.manual_seed(0)
    model, x = Tabled(frequencies).eval(), torch.randn(BATCH, SEQ, WIDTH)
    return model, autoshard.shard_model(copy.deepcopy(model), 2, (x,)), x


def test_a_table_of_the_inputs_length_and_a_buffer_is_made_again_from_the_buffer_which_crosses_instead():
    model, sharded, x = _tabled("buffer")
    assert sum(_crossing(sharded).values()) == BATCH * SEQ * WIDTH * 4 + WIDTH * 4  # not the (SEQ, WIDTH) table
    assert [_calls(stage, "cos") for stage in sharded.stages] == [1, 1]
    for length in (SEQ, 5):
        y = torch.randn(BATCH, length, WIDTH)
        with torch.no_grad():
            assert torch.equal(sharded(y), model(y))


@pytest.mark.parametrize("frequencies", ["parameter", "written"])
def test_a_table_of_a_parameter_or_of_a_buffer_written_in_the_call_is_sent(frequencies):
    model, sharded, x = _tabled(frequencies)
    assert sum(_crossing(sharded).values()) == BATCH * SEQ * WIDTH * 4 + SEQ * WIDTH * 4  # the table crosses
    assert _calls(sharded.stages[1], "cos") == 0
    with torch.no_grad():
        assert torch.equal(sharded(x), model(x))


def test_training_through_a_table_made_again_gives_the_models_gradients_and_memory():
    torch.manual_seed(0)
    model, x = Tabled().train(), torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert _calls(sharded.stages[1], "cos") == 1
    assert_same_gradients(sharded, model, x)
    report = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=2))
    for stage in range(2):
        measured = measure_stage_memory(sharded, stage, (x,), microbatches=2).peak
        assert report.stages[stage].memory.total == pytest.approx(measured, rel=0.01), stage
