"""The training-memory probe (``costs.saved``): nodes that run the same thing on the same layouts
are probed once (``costs.probe_memo``), with the facts probing each on its own gives; a module
called twice is probed both times."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import operator
from typing import Callable, Iterator

import pytest
import torch
from torch import nn

import autoshard
from autoshard.capture import capture
from autoshard.costs import propagation, saved
from autoshard.costs.saved import TrainingProbe
from autoshard.inputs import ExampleInputs
from autoshard.runtime import measure_stage_memory


class Block(nn.Module):
    """A residual block that calls its one activation twice, reshapes through views and writes in place."""

    def __init__(self, width: int, frozen: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm, self.act = nn.LayerNorm(width), nn.GELU()
        self.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(self.norm(x)))
        h = self.act(self.down(h)).transpose(0, 1).contiguous().transpose(0, 1)
        return (x + h).mul_(0.5)


class Stack(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        # Two blocks alike, one frozen (its backward makes no weight gradients), and two alike again
        self.blocks = nn.Sequential(Block(width), Block(width), Block(width, frozen=True), Block(width), Block(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).sum(-1)


def probed(gm, example: torch.Tensor | tuple, monkeypatch: pytest.MonkeyPatch, memo: bool) -> tuple[dict, list[str]]:
    """Every node's training facts and the nodes the probe ran (rather than applied from its memo);
    ``example``: the one input, or a tuple of them."""
    ran: list[str] = []

    class Counting(TrainingProbe):
        def _probe(self, call, args, kwargs, arguments, layouts=None):
            # not a backward probed again from the gradient its consumers give, nor a node probed again
            # with its non-contiguous inputs contiguous
            if layouts is None and call.node.name not in ran:
                ran.append(call.node.name)
            return super()._probe(call, args, kwargs, arguments, layouts)

    monkeypatch.setattr(propagation, "TrainingProbe", functools.partial(Counting, memo=memo))
    facts = propagation.propagate(gm, ExampleInputs(example if isinstance(example, tuple) else (example,)))
    return {name: f.training for name, f in facts.items()}, ran


def test_alike_nodes_are_probed_once_and_get_the_facts_a_probe_of_each_gives(monkeypatch):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 6, 16)
    gm = capture(model, (x,), {}).graph_module
    remembered, ran_once = probed(gm, x, monkeypatch, memo=True)
    each, ran_each = probed(gm, x, monkeypatch, memo=False)
    assert remembered == each
    assert len(ran_each) == sum(node.op in ("call_module", "call_function", "call_method") for node in gm.graph.nodes)
    per_block = len(ran_each) // 5
    # The first block is probed, and the frozen one (its weights want no gradient); the rest are applied
    assert len(ran_once) < 3 * per_block
    frozen = [name for name in each if name.startswith("blocks_2_up")]
    trained = [name for name in each if name.startswith("blocks_1_up")]
    assert frozen and trained and each[frozen[0]].backward < each[trained[0]].backward


def test_a_module_called_twice_is_probed_both_times(monkeypatch):
    """``MemTracker`` refuses a module it saw run before; the second call of a block's one activation
    was left unprobed (zeros) until the tracker's module records were cleared before each node."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 6, 16)
    gm = capture(model, (x,), {}).graph_module
    facts, _ = probed(gm, x, monkeypatch, memo=False)
    output = 4 * 6 * 16 * 4  # bytes of the second call's output, and of what it keeps: its input
    second = facts["blocks_0_act_1"]
    assert second.grad == output and second.backward > 0
    assert second.releases == (("blocks_0_down", output),)  # GELU keeps its input, made by `down`
    assert facts["blocks_0_down"].saved == output


class AfterLinear(nn.Module):
    """A linear, then ``then`` of its output."""

    def __init__(self, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin, self.then = nn.Linear(16, 16), then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.lin(x))


def written_into_zeros(h: torch.Tensor) -> torch.Tensor:
    """An in-place write into a tensor that wants no gradient makes it want one (found by review)."""
    buffer = torch.zeros_like(h)
    buffer.add_(h)
    return buffer * 2


