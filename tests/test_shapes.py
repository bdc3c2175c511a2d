"""The shape-prop pass: every value's structure (shape, dtype, bytes, nesting) and FLOPs,
from real or fake tensors, without touching the model or the traced graph it was given."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.costs.facts import node_facts
from autoshard.costs.values import ConstantMeta, StructureMeta, TensorMeta, describe_value
from autoshard.errors import InvalidArgumentError, ShapePropagationError
from autoshard.examples import ResidualMLP, load_example
from autoshard.passes import BuildDagPass, ExampleInputs, Pipeline, TracePass
from autoshard.passes.shapes import ShapePropPass

from conftest import assert_same_fingerprint, model_fingerprint
from autoshard.examples import GPTStyleLM


def propagated(model: nn.Module, *args, mode: str = "auto"):
    pipeline = Pipeline([TracePass(), ShapePropPass(mode=mode), BuildDagPass()])
    return run_pipeline(model, pipeline, ExampleInputs(args)).program


def test_describe_value_keeps_nested_structure_and_sizes():
    value = {"a": torch.zeros(2, 3), "b": (torch.ones(4, dtype=torch.int64), 7, None), "c": [torch.Size([5, 6])]}
    meta = describe_value(value)
    assert isinstance(meta, StructureMeta) and meta.kind == "dict" and meta.keys == ("a", "b", "c")
    assert meta.items[0] == TensorMeta((2, 3), "float32", 24)
    inner = meta.items[1]
    assert inner.kind == "tuple" and inner.items[0] == TensorMeta((4,), "int64", 32)
    assert inner.items[1] == ConstantMeta("int", "7") and inner.items[2] == ConstantMeta("NoneType", "None")
    assert isinstance(meta.items[2].items[0], ConstantMeta)  # a shape is a constant, not a tuple of ints
    assert meta.nbytes == 24 + 32 and meta.has_tensor
    assert not describe_value((1, None)).has_tensor
    assert str(meta.items[0]) == "float32[2, 3]"


def test_every_value_has_its_real_shape_dtype_and_bytes():
    model, args, _ = load_example("transformer-lm")
    program = propagated(model, *args)
    gm = program.traced.graph_module
    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n.name] = result = super().run_node(n)
            return result

    Recorder(gm).run(*args)
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        facts = node_facts(node)
        assert facts.value == describe_value(values[node.name]), node.name
        assert program.dag.nodes[node.name]["bytes"] == facts.value.nbytes
        assert program.dag.nodes[node.name]["tensor"] == facts.value.has_tensor
    assert program.dag.nodes["src"]["value_meta"] == TensorMeta((12, 3), "int64", 12 * 3 * 8)


def test_fake_and_real_runs_record_the_same_facts():
    torch.manual_seed(0)
    model = GPTStyleLM()
    idx = torch.randint(0, 100, (2, 8))
    real = propagated(model, idx, mode="real").traced.graph_module
    fake = propagated(model, idx, mode="fake").traced.graph_module
    real_facts = {n.name: node_facts(n) for n in real.graph.nodes if n.op not in ("get_attr", "output")}
    fake_facts = {n.name: node_facts(n) for n in fake.graph.nodes if n.op not in ("get_attr", "output")}
    assert real_facts == fake_facts
    assert sum(f.flops for f in real_facts.values()) > 0


def test_the_given_traced_graph_and_the_model_are_left_alone():
    model = ResidualMLP()
    x = torch.randn(2, 16)
    before = model_fingerprint(model)
    traced = run_pipeline(model, Pipeline([TracePass()]), ExampleInputs((x,))).program
    after = Pipeline([ShapePropPass()]).run(traced).program
    assert after.traced.graph_module is not traced.traced.graph_module
    assert all(node_facts(n) is None for n in traced.traced.graph_module.graph.nodes)
    assert dict(after.traced.graph_module.named_parameters()) == dict(model.named_parameters())
    assert_same_fingerprint(before, model_fingerprint(model))


class ChecksValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum() > 0 else -x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ChecksValues()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def test_fake_tensors_cannot_run_control_flow_on_values_and_say_what_to_do():
    with torch.device("meta"):
        model = Outer()
    with pytest.raises(ShapePropagationError, match=r"node 'inner'.*mode=real"):
        propagated(model, torch.randn(2, 4))


def test_real_tensors_are_refused_for_a_meta_model():
    with torch.device("meta"):
        model = ResidualMLP()
    with pytest.raises(InvalidArgumentError, match="meta device"):
        propagated(model, torch.randn(2, 16), mode="real")


def test_real_mode_runs_through_control_flow_that_reads_values():
    program = propagated(Outer(), torch.ones(2, 4))
    assert program.dag.nodes["inner"]["value_meta"] == TensorMeta((2, 4), "float32", 32)
    assert program.dag.nodes["inner"]["flops"] == 2 * 2 * 4 * 4


def test_allocated_bytes_count_new_memory_only():
    from autoshard.costs.values import allocated_bytes

    x = torch.randn(4, 4)
    assert allocated_bytes(x.view(16), (x,)) == 0
    assert allocated_bytes(x + 1, (x,)) == 64
    fresh = torch.randn(4, 6)
    assert allocated_bytes(fresh.split(2, dim=1), (x,)) == 96  # three views of one new storage
    assert allocated_bytes((x, 3), ((x,), {})) == 0


def test_views_allocate_nothing_in_the_dag():
    torch.manual_seed(0)
    program = propagated(GPTStyleLM(), torch.randint(0, 100, (2, 8)))
    dag = program.dag
    views = [n for n, d in dag.nodes(data=True) if d["target"] in ("view", "transpose", "split")]
    assert views and all(dag.nodes[n]["allocated"] == 0 for n in views)
    assert dag.nodes["lm_head"]["allocated"] == dag.nodes["lm_head"]["bytes"] == 2 * 8 * 100 * 4


class PassesThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.same, self.drop = nn.Linear(4, 4), nn.Identity(), nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.same(self.lin(x)))
        return h.view(2, 2, 4) + torch.rand_like(h).view(2, 2, 4)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_facts_say_which_values_share_their_inputs_memory_and_which_draw(mode):
    program = propagated(PassesThrough().eval(), torch.randn(4, 4), mode=mode)
    facts = {n.name: node_facts(n) for n in program.traced.graph_module.graph.nodes if node_facts(n)}
    assert [name for name, f in facts.items() if f.aliases_input] == ["same", "drop", "view", "view_1"]
    # only a real run moves the generator; with fake tensors the operator itself says it (lowering.randomness)
    assert [name for name, f in facts.items() if f.draws_random] == (["rand_like"] if mode == "real" else [])


class SparseGraphConv(nn.Module):
    """Two graph convolutions over a sparse adjacency matrix, which every stage reads."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, adjacency: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.sparse.mm(adjacency, torch.relu(self.first(x)))
        return self.out(torch.sparse.mm(adjacency, torch.relu(self.second(h))))


def random_adjacency(n: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.randint(0, n, (2, 3 * n)), torch.rand(3 * n), (n, n)).coalesce()


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_inputs_are_propagated_and_served_at_other_sizes(layout):
    torch.manual_seed(0)
    model = SparseGraphConv()

    def sparse(n: int) -> torch.Tensor:
        return random_adjacency(n) if layout == "coo" else random_adjacency(n).to_sparse_csr()

    sharded = autoshard.shard_model(model, 3, example_inputs=(sparse(6), torch.randn(6, 8)))
    adjacency, x = sparse(11), torch.randn(11, 8)
    assert torch.equal(sharded(adjacency, x), model(adjacency, x))
