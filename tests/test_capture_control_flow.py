"""torch's control-flow operators (``torch.cond``, ``while_loop``) in a model's forward."""

from __future__ import annotations

import builtins

import torch
from torch import nn
from torch._higher_order_ops.while_loop import while_loop

import autoshard


class Branching(nn.Module):
    """``torch.cond`` on the data: export records both branches, fx cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(torch.cond(h.sum() > 0, lambda t: self.b(t), lambda t: -t, (h,)))


class Looping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 0.5 + 1), (torch.tensor(0), self.a(x)))
        return self.c(h)


def test_a_cond_on_the_data_takes_either_branch_when_sharded():
    torch.manual_seed(0)
    model = Branching()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    signs = set()
    for _ in range(8):
        x = torch.randn(3, 8) * 3
        signs.add(bool(model.a(x).sum() > 0))
        assert torch.equal(sharded(x), model(x))
    assert signs == {True, False}  # both branches were served


def test_a_while_loop_is_sharded_exactly():
    torch.manual_seed(0)
    model = Looping()
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    x = torch.randn(5, 8)
    assert torch.equal(sharded(x), model(x))


def test_capture_leaves_torch_compile_working_after_a_model_ran_it():
    """torch.cond runs torch.compile's tracer, which builds its table of builtins on first use:
    built while capture had ``callable`` patched, it made the real one unknown for good."""
    import torch._dynamo.trace_rules as rules
    table = rules._builtin_function_ids
    table.function_ids = table.function_names = None  # as in a process that never compiled before
    autoshard.shard_model(Branching(), 2, example_inputs=(torch.randn(2, 8),))

    @torch.compile(fullgraph=True, backend="eager")
    def uses_callable(t: torch.Tensor) -> torch.Tensor:
        return t + 1 if callable(print) else t

    assert torch.equal(uses_callable(torch.ones(2)), torch.full((2,), 2.0))
    assert builtins.callable(print)