def test_the_probe_records_the_storage_a_view_lives_in_and_the_gradients_handed_on(monkeypatch):
    """What the memory model's backward walk and sent bytes read: a view's or an in-place write's
    storage is the node that made it; a view's and an addition's backward hand the gradient on
    (no new buffer), a linear's makes one, and an input given twice gets a sum (a new one)."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 6, 16)
    gm = capture(model, (x,), {}).graph_module
    facts, _ = probed(gm, x, monkeypatch, memo=True)
    assert facts["transpose"].views == "blocks_0_act_1" and facts["mul_"].views == "add"
    assert facts["contiguous"].views is None  # a storage of its own
    assert facts["transpose"].input_grads == (("blocks_0_act_1", True),)
    assert facts["blocks_0_up"].input_grads == (("blocks_0_norm", False),)
    second = next(n for n in gm.graph.nodes if n.name.startswith("add") and n.name != "add")  # x + h, both trained
    assert facts[second.name].input_grads == tuple((a.name, True) for a in second.all_input_nodes)
    square = capture(AfterLinear(lambda h: h * h), (x,), {}).graph_module
    product = next(n for n in square.graph.nodes if n.target is operator.mul)
    assert probed(square, x, monkeypatch, memo=True)[0][product.name].input_grads == (("lin", False),)


class ChannelsLast(nn.Module):
    """Two convolutions alike but for the weight's memory format, which the output's follows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3), nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.a(x), 1).sum(-1) + torch.flatten(self.b(x), 1).sum(-1)


class SharedScale(nn.Module):
    """Two modules kept whole that save one tensor held outside their registries."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class TwoScales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, scale = nn.Linear(64, 64), torch.randn(64)
        self.s, self.t = SharedScale(scale), SharedScale(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.s(h) + self.t(h * 2)


@pytest.mark.parametrize("model, example", [
    (nn.Sequential(AfterLinear(written_into_zeros), AfterLinear(written_into_zeros)), (4, 16)),
    (ChannelsLast(), (2, 4, 8, 8)),
])
def test_nodes_that_look_alike_but_probe_differently_are_not_applied_from_the_memo(model, example, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(*example)
    gm = capture(model, (x,), {}).graph_module
    assert probed(gm, x, monkeypatch, memo=True)[0] == probed(gm, x, monkeypatch, memo=False)[0]


def test_a_tensor_no_node_made_is_charged_once_to_the_first_node_that_saves_it(monkeypatch):
    class Tracer(torch.fx.Tracer):  # SharedScale kept whole, as a module capture cannot trace would be
        def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
            return isinstance(m, SharedScale) or super().is_leaf_module(m, qualified_name)

    torch.manual_seed(0)
    model, x = TwoScales(), torch.randn(4, 64)
    gm = torch.fx.GraphModule(model, Tracer().trace(model))
    for memo in (True, False):
        facts, _ = probed(gm, x, monkeypatch, memo=memo)
        assert (facts["s"].saved, facts["t"].saved) == (64 * 4, 0)


class MaskedPositions(nn.Module):
    """Sizes, positions, a frozen embedding and a mask: nodes whose arguments want no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.pos = nn.Linear(16, 16), nn.Embedding(8, 16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x[..., 0] > 0).unsqueeze(-1).expand(-1, -1, 16)
        h = self.lin(x + self.pos(torch.arange(x.size(1))))
        return h.masked_fill(~mask, 0.0).sum()


