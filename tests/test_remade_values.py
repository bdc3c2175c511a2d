"""A weightless value computed from the model's inputs (a decoder's attention mask) is computed again in each
stage that reads it instead of crossing every boundary (``lowering.remade``), and each such stage pays for it."""

from __future__ import annotations

import copy
import json

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


def test_a_plan_file_from_before_saves_from_counts_the_mask_kept_where_each_stage_makes_it(tmp_path):
    # the file says not which readers save what they read: each stage making the mask may keep it, and here does
    _, sharded, _, _ = _sharded(training=True)
    path = sharded.save_plan(tmp_path / "plan.json")
    content = json.loads(path.read_text())
    for node in content["nodes"]:
        node.get("training", {}).pop("saves_from", None)
    path.write_text(json.dumps(content))
    assert [stage.total for stage in read_plan(path).training_memory()] == [
        stage.memory.total for stage in autoshard.plan_report(sharded).stages]


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
    the input's gradient, which a stage making it again would add up in another order. ``column`` picks how it
    is taken: sliced, the first of a split (a tuple between the input and the column) or the real part of a
    complex input's."""

    def __init__(self, column: str = "sliced") -> None:
        super().__init__()
        self.column = column
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if self.column == "split":
            weights = x.split(1, dim=-1)[0].expand(-1, -1, n)
        elif self.column == "complex":
            weights, x = torch.real(x[:, :, :1].expand(-1, -1, n)), torch.real(x)
        else:
            weights = x[:, :, :1].expand(-1, -1, n)
        for layer in self.layers:
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


@pytest.mark.parametrize("column", ["sliced", "split", "complex"])
def test_a_value_carrying_an_inputs_gradient_is_sent_and_the_inputs_gradient_is_the_models(column):
    torch.manual_seed(0)
    dtype = torch.complex64 if column == "complex" else torch.float
    model, x = InputScaled(column).train(), torch.randn(BATCH, SEQ, WIDTH, dtype=dtype)
    sharded = autoshard.shard_model(copy.deepcopy(model), 2, (x.clone().requires_grad_(),))
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    sharded(ours).square().sum().backward()
    model(theirs).square().sum().backward()
    assert torch.equal(ours.grad, theirs.grad)


class LearnedBias(nn.Module):
    """Weighs its scores by a learned bias per position, expanded: no FLOPs, more bytes than the bias, but read
    from a weight, whose gradient a stage making it again would add up in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.rand(SEQ))
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        weights = self.bias[None, :n].expand(n, n)
        for layer in self.layers:
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


def test_a_value_computed_from_a_weight_is_sent_and_the_weights_gradient_is_the_models():
    torch.manual_seed(0)
    model, x = LearnedBias().train(), torch.randn(BATCH, SEQ, WIDTH)
    assert_same_gradients(autoshard.shard_model(model, 2, (x,)), model, x)


class CountedMask(nn.Module):
    """Makes the mask and counts its calls: a module writing state its next call reads is kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, n: int) -> torch.Tensor:
        self.calls += 1
        positions = torch.arange(n)
        return (positions[:, None] >= positions).float()


class MaskedByModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = CountedMask()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.mask(x.shape[1])
        for layer in self.layers:
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


def test_a_mask_made_by_a_module_kept_whole_is_sent_and_the_module_runs_once_a_call():
    model, x = MaskedByModule().eval(), torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(model, 2, (x,))
    calls = model.mask.calls
    with torch.no_grad():
        sharded(x)
    assert model.mask.calls == calls + 1  # made again, the second stage would run it too


def test_a_mask_torch_export_captures_is_made_again():
    torch.manual_seed(0)
    model, x = MaskedLayers().eval(), torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(copy.deepcopy(model), 2, (x,),
                                    pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    assert sum(_crossing(sharded).values()) < BATCH * SEQ * WIDTH * 4 + SEQ * SEQ  # less than the bool mask
    with torch.no_grad():
        assert torch.equal(sharded(x), model(x))


class PositionsProduct(nn.Module):
    """Weighs its scores by the outer product of the positions: from the inputs' size, but made by a product."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float)
        weights = positions[:, None] @ positions[None, :]
        for layer in self.layers:
            x = x + layer(((x @ x.transpose(1, 2)) * weights).softmax(-1) @ x)
        return x


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


def test_a_value_made_by_a_product_is_sent_not_computed_again():
    x = torch.randn(BATCH, SEQ, WIDTH)
    sharded = autoshard.shard_model(PositionsProduct().eval(), 2, (x,))
    assert _crossing(sharded) == {"matmul": SEQ * SEQ * 4, "add_1": BATCH * SEQ * WIDTH * 4}


class CheckedLayers(nn.Module):
    """Asserts on its third layer's output: a check nothing reads, kept for its side effect."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 2:
                torch._assert((x > -1e9).all(), "finite")
        return x


def test_a_value_nothing_reads_stays_after_what_it_is_computed_from():
    # route_around leaves the in-edges of a value without readers: cut loose, a split placed the check in a stage
    # before the one computing what it checks, and emit found nothing to read (KeyError at k = 3)
    x = torch.randn(BATCH, WIDTH)
    sharded = autoshard.shard_model(CheckedLayers(), 3, (x,), cost="nodes")
    assert sharded.plan.assignment["_assert"] == sharded.plan.assignment["all_1"]


class WidthReturned(nn.Module):
    """Returns its output and a number computed from its first layer's width: a model output that is no tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        h = self.layers[0](x)
        width = h.shape[-1] * 2
        for layer in self.layers[1:]:
            h = layer(h)
        return h, width


@pytest.mark.parametrize("stages", [2, 3])
def test_a_model_output_that_is_no_tensor_crosses_no_boundary_what_it_is_computed_from_does(stages):
    # pipeline runtimes send tensors: the last stage computes the number again from what crosses
    x = torch.randn(BATCH, WIDTH)
    sharded = autoshard.shard_model(WidthReturned(), stages, (x,), cost="params")
    assert all(value.name != "mul" for j in range(stages - 1) for value in sharded.plan.boundary_values(j))
    assert sharded(x)[1] == WIDTH * 2
