"""Review of ``capture.check_order``: a check moved earlier must read what it read where the model's code
made it, and the nodes moved with it must read no value a node between writes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.errors import InputMismatchError


def _as_the_model_or_refused(sharded: autoshard.ShardedModel, model: nn.Module, *args: torch.Tensor) -> None:
    """The rule: the model's output, or a refusal; never another answer."""
    with torch.no_grad():
        try:
            given = sharded(*args)
        except InputMismatchError:
            return
        assert torch.equal(given, model(*args))


class WritesThroughTheSameTensor(nn.Module):
    """``h.contiguous()`` is ``h`` itself: unsqueezing it in place changes ``h``'s sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = h.contiguous()
        g.unsqueeze_(0)  # h is (1, batch, 4) now
        if h.shape[1] > 3:
            h = h * 2
        return self.b(h)


def test_a_check_stays_after_a_write_to_the_same_tensor_under_another_node():
    torch.manual_seed(0)
    model = WritesThroughTheSameTensor().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),))
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(sharded(x), model(x))


class _WritesTheSecond(nn.Module):
    """Kept whole (it branches on values); unsqueezes, in place, the second tensor of the list it is given."""

    def forward(self, pair: list[torch.Tensor]) -> torch.Tensor:
        a, b = pair
        if b.sum() > -1e9:
            b.unsqueeze_(0)
        return a * 1


class WritesInsideAList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.w = nn.Linear(4, 4), nn.Linear(4, 4), _WritesTheSecond()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.w([x * 1, h])  # h is (1, batch, 4) now
        if h.shape[1] > 3:
            h = h * 2
        return self.b(h) + y.sum()


def test_a_check_stays_after_a_module_kept_whole_that_writes_a_tensor_of_a_list_it_is_given():
    torch.manual_seed(0)
    model = WritesInsideAList().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),), cut_before=["b"])
    _as_the_model_or_refused(sharded, model, torch.randn(2, 4))  # (refused: a new capture sees False)


class ReadsAValueWrittenThroughAView(nn.Module):
    """``t.item()`` after ``t`` was written through a view: torch.export keeps the read (``aten.item``) and
    asserts of its result."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        t = k * 1
        t.view(-1).add_(2)
        n = t.item()
        torch._check(n >= 0)
        torch._check(n <= x.shape[0])
        return self.b(self.a(x)[:n])


def test_a_value_read_from_tensor_data_is_not_moved_before_a_write_to_that_tensor():
    """The value (``aten.item``) holds no tensor, but reads one's data: it is an operand of the checks on it,
    not a pure computation of their conditions (moved before the write, the graph sliced 3 rows, not 5)."""
    torch.manual_seed(0)
    model = ReadsAValueWrittenThroughAView().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4), torch.tensor(3)),
                                    pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    x, k = torch.randn(8, 4), torch.tensor(1)
    with torch.no_grad():
        assert torch.equal(sharded(x, k), model(x, k))


class _RebindsItsInput(nn.Module):
    """Kept whole (it branches on values); gives its input other sizes by rebinding its data, which moves no
    version counter."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if t.sum() > -1e9:
            t.data = t.data.unsqueeze(0)
        return t.detach() * 1


class RebindsInAModuleKeptWhole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.w = nn.Linear(4, 4), nn.Linear(4, 4), _RebindsItsInput()

    def rebind(self, h: torch.Tensor) -> torch.Tensor:
        return self.w(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.rebind(h)  # h is (1, batch, 4) now
        if h.shape[1] > 3:
            h = h * 2
        return self.b(h) + y.sum()


def _rebinds(t: torch.Tensor) -> torch.Tensor:
    """Kept opaque (it branches on values), as ``_RebindsItsInput``."""
    if t.sum() > -1e9:
        t.data = t.data.unsqueeze(0)
    return t.detach() * 1


class RebindsInAFunctionKeptOpaque(RebindsInAModuleKeptWhole):
    def rebind(self, h: torch.Tensor) -> torch.Tensor:
        return _rebinds(h)


@pytest.mark.parametrize("kind", [RebindsInAModuleKeptWhole, RebindsInAFunctionKeptOpaque])
def test_a_check_stays_after_the_models_own_code_kept_whole_that_is_given_what_it_reads(kind):
    torch.manual_seed(0)
    model = kind().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(8, 4),), cut_before=["b"])
    _as_the_model_or_refused(sharded, model, torch.randn(2, 4))