def test_nodes_no_gradient_reaches_are_read_off_the_run_with_the_facts_a_probe_gives(monkeypatch):
    """Autograd records nothing of a torch function, tensor method or weightless ``torch.nn`` module
    whose arguments want no gradient: its facts come from shape propagation's run, not a probe. Probed
    (``memo=False``), the frozen embedding left a callback ``MemTracker`` ran in the next node's
    backward, which then failed (the linear's backward peak read 0) until the probe dropped it."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    gm = capture(MaskedPositions(), (x,), {}).graph_module
    (read, probed_read), (each, _) = (probed(gm, x, monkeypatch, memo=memo) for memo in (True, False))
    assert read == each
    targets = {node.name: node.target for node in gm.graph.nodes}
    assert {targets[name] for name in probed_read} == {"lin", "masked_fill", "sum"}
    assert each["pos"].grad == each["pos"].backward == each["pos"].saved == 0


class SizesRead(nn.Module):
    """Sizes and a shape read off a slice of an activation that wants a gradient, to reshape it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lin2 = nn.Linear(16, 32), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        q = h[..., :16]
        batch, tokens, width = q.size(0), q.shape[1], q.size(-1)
        return self.lin2(q.reshape(batch, tokens * 2, width // 2)).sum()


def test_a_size_read_off_a_tensor_that_wants_a_gradient_is_read_off_the_run(monkeypatch):
    """A size or a shape read off an activation: autograd records nothing of it
    whether or not the tensor wants a gradient, so it is not probed (nor probed again with the slice
    contiguous), and its facts are those a probe gives."""
    x = torch.randn(2, 4, 16)
    gm = capture(SizesRead(), (x,), {}).graph_module
    (read, probed_read), (each, _) = (probed(gm, x, monkeypatch, memo=memo) for memo in (True, False))
    assert read == each
    metadata = {node.name for node in gm.graph.nodes if node.target in ("size", getattr)}
    assert len(metadata) == 3 and not metadata & set(probed_read)
    assert all(each[name].saved == each[name].backward == each[name].grad == 0 for name in metadata)


class WrittenThrough(nn.Module):
    """``out[:] = h``: a function that returns None and makes its argument want a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        out[:, :] = self.lin(x)
        return self.lin2(out)


class Routed(nn.Module):
    """Two experts given the rows two masks of one layout pick: 2 rows, then 14."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return self.experts[0](x[torch.where(first)[1]]).sum() + self.experts[1](x[torch.where(second)[1]]).sum()


class Conjugated(nn.Module):
    """A conjugate view, then ``resolve_conj``, which copies it (a plain tensor it would return as is)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.view_as_real(z.conj().resolve_conj()).flatten(1))


@dataclasses.dataclass
class Hidden:
    hidden: torch.Tensor


class KeptWhole(nn.Module):
    """A grad-mode block keeps this module whole; it returns its tensor inside a plain dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> Hidden:
        with torch.no_grad():
            self.seen = (x * 0).sum()
        return Hidden(self.lin(x))


class ReadsAField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = KeptWhole(), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).hidden)


def _routed_inputs() -> tuple:
    first, second = torch.zeros(1, 16, dtype=torch.bool), torch.zeros(1, 16, dtype=torch.bool)
    first[0, :2], second[0, 2:] = True, True
    return torch.randn(16, 16), first, second


@pytest.mark.parametrize("model, inputs, compared", [
    (WrittenThrough, lambda: (torch.randn(4, 8),), ("lin2",)),
    (Routed, _routed_inputs, ("experts_0", "experts_1")),
    (Conjugated, lambda: (torch.randn(8, 32, dtype=torch.complex64),), ("resolve_conj", "lin")),
    (ReadsAField, lambda: (torch.randn(32, 64),), ("head",)),
])
def test_what_the_run_cannot_tell_is_probed(model, inputs, compared, monkeypatch):
    """Found by review: an in-place write through a function returning None, outputs whose shape
    depends on values (not memoised by a key of layouts), a conjugate view (a replay makes plain
    tensors) and a tensor inside an object pytree does not open are not read off the run."""
    torch.manual_seed(0)
    example = inputs()
    gm = capture(model(), example, {}).graph_module
    read, each = (probed(gm, example, monkeypatch, memo=memo)[0] for memo in (True, False))
    assert [read[name] for name in compared] == [each[name] for name in compared]


def test_a_graph_that_starts_with_a_computation_is_probed():
    """No placeholder or weight first: the probe's fake mode is chosen at the first node, whatever it is."""
    root = nn.Module()
    root.lin = nn.Linear(8, 8)
    graph = torch.fx.Graph()
    graph.output(graph.call_module("lin", (graph.call_function(torch.arange, (8,), {"dtype": torch.float32}),)))
    facts = propagation.propagate(torch.fx.GraphModule(root, graph), ExampleInputs(()))
    assert facts["arange"].training.saved == 8 * 4 and facts["lin"].training.grad == 8 * 4


