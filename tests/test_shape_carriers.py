"""A stage that reads only a tensor's shape, dtype or device gets a zero-byte carrier of them across the
boundary, not the tensor (``lowering.shape_carriers``): GPT-2 reads its embedding's width to reshape its
last output, and the embedding's output crossed every boundary for it."""

from __future__ import annotations

import copy

import torch
from torch import nn

import autoshard
from autoshard.lowering.shape_carriers import CarriedShape, shape_carrier
from test_runtime_device_map import SizeAcross

BATCH, WIDTH = 6, 16


class WidthReadAtTheEnd(nn.Module):
    """Reads the embedding's width (and dtype and device) right after it and uses them after the last block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        shape = (-1, h.size(-1))
        like = dict(dtype=h.dtype, device=h.device)
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return h.reshape(shape) + torch.ones(h.shape[-1], **like)


def _sharded(stages: int = 4, training: bool = False) -> tuple[nn.Module, autoshard.ShardedModel]:
    torch.manual_seed(0)
    model = WidthReadAtTheEnd().train(training)
    return model, autoshard.shard_model(copy.deepcopy(model), stages, (torch.randn(BATCH, 8),))


def test_the_width_crosses_as_a_zero_byte_carrier_and_the_tensor_stays_in_its_stage():
    model, sharded = _sharded()
    plan = sharded.plan
    assert plan.assignment["embed_shape"] == plan.assignment["embed"] == 0  # where it is made: its tensor's stage
    assert plan.modules(1)[0] == "blocks.1"  # not the carrier's module, in a stage that runs nothing of it
    for boundary in range(plan.num_stages - 1):
        values = {value.name: value for value in plan.boundary_values(boundary)}
        assert "embed" not in values  # before: the embedding's output crossed every boundary
        assert values["embed_shape"].nbytes == 0
        assert plan.boundary_bytes()[boundary] == BATCH * WIDTH * 4  # the blocks' running sum alone
    for batch in (BATCH, 3):  # the example's shape, and another the carrier tells the last stage
        x = torch.randn(batch, 8)
        with torch.no_grad():
            assert torch.equal(sharded(x), model(x))


def test_only_a_stage_without_the_tensor_reads_the_carrier():
    _, whole = _sharded(stages=1)
    assert not [n for n in whole.stages[0].graph.nodes if n.target in (shape_carrier, CarriedShape)]
    _, sharded = _sharded()
    first, *middle, last = sharded.stages
    assert [n.args[0].name for n in first.graph.nodes if n.target is shape_carrier] == ["embed"]
    assert not [n for stage in middle for n in stage.graph.nodes if n.target in (shape_carrier, CarriedShape)]
    assert [n.args[0].name for n in last.graph.nodes if n.target is CarriedShape] == ["embed_shape"]


def test_training_through_carriers_gives_the_models_gradients():
    model, sharded = _sharded(training=True)
    x = torch.randn(BATCH, 8)
    model(x).square().sum().backward()
    sharded(x).square().sum().backward()
    theirs = dict(model.named_parameters())
    for name, parameter in sharded.named_parameters():
        assert torch.equal(parameter.grad, theirs[name].grad), name


def test_the_memory_model_receives_no_bytes_for_a_carrier():
    _, sharded = _sharded(training=True)
    stages = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=1)).stages
    assert [stage.memory.received_bytes for stage in stages[1:]] == [BATCH * WIDTH * 4] * 3


def test_a_saved_plan_rebuilds_the_same_carriers(tmp_path):
    model, sharded = _sharded()
    path = sharded.save_plan(tmp_path / "plan.json")
    loaded = autoshard.load_plan(path, copy.deepcopy(model), (torch.randn(BATCH, 8),))
    assert loaded.plan.boundaries == sharded.plan.boundaries
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_carried_shape_answers_as_its_tensor():
    tensor = torch.zeros(2, 3, 4, dtype=torch.float16)
    carried = CarriedShape(shape_carrier(tensor))
    assert shape_carrier(tensor).nbytes == 0
    for read in (lambda t: t.shape, lambda t: t.size(), lambda t: t.size(-2), lambda t: t.size(dim=0),
                 lambda t: t.dim(), lambda t: t.ndimension(), lambda t: t.ndim, lambda t: t.numel(),
                 lambda t: t.nelement(), lambda t: t.dtype, lambda t: t.device):
        assert read(carried) == read(tensor)


class EmbeddingReadMidway(WidthReadAtTheEnd):
    """The embedding's output is also added back after the third block: it crosses to that block's stage
    itself, and its carrier crosses only past it, made there from the embedding's output it received."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        width = h.size(-1)
        y = h
        for index, block in enumerate(self.blocks):
            y = torch.relu(block(y)) + (h if index == 3 else y)
        return y.reshape(-1, width)


