"""A check on the inputs' sizes runs as early as what it reads allows (``capture.check_order``), so a call it
refuses has computed nothing: in training mode, one on another plan updates batch-norm statistics once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.capture.guard import CHECK_SITE_ARGUMENT, check_condition
from autoshard.errors import SpecializationMismatch
from autoshard.specialize import rerun_of
from test_step_prediction import NormThenBranch


def _checks(stage: nn.Module) -> list[str]:
    return [node.name for node in stage.graph.nodes if node.target in CHECK_SITE_ARGUMENT]


def _first_compute(stage: nn.Module) -> int:
    return next(i for i, node in enumerate(stage.graph.nodes) if node.op == "call_module")


def _position(stage: nn.Module, name: str) -> int:
    return next(i for i, node in enumerate(stage.graph.nodes) if node.name == name)


def _served_as_the_model(model: nn.Module, example: torch.Tensor, call: torch.Tensor,
                         **options: object) -> autoshard.ShardedModel:
    """Shard ``model`` in training mode for ``example``, call it on ``call``, and check the output and the
    batch-norm statistics against the model's own call."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (example,), **options)
    assert torch.equal(sharded(call), reference(call))
    for mine, theirs in zip(model.buffers(), reference.buffers()):
        assert torch.equal(mine, theirs)  # updated once, as by the model's call
    return sharded


def test_a_branch_on_the_inputs_size_after_a_batch_norm_is_checked_first_and_served_in_training_mode():
    """The check sat in stage 1, after stage 0's batch norm had run: another batch size was refused
    (the statistics would have moved twice), and the input crossed the boundary for the check alone."""
    torch.manual_seed(0)
    sharded = _served_as_the_model(NormThenBranch().train(), torch.randn(8, 4), torch.randn(2, 4),
                                   cut_before=["mid"])
    first, second = sharded.stages
    (check,) = _checks(first)
    assert _position(first, check) < _first_compute(first) and not _checks(second)
    assert [node.name for node in second.graph.nodes if node.op == "placeholder"] == ["norm"]  # x stays
    assert len(sharded.specializations) == 1


class CheckAfterALayer(nn.Module):
    """Branches on a layer's output, computed before the batch norm of the same stage."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.last = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        g = self.norm(h)
        if h.shape[0] > 4:
            g = g * 2
        return self.last(g).sum()


def test_a_check_on_a_layers_output_runs_before_the_batch_norm_after_that_layer():
    """Running the stage again up to the check runs no batch norm, so a refused call is served: only the
    nodes before the refusing check count (``specialize.rerun_of``), not the whole stage."""
    torch.manual_seed(0)
    sharded = _served_as_the_model(CheckAfterALayer().train(), torch.randn(8, 4), torch.randn(2, 4),
                                   cut_before=["last"])
    stage = sharded.stages[0]
    (check,) = _checks(stage)
    assert _position(stage, "first") < _position(stage, check) < _position(stage, "norm")


class UnsqueezesInPlace(nn.Module):
    """Changes a value's sizes in place before branching on them: the check cannot go before the write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.unsqueeze_(0)
        if h.shape[0] > 1:
            h = h * 2
        return self.b(h)


def test_a_check_stays_after_a_write_that_changes_the_sizes_it_reads():
    torch.manual_seed(0)
    model = UnsqueezesInPlace()
    sharded = autoshard.shard_model(model, 2, (torch.randn(3, 4),))
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        assert torch.equal(sharded(x), model(x))
    assert not sharded.specializations  # the condition is False for every batch size
    stage = next(stage for stage in sharded.stages if _checks(stage))
    (check,) = _checks(stage)
    written = next(node.name for node in stage.graph.nodes if node.target == "unsqueeze_")
    assert _position(stage, written) < _position(stage, check)


class PinsTheBatchSize(nn.Module):
    """Turns the batch size into a number after its batch norm (``int(...)``): a pinned size."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.last = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.first(x))
        scale = torch.full((int(x.shape[0]), 1), 0.5)
        return self.last(h * scale).sum()


def test_a_pinned_size_is_checked_before_anything_computes():
    torch.manual_seed(0)
    sharded = _served_as_the_model(PinsTheBatchSize().train(), torch.randn(8, 4), torch.randn(2, 4),
                                   cut_before=["last"])
    stage = sharded.stages[0]
    (check,) = _checks(stage)
    assert _position(stage, check) < _first_compute(stage)


def test_a_check_sits_where_it_was_without_the_facts_saying_what_holds_no_tensor():
    """A pipeline without ``shape-prop`` knows no value to be other than a tensor: nothing moves."""
    torch.manual_seed(0)
    model = NormThenBranch().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),), cut_before=["mid"],
                                    pipeline="trace,build-dag,linearize,split,emit")
    assert [node.target for node in sharded.stages[1].graph.nodes].count(check_condition) == 1


class ReadsAPositionBuffer(nn.Module):
    """Indexes its position embedding by a buffer it only reads (BERT's ``position_ids``), then branches
    on a layer's output (Hugging Face's SDPA: ``q_length > 1``) in the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(50, 16), nn.Embedding(32, 16)
        self.register_buffer("position_ids", torch.arange(32)[None], persistent=False)
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.l1(self.emb(ids) + self.pos(self.position_ids[:, :ids.shape[1]]))
        if h.shape[1] > 1:
            h = h.relu()
        return self.l2(h)