class _Smooth(nn.Module):
    """Keeps its last output for the next call, and is kept whole (fx cannot iterate a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.prev = nn.Linear(32, 32), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.stack([self.lin(row) for row in x.transpose(0, 1)], 1)
        if self.prev is not None and self.prev.shape == y.shape:
            y = y + 0.1 * self.prev
        self.prev = y.detach()
        return y


class _SmoothedThenTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.smooth, self.out = _Smooth(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.smooth(x).transpose(1, 2))


def test_a_module_probed_again_from_its_consumers_gradient_leaves_the_model_as_it_was():
    """Its consumer hands it a transposed gradient, so its backward is probed again once every node
    has run: inside the run, whose isolation sets back what the forward stored (a re-probe after it
    once left a fake tensor on the module, and the model's next call failed)."""
    model = _SmoothedThenTransposed()
    x = torch.randn(4, 16, 32)
    autoshard.shard_model(model, 2, example_inputs=(x,))
    assert model.smooth.prev is None
    assert torch.isfinite(model(x)).all()


def test_a_cyclic_collection_as_a_backward_is_measured_changes_no_fact(monkeypatch):
    """What an earlier node's probe left in a reference cycle (an output its own backward saves) is freed
    whenever the collector runs, which depends on what the process ran before: one collection just
    before each backward is measured must leave every node's facts as they were (it once raised the
    peak of nodes whose backward makes nothing by the garbage's bytes, and a plan differed in CI)."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 6, 16)
    gm = capture(model, (x,), {}).graph_module
    undisturbed, _ = probed(gm, x, monkeypatch, memo=True)
    off = saved.without_cyclic_gc

    @contextlib.contextmanager
    def collected_first() -> Iterator[None]:
        if gc.isenabled():
            gc.collect()  # as an allocation may start one
        with off():
            yield

    monkeypatch.setattr(saved, "without_cyclic_gc", collected_first)
    gc.freeze()  # what the process made before (other tests' objects) is not scanned: the probe's garbage is
    try:
        collected, _ = probed(gm, x, monkeypatch, memo=True)
    finally:
        gc.unfreeze()
    assert collected == undisturbed


class _GroupedExperts(nn.Module):
    """Experts as one grouped matrix product, as Mixtral's: its fake kernel wants bf16, the real one runs fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)
        self.experts = nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
        return self.down(torch.nn.functional.grouped_mm(self.up(x), self.experts, offs=offsets))


def test_a_kernel_fake_tensors_cannot_run_is_probed_on_real_tensors_without_logging_its_failure(caplog):
    """FakeTensorMode logs each kernel it cannot run, traceback and all, before it raises (88 lines of
    ERROR on a tiny Mixtral): the probe runs such a node on real tensors instead, so the failure is
    its own to handle and the stage's memory is exact."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    torch_log = logging.getLogger("torch")
    torch_log.addHandler(caplog.handler)  # torch's loggers do not propagate to the root
    try:
        sharded = autoshard.shard_model(_GroupedExperts(), 2, example_inputs=(x,))
    finally:
        torch_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    report = autoshard.plan_report(sharded)
    assert "not measured" not in str(report)
    for j in range(2):
        assert report.stages[j].memory.total == measure_stage_memory(sharded, j, (x,)).peak


class _WritesIntoActivations(nn.Module):
    """Linears each followed by a write into its result: ``nn.ReLU(inplace=True)``, or ``y.tanh_()`` /
    ``y.mul_(scale)`` / ``y[:, 0] = 0`` whose result nothing reads (the residual reads ``y``)."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write = write
        self.lin = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.act = nn.ReLU(inplace=True)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lin:
            y = lin(x)
            if self.write == "relu":
                y = self.act(y)
            elif self.write == "tanh_":
                y.tanh_()
            elif self.write == "mul_":
                y.mul_(self.scale).tanh_()
            else:
                y[:, 0] = 0.0
            x = x + y
        return x


@pytest.mark.parametrize("write", ["relu", "tanh_", "mul_", "setitem"])
@pytest.mark.parametrize("shape", [(4, 16, 32), (64, 32)])
def test_a_write_into_an_activation_counts_the_gradient_its_backward_makes(write, shape):
    """An in-place op's backward makes a new gradient, though the probe's clone it wrote into handed its
    own on (``y.tanh_()`` whose result nothing reads: 0.65x-0.71x); and a Linear on a 3-D input returns
    a view of its ``addmm``, so a write into it makes autograd copy the base's gradient in backward
    (``CopySlices``), which a write into a dense clone does not (``nn.ReLU(inplace=True)``: 0.77x)."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    sharded = autoshard.shard_model(_WritesIntoActivations(write).train(), 2, example_inputs=(x,))
    report = autoshard.plan_report(sharded)
    for j in range(2):
        assert report.stages[j].memory.total == measure_stage_memory(sharded, j, (x,)).peak, j


def test_a_parametrization_handed_its_weights_is_probed_under_the_flop_counter():
    """``weight_norm``'s parametrization is handed its two weights as arguments; the FLOP counter open
    during shape propagation hooked them (its ``ModuleTracker``), and the probe's ``autograd.grad`` over
    them failed in that hook: the node's backward went unprobed, its weights' gradients uncounted
    (stage 0 at 0.735 of what it held)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.utils.parametrizations.weight_norm(nn.Linear(32, 32)) for _ in range(4))).train()
    x = torch.randn(16, 32)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
    weight_norms = [facts for node, facts in sharded.plan.dag.nodes(data="training") if "parametrizations" in node]
    assert len(weight_norms) == 4 and all(facts.input_grads is not None for facts in weight_norms)
    report = autoshard.plan_report(sharded)
    for j in range(2):
        assert report.stages[j].memory.total == measure_stage_memory(sharded, j, (x,)).peak, j


