"""Random draws stay in the model's order across stages, so a model in training mode, dropout on
parallel branches included, shards exactly (``autoshard.lowering.randomness``)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import Framed
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.capture import trace_with_leaves
from autoshard.capture.host_random import HostRandomnessWarning
from autoshard.lowering.randomness import draws_random
from autoshard.passes import Pipeline
from autoshard.passes.base import ExampleInputs


class AuxiliaryHead(nn.Module):
    """GoogLeNet's shape: an auxiliary head with its own dropout branches off the trunk before the
    trunk's dropout; nothing orders the two draws but the model's code. The head widens its
    input, so a split that ignored the draws' order would run it last (sending its narrow input
    rather than its wide output), after the trunk's draw."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.trunk = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), *(nn.Linear(64, 64) for _ in range(5)))
        self.drop = nn.Dropout(0.5)
        self.out = nn.Sequential(*(nn.Linear(8, 8) for _ in range(8)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.stem(x)
        aux = self.head(h)
        return self.out(self.drop(self.trunk(h))), aux


def _seeded(fn, x):
    torch.manual_seed(7)
    return fn(x)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("pipeline", [None, "trace,shape-prop,build-dag,linearize,split,emit,verify",
                                      "export,shape-prop,build-dag,linearize,split,emit,verify"],
                         ids=["auto", "fx", "export"])
def test_training_mode_dropout_on_parallel_branches_shards_exactly(k, pipeline):
    model = AuxiliaryHead().train()
    sharded = autoshard.shard_model(model, k, example_inputs=(torch.randn(2, 8),), cost="nodes", pipeline=pipeline)
    x = torch.randn(3, 8)
    expected, got = _seeded(model, x), _seeded(sharded, x)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _dag(model, pipeline="capture,shape-prop,build-dag"):
    return run_pipeline(model, Pipeline.parse(pipeline), ExampleInputs((torch.randn(2, 8),), {})).program.dag


def test_the_head_is_ordered_before_the_trunks_draw_through_its_cheapest_value():
    dag = _dag(AuxiliaryHead().train())
    # head_6 (the head's last value) is a model output: it reaches the trunk's stage anyway,
    # where the head's draw itself (head_1) would have to be sent there for the edge alone
    assert dag.has_edge("head_6", "drop")
    assert not dag.has_edge("head_1", "drop")


def test_draws_on_one_path_add_no_edge():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5)).train()
    dag = _dag(model)
    assert dag.number_of_edges() == 4  # x -> 0 -> 1 -> 2 -> 3 and nothing else


def test_eval_mode_adds_no_edge():
    assert not _dag(AuxiliaryHead().eval()).has_edge("head_6", "drop")


class DrawsInsideALeaf(nn.Module):
    """``F.dropout`` inside a module kept whole (its condition reads a tensor's value): only the
    run shows that the module draws."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.abs().sum() > 0:
            h = nn.functional.dropout(h, 0.5, self.training)
        return h


class LeafAndTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf, self.trunk = DrawsInsideALeaf(), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.leaf(x), self.trunk(x)


def test_a_leaf_that_draws_is_found_by_the_run():
    model = LeafAndTrunk().train()
    program = run_pipeline(model, Pipeline.parse("trace,shape-prop,build-dag"),
                           ExampleInputs((torch.randn(2, 8),), {})).program
    gm = program.traced.graph_module
    leaf = next(n for n in gm.graph.nodes if n.target == "leaf")
    assert leaf.op == "call_module" and draws_random(gm, leaf)
    assert program.dag.has_edge("leaf", "trunk_1")


@pytest.mark.parametrize("code, random", [
    (lambda x: torch.nn.functional.dropout(x, 0.5), True),
    (lambda x: x + torch.rand_like(x), True),
    (lambda x: torch.empty_like(x).bernoulli_(0.5) * x, True),
    (lambda x: torch.nn.functional.dropout2d(x, 0.5), True),
    (lambda x: torch.relu(x) + x.sum(), False),
], ids=["dropout", "rand_like", "bernoulli_", "dropout2d", "relu"])
def test_random_operators_are_known_without_a_run(code, random):
    class Code(nn.Module):
        def forward(self, x):
            return code(x)
    dag_pipeline = "trace,build-dag"  # no shape-prop: the operators alone say it
    program = run_pipeline(Code(), Pipeline.parse(dag_pipeline), ExampleInputs((torch.randn(2, 8, 4, 4),), {})).program
    gm = program.traced.graph_module
    assert any(draws_random(gm, n) for n in gm.graph.nodes) is random


class SkipsLayersWithPythonRandom(nn.Module):
    """x-transformers' layer dropout: Python's ``random()`` decides which layers run."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and random.random() < 0.5:
                continue
            x = layer(x)
        return x


def test_a_capture_that_draws_from_pythons_random_warns_and_leaves_the_generator_where_it_was():
    model = SkipsLayersWithPythonRandom().train()
    random.seed(3)
    expected_next = random.random()
    random.seed(3)
    with pytest.warns(HostRandomnessWarning, match="drew from Python's random while it was captured"):
        trace_with_leaves(model, (torch.randn(2, 8),))
    assert random.random() == expected_next


