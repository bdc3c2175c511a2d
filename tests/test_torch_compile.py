"""``torch.compile(sharded)`` traces every stage of a call into one graph, first call included: a graph break
made it run each stage as a graph of its own with the code between run as Python (GPT-2 eval 1.35-1.5x the
compiled model, now about 1.2x; in training and for Llama about 1.0x: benchmarks/RESULTS.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import autoshard


class ClassSetting(nn.Module):
    """Reads a class attribute in its forward, as Hugging Face's layers read ``gradient_checkpointing``:
    the stages' check reads it through the class, not through its ``__dict__``'s mapping proxy, which
    torch.compile refuses to read once the traced call filled a cache."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x)) * self.scale
        return x


def _tiny_gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("build, example", [
    (ClassSetting, lambda: torch.randn(3, 16)),
    (_tiny_gpt2, lambda: torch.randint(0, 64, (2, 8))),
], ids=["class-attribute", "gpt2"])
@pytest.mark.parametrize("copied", [False, True], ids=["sharded", "deepcopy"])
def test_a_compiled_sharded_model_is_one_graph_from_its_first_call(build, example, copied):
    torch.manual_seed(0)
    model = build().eval()
    x = example()
    sharded = autoshard.shard_model(model, 2, (x,))
    if copied:  # a copy gets its own binder made with it; it finds its modules by path on its first call
        sharded = copy.deepcopy(sharded)  # (a check in full, which torch.compile runs as Python: once eager)
        with torch.no_grad():
            sharded(x)
    torch._dynamo.reset()
    compiled = torch.compile(sharded, fullgraph=True, backend="eager")  # a graph break raises
    with torch.no_grad():
        for _ in range(3):
            out, expected = compiled(x), model(x)
            assert torch.equal(getattr(out, "logits", out), getattr(expected, "logits", expected))


def test_a_compiled_training_step_is_one_graph_with_the_models_gradients():
    torch.manual_seed(0)
    model = ClassSetting()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 16)
    torch._dynamo.reset()
    compiled = torch.compile(autoshard.shard_model(model, 2, (x,)), fullgraph=True, backend="eager")
    compiled(x).sum().backward()
    reference(x).sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("call", ["positional", "keywords"])
def test_the_graph_of_a_compiled_first_call_serves_the_next(call):
    """The first call's trace binds its arguments without keeping the binding it made: kept, it changed a
    dict the graph's guards read, and the second call of the same inputs compiled the whole call again."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model, x = _tiny_gpt2().eval(), torch.randint(0, 64, (2, 8))
    args, kwargs = ((x,), {}) if call == "positional" else ((), {"input_ids": x})
    sharded = autoshard.shard_model(model, 2, args, example_kwargs=kwargs or None)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(sharded, fullgraph=True, backend=counter)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(*args, **kwargs).logits, model(*args, **kwargs).logits)
    assert counter.frame_count == 1