class Recurrent(nn.Module):
    """A linear, a 2-layer GRU (its kernels run once a step) and a linear on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.post = nn.Linear(16, 32), nn.Linear(32, 8)
        self.gru = nn.GRU(32, 32, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.gru(self.pre(x))
        return self.post(y)


def test_a_node_running_many_kernels_is_probed_on_real_tensors_with_the_facts_fake_ones_give(monkeypatch):
    """The GRU runs 244 kernels on 8 steps; on fake tensors, each costing milliseconds forward and
    backward and probed twice (its consumer's gradient comes laid out otherwise), planning it took
    10 s at 8 steps and 25-39 s at 32. It is probed once, on shape propagation's real tensors, and
    every fact is the one the fake probe gives."""
    runs: list[tuple[str, bool]] = []

    class Recording(TrainingProbe):
        def _probe(self, call, args, kwargs, arguments, layouts=None, real=False):
            runs.append((call.node.name, real))
            return super()._probe(call, args, kwargs, arguments, layouts, real)

    monkeypatch.setattr(propagation, "TrainingProbe", Recording)
    torch.manual_seed(0)
    x = torch.randn(8, 8, 16)
    gm = capture(Recurrent().train(), (x,), {}).graph_module
    on_real = propagation.propagate(gm, ExampleInputs((x,)))
    assert [real for name, real in runs if name == "gru"] == [True]
    assert all(not real for name, real in runs if name != "gru")
    runs.clear()
    monkeypatch.setattr(saved, "REAL_PROBE_KERNELS", 10**9)
    on_fake = propagation.propagate(gm, ExampleInputs((x,)))
    assert [real for name, real in runs if name == "gru"] == [False, False]  # and again from its consumer's layout
    assert on_real == on_fake and on_real["gru"].training.saved > 0


def test_a_module_probed_on_real_tensors_has_its_own_state_set_back_not_the_whole_graphs(monkeypatch):
    """Isolating the whole graph module once per node probed on real tensors took time growing with nodes x
    modules (MobileViT's 32 batch norms over 315 modules: 0.6 s of 4.7 s of planning); the module's own state
    is all its run changes, and ``isolated`` sets it back, with what it holds outside its tree."""
    isolated_modules: list[nn.Module] = []
    isolated = saved.isolated

    def recording(model: nn.Module, seed: int | None = 0):
        isolated_modules.append(model)
        return isolated(model, seed)

    monkeypatch.setattr(saved, "isolated", recording)
    torch.manual_seed(0)
    x = torch.randn(8, 8, 16)
    gm = capture(Recurrent().train(), (x,), {}).graph_module
    facts = propagation.propagate(gm, ExampleInputs((x,)))
    assert isolated_modules == [gm.gru] and facts["gru"].training.saved > 0