def test_a_capture_that_draws_nothing_from_the_host_does_not_warn(recwarn):
    trace_with_leaves(SkipsLayersWithPythonRandom().eval(), (torch.randn(2, 8),))
    assert not [w for w in recwarn if issubclass(w.category, HostRandomnessWarning)]


def pick_layers(layers: nn.ModuleList, p: float) -> list[nn.Module]:
    """Layer dropout as vit-pytorch's CaiT writes it: a torch draw chooses the layers to run."""
    dropped = torch.zeros(len(layers)).uniform_(0.0, 1.0) < p
    if all(dropped):
        dropped[0] = False
    return [layer for layer, drop in zip(layers, dropped) if not drop]


class DrawnLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in pick_layers(self.layers, 0.5):
            x = layer(x) + x
        return x


class DrawnMask(nn.Module):
    """The same written inline: the draw has no traced argument, so it ran for real while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(len(self.layers)).uniform_(0.0, 1.0) >= 0.5
        for layer, kept in zip(self.layers, keep):
            if kept:
                x = layer(x) + x
        return x


@pytest.mark.parametrize("inner", [DrawnLayers, DrawnMask])
@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_a_draw_that_steers_python_keeps_its_module_whole_and_draws_anew_each_call(inner, front_end):
    torch.manual_seed(0)
    model = Framed(inner()).train()
    sharded = autoshard.shard_model(model, 3, example_inputs=(torch.randn(2, 8),),
                                    pipeline=f"{front_end},shape-prop,build-dag,linearize,split,emit,verify")
    assert "inner" in [w.name for w in sharded.plan.wrapped]
    for seed in range(8):  # the example's draw would fix one subset of layers for every call
        x = torch.randn(3, 8)
        torch.manual_seed(seed)
        got = sharded(x)
        torch.manual_seed(seed)
        assert torch.equal(got, model(x))


def test_a_draw_steering_the_top_level_forward_is_refused_not_frozen():
    with pytest.raises(autoshard.errors.TraceError, match="draws random numbers"):
        autoshard.shard_model(DrawnMask().train(), 2, example_inputs=(torch.randn(2, 8),))


class OwnGenerator(nn.Module):
    """Draws its noise from a generator of its own, not torch's global one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.noise = torch.Generator().manual_seed(123)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + torch.randn(h.shape, generator=self.noise))


def test_a_modules_own_generator_is_left_where_it_was_and_the_stages_draw_from_it():
    model = OwnGenerator()
    state = model.noise.get_state()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))  # verified: each run drew alike
    assert torch.equal(model.noise.get_state(), state)
    x = torch.randn(3, 8)
    got = sharded(x)
    assert not torch.equal(model.noise.get_state(), state)  # the stages drew from the model's generator
    model.noise.set_state(state)
    assert torch.equal(got, model(x))


class NoiseFromArgument(nn.Module):
    """Draws its noise from a generator the call passes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + torch.randn(h.shape, generator=generator))


def test_a_generator_passed_in_is_left_where_it_was_by_planning_and_drawn_from_by_the_stages():
    """Planning's runs drew from it (the trace, the checks), so without verification the stages drew further along
    it than the model, silently; with it, the graph and the model drew different numbers and it was refused (a
    helper probe). Another generator object is another constant: captured again."""
    torch.manual_seed(0)
    model, x = NoiseFromArgument(), torch.randn(3, 8)
    generator = torch.Generator().manual_seed(3)
    for verify in (False, True):
        state = generator.get_state()
        sharded = autoshard.shard_model(model, 2, example_inputs=(x, generator), verify=verify)
        assert torch.equal(generator.get_state(), state)
        got = sharded(x, generator)
        assert torch.equal(got, model(x, torch.Generator().manual_seed(3).set_state(state)))
        generator.set_state(state)
    other = torch.Generator().manual_seed(7)
    assert torch.equal(sharded(x, other), model(x, torch.Generator().manual_seed(7)))
    assert len(sharded.specializations) == 1


class SeedsInABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)  # as a test harness might, to make its dropout repeatable
        return nn.functional.dropout(self.b(torch.tanh(self.a(x))), 0.5, True)


class SeedsAtTheTop(SeedsInABlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        torch.manual_seed(123)
        return self.b(nn.functional.dropout(h, 0.5, True))


def test_seeding_in_the_forward_is_kept_whole_or_refused_even_unverified():
    """The graph did not seed the generator, so its dropout drew other numbers than the model's, silently without
    verification (a helper probe). Code that seeds is kept whole; in the top-level forward, which cannot be, no
    front end captures the model as it computes, which is refused without the verify pass too."""
    x = torch.randn(3, 8)
    inner = nn.Sequential(nn.Linear(8, 8), SeedsInABlock(), nn.Linear(8, 8))
    sharded = autoshard.shard_model(inner, 2, example_inputs=(x,), verify=False)
    assert "1" in {w.name for w in sharded.plan.wrapped}  # the seeding block, kept whole
    assert torch.equal(sharded(x), inner(x))
    with pytest.raises(autoshard.VerificationError, match="differs from the model on the example.*no front end"):
        autoshard.shard_model(SeedsAtTheTop(), 2, example_inputs=(x,), verify=False)