def test_a_carrier_crosses_only_past_the_stages_holding_its_tensor():
    torch.manual_seed(0)
    model = EmbeddingReadMidway()
    sharded = autoshard.shard_model(copy.deepcopy(model), 6, (torch.randn(BATCH, 8),))
    boundaries = sharded.plan.boundaries
    held = [j for j, names in enumerate(boundaries) if "embed" in names]
    carried = [j for j, names in enumerate(boundaries) if "embed_shape" in names]
    assert held and carried and max(held) + 1 == min(carried)  # never both across one boundary
    assert carried == list(range(min(carried), len(boundaries)))
    maker = sharded.stages[min(carried)]  # received the embedding's output, sends its carrier on
    assert [n.args[0].name for n in maker.graph.nodes if n.target is shape_carrier] == ["embed"]
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(sharded(x), model(x))


class Head(nn.Module):
    """Reshapes its input to the embedding's width: the read sits inside the head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.proj(h).reshape(-1, embedded.size(-1))


class WidthReadInTheHead(WidthReadAtTheEnd):
    def __init__(self) -> None:
        super().__init__()
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = embedded = self.embed(x)
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return self.head(h, embedded)


def test_a_constraint_on_the_module_reading_the_width_does_not_pull_the_carrier_in():
    """Pinning or keeping whole the module that reads the width does not pull the carrier, and with it
    the embedding, into that module's stage: the carrier is in the embedding's."""
    torch.manual_seed(0)
    model, x = WidthReadInTheHead().eval(), torch.randn(BATCH, 8)
    for constraint in (dict(no_split=["head"]), dict(pin={"head": 3})):
        sharded = autoshard.shard_model(copy.deepcopy(model), 4, (x,), **constraint)
        for boundary in range(3):
            assert "embed" not in {value.name for value in sharded.plan.boundary_values(boundary)}, constraint
        with torch.no_grad():
            assert torch.equal(sharded(x[:3]), model(x[:3]))


class WidthReadAfterTheBlocks(WidthReadAtTheEnd):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = embedded = self.embed(x)
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return h.reshape(-1, embedded.size(-1))


def test_a_split_in_program_order_sends_the_carrier_made_right_after_its_tensor():
    """``fixed-order`` and ``cut_before`` cut the program's order: a carrier made where the width is
    read, after the last block, left the embedding to cross every boundary."""
    torch.manual_seed(0)
    model, x = WidthReadAfterTheBlocks().eval(), torch.randn(BATCH, 8)
    fixed_order = "capture,shape-prop,build-dag,linearize,split-fixed-order{stages=4},emit,verify"
    for options in (dict(pipeline=fixed_order), dict(cut_before=["blocks.2", "blocks.4"])):
        sharded = autoshard.shard_model(copy.deepcopy(model), 3 if "cut_before" in options else 4, (x,), **options)
        for boundary in range(sharded.num_stages - 1):
            values = {value.name for value in sharded.plan.boundary_values(boundary)}
            assert "embed_shape" in values and "embed" not in values, options


class TransposedInPlaceBetweenReads(nn.Module):
    """Reads a width, transposes the tensor in place, and reads its width again after the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.side = nn.Linear(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, side = self.embed(x), self.side(x)
        before = side.size(-1)
        side.t_()
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return h * before + side.shape[-1]


def test_reads_on_either_side_of_an_in_place_shape_change_see_the_shape_of_their_side():
    """One carrier per stretch between writes; a stage that holds the tensor reads the carrier made
    before a write, not the tensor, which the write has changed by the time the read is recomputed."""
    torch.manual_seed(0)
    model, x = TransposedInPlaceBetweenReads().eval(), torch.randn(BATCH, 8)
    for stages in (1, 2, 4):
        sharded = autoshard.shard_model(copy.deepcopy(model), stages, (x,))  # verified against the model
        with torch.no_grad():
            assert torch.equal(sharded(x[:3]), model(x[:3])), stages


def test_a_value_run_elsewhere_is_placed_where_it_runs():
    """A size each reader recomputes runs nothing where a split puts it (it has no edges): a partition places it
    with its first reader, and the split weighs it there; a check nobody reads runs where the split put it.
    Placing again keeps it; a stage they alone made is kept."""
    import networkx as nx

    from autoshard.graph.partition import Partition, costs_as_placed

    dag = nx.DiGraph()
    dag.add_node("x", cost=0.0, bytes=64.0, input=True)
    for name, reads, extra in (("a", ["x"], {}), ("size", [], {"tensor": False, "readers": ("c", "d")}),  # (reads a)
                               ("check", ["a"], {"tensor": False, "readers": ()}), ("b", ["x"], {}),
                               ("c", ["a"], {}), ("d", ["c"], {})):
        dag.add_node(name, cost=1.0, bytes=64.0, **extra)
        dag.add_edges_from((read, name) for read in reads)
    dag.nodes["b"]["output"] = dag.nodes["d"]["output"] = True
    split = {"x": 0, "a": 0, "size": 2, "check": 2, "b": 1, "c": 1, "d": 2}
    partition = Partition.from_assignment(dag, split, 3)
    assert partition.assignment == {**split, "size": 1}
    assert Partition.from_assignment(dag, partition.assignment, 3) == partition
    alone = {**split, "d": 1, "check": 1}  # stage 2: the size alone
    assert Partition.from_assignment(dag, alone, 3).assignment == alone
    first = {**split, "a": 1, "b": 1, "c": 1}  # stage 0: the model's input and the size
    assert Partition.from_assignment(dag, {**first, "size": 0, "check": 1}, 3).assignment["size"] == 0
    costs = costs_as_placed(dag, {v: 1.0 for v in dag})
    assert (costs["size"], costs["c"], sum(costs.values())) == (0.0, 2.0, 7.0)


def test_a_size_weighs_where_its_partition_places_it():
    """A split weighs a size each reader recomputes with its first reader, where partitions place it: the plan's
    stages cost what the split recorded, within its bound (by node counts the split piled sizes, free to place, in
    one stage, and partitions moved them out: a recorded bottleneck of 5 for stages costing 7 and 2)."""
    torch.manual_seed(0)
    sharded = autoshard.shard_model(SizeAcross(), 2, (torch.randn(2, 8),), cost="nodes")
    info, costs = sharded.plan.split_info, sharded.plan.stage_costs("nodes")
    assert max(costs) == info.bottleneck <= info.bound


def test_the_split_records_the_bottleneck_of_the_stages_as_placed():
    """The split's record is taken of the partition, not of the split's own stages for the sizes (a 3-layer BERT
    by node counts at k = 3 recorded 70 over stages costing at most 62)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100)).eval()
    plan = autoshard.shard_model(model, 3, (torch.randint(0, 100, (2, 8)),), cost="nodes", verify=False).plan
    assert plan.split_info.bottleneck == max(plan.stage_costs("nodes")) <= plan.split_info.bound


def test_a_check_is_not_placed_past_the_stage_the_split_gave_it():
    """A check nobody reads, the last node before a cut, stays in the split's stage: placed with the node after it,
    the value only it reads would cross the boundary for it alone (one value and its bytes more)."""
    import networkx as nx

    from autoshard.graph.partition import Partition, boundary_values

    dag = nx.DiGraph()
    dag.add_node("x", cost=0.0, bytes=64.0, input=True)
    for name, reads, extra in (("a", ["x"], {}), ("ok", ["a"], {}), ("check", ["ok"], {"tensor": False, "readers": ()}),
                               ("b", ["a"], {})):
        dag.add_node(name, cost=1.0, bytes=1.0 if name == "ok" else 64.0, **extra)
        dag.add_edges_from((read, name) for read in reads)
    dag.nodes["b"]["output"] = True
    split = {"x": 0, "a": 0, "ok": 0, "check": 0, "b": 1}
    partition = Partition.from_assignment(dag, split, 2)
    assert partition.assignment == split
    assert boundary_values(dag, partition.assignment, 2) == [["a"]]


class BatchReadAtTheEnd(nn.Module):
    """Divides by its input's batch size after its blocks: torch.export records that read as an operator."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = torch.relu(block(h)) + h
        return h / x.shape[0]


def test_under_torch_export_a_size_read_crosses_as_a_carrier_not_the_tensor():
    torch.manual_seed(0)
    model = BatchReadAtTheEnd().eval()
    sharded = autoshard.shard_model(model, 3, (torch.randn(BATCH, 8),),
                                    pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    for boundary in range(2):  # before: x crossed both boundaries beside the running sum
        assert {v.name: v.nbytes for v in sharded.plan.boundary_values(boundary)}.get("x_shape") == 0
        assert sharded.plan.boundary_bytes()[boundary] == BATCH * 8 * 4
    x = torch.randn(3, 8)
    assert torch.equal(sharded(x), model(x))


class ReadsEachWidth(nn.Module):
    """Each layer reshapes its output by its input's width: a carrier a layer."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h).reshape(-1, h.size(-1))
        return h


def test_the_carriers_facts_are_recorded_in_one_walk_of_the_graph(monkeypatch):
    """Not one walk a carrier (a 24-layer T5's 365 carriers over 4,623 nodes: 1.3 s of its planning, a time that
    grew with the square of the depth), and each carrier has its facts: no bytes."""
    from autoshard.costs.facts import node_facts
    from autoshard.lowering import shape_carriers
    from autoshard.passes import Pipeline
    from autoshard.passes.base import ExampleInputs, ShardProgram

    walks: list[int] = []
    record_facts = shape_carriers.record_facts
    monkeypatch.setattr(shape_carriers, "record_facts", lambda graph, facts: walks.append(len(facts)) or record_facts(
        graph, facts))
    torch.manual_seed(0)
    program = ShardProgram(model=ReadsEachWidth(8), example_inputs=ExampleInputs((torch.randn(BATCH, WIDTH),), {}))
    graph = Pipeline.parse("capture,shape-prop").run(program).program.traced.graph_module.graph
    carriers = [node for node in graph.nodes if node.target is shape_carrier]
    assert len(carriers) == 8 and walks == [2 * len(carriers)]  # each carrier and the read it answers
    assert all(node_facts(carrier).value.nbytes == 0 for carrier in carriers)