def test_in_training_mode_stages_that_only_read_a_buffer_may_run_again():
    """Every stage reading a buffer counted as updating it in training mode: BERT, DistilBERT and Llama
    (a rotary ``inv_freq``) refused one token in training, though running the stages again changes nothing."""
    torch.manual_seed(0)
    model = ReadsAPositionBuffer().train()
    sharded = autoshard.shard_model(model, 2, (torch.randint(0, 50, (2, 8)),), cut_before=["pos"])
    assert rerun_of(sharded).holds()
    ids = torch.randint(0, 50, (2, 1))
    assert torch.equal(sharded(ids), model(ids)) and len(sharded.specializations) == 1


class TracedBatchNorm(nn.Module):
    """Normalises with ``F.batch_norm`` on its own buffers, traced through (the kernel updates the running
    statistics without moving their version counters), then branches on a layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.batch_norm(self.first(x), self.mean, self.var, training=self.training)
        g = self.last(h)
        if g.shape[0] > 4:
            g = g * 2
        return g.sum()


def test_in_training_mode_stages_whose_traced_batch_norm_updates_statistics_do_not_run_again():
    """Its kernel moves no version counter, so shape propagation sees no write: the statistics would move
    twice. (A call its check refuses is refused first, over the input's sizes: served.)"""
    torch.manual_seed(0)
    model = TracedBatchNorm().train()
    reference = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),), cut_before=["last"])
    assert not rerun_of(sharded).holds()
    x = torch.randn(2, 4)
    assert torch.equal(sharded(x), reference(x))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))


class BranchyCNN(nn.Module):
    """Branches on the sizes of batch norms' outputs: the width after the first, the batch after the second."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4)
        self.pool, self.head = nn.MaxPool2d(2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        if x.shape[-1] > 12:
            x = self.pool(x)
        x = torch.relu(self.bn2(self.conv2(x)))
        if x.shape[0] * x.shape[-1] > 16:
            x = x * 0.5
        return self.head(x.mean((-2, -1)))


def test_in_training_mode_checks_on_sizes_a_layer_computed_are_checked_first_over_the_inputs_sizes():
    """A branch on a batch norm's output width was checked after that batch norm: in training mode another
    image size was refused with the statistics already moved. The input guard now checks the condition over
    the input's sizes (a symbolic run at planning), before anything computes, so the call is served."""
    torch.manual_seed(0)
    model = BranchyCNN().train()
    reference = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 3, 8, 8),))
    for shape in ((3, 3, 16, 16), (5, 3, 8, 8), (2, 3, 14, 14), (2, 3, 8, 8)):
        x = torch.randn(*shape)
        assert torch.equal(sharded(x), reference(x))
        for mine, theirs in zip(model.buffers(), reference.buffers()):
            assert torch.equal(mine, theirs)
    assert len(sharded.specializations) >= 2


def test_stages_that_capture_nothing_again_refuse_before_any_batch_norm_runs():
    torch.manual_seed(0)
    model = BranchyCNN().train()
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 3, 8, 8),), respecialize=False)
    statistics = [b.clone() for b in model.buffers()]
    early = r"checked before any stage computes, as not \(x\.shape\[3\] > 12\)"
    with pytest.raises(SpecializationMismatch, match=early) as refused:
        sharded(torch.randn(2, 3, 16, 16))
    assert refused.value.before_compute
    assert all(torch.equal(a, b) for a, b in zip(statistics, model.buffers()))


class BranchesOnADictsTensor(nn.Module):
    """``BranchyCNN`` given its image in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = BranchyCNN()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.cnn(batch["image"])


def test_a_check_on_a_size_computed_from_a_tensor_in_a_dict_is_checked_first_over_its_sizes():
    torch.manual_seed(0)
    model = BranchesOnADictsTensor().train()
    reference = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, ({"image": torch.randn(2, 3, 8, 8)},))
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(sharded({"image": x}), reference({"image": x}))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))


def test_torch_compile_serves_a_call_the_early_conditions_refuse_without_warning():
    """The refusal's walk evaluates the conditions (``guard.holds``); their compiled code was kept in an
    ``lru_cache``, of which torch.compile's tracer warns ("Dynamo detected a call to a
    `functools.lru_cache`-wrapped function")."""
    import warnings

    torch.manual_seed(0)
    model = BranchyCNN().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(autoshard.shard_model(model, 2, (torch.randn(2, 3, 8, 8),)), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape in ((2, 3, 8, 8), (2, 3, 16, 16)):
            x = torch.randn(*shape)
            assert torch.equal(compiled(x), reference(x))
    assert not [w for w in caught if "lru_cache" in str(w.message)]


class ChecksEveryLayer(nn.Module):
    """Branches on each layer's output size: one check a layer, reading the value just before it."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.shape[0] > 1:
                x = x * 2
        return x


def test_hoisting_walks_back_from_each_check_only_as_far_as_it_moves(monkeypatch):
    """Each check is placed by a walk back from it to what it must follow, not by a walk of the graph from its
    start once per check: a 24-layer T5's 124 checks over 4,623 nodes took 0.45 s of its planning, a time that
    grew with the square of the depth."""
    from autoshard.capture import check_order

    tested: list[object] = []
    any_of = check_order._Writes.any_of
    monkeypatch.setattr(check_order._Writes, "any_of", lambda self, node, roots: tested.append(node) or any_of(
        self, node, roots))
    torch.manual_seed(0)
    model = ChecksEveryLayer(32)
    sharded = autoshard.shard_model(model, 2, (torch.randn(3, 4),), verify=False)
    checks = [check for stage in sharded.stages for check in _checks(stage)]
    assert len(checks) == 32 and 0 < len(tested) <= 4 * len(checks)  # (before: 3,168, the nodes before each check)
    x = torch.randn(3, 4)
    assert torch.equal(sharded(x), model(x))
