"""``torch.compile(sharded)`` traces every stage of a call into one graph, first call included: a graph break
made it run each stage as a graph of its own with the code between run as Python (GPT-2 eval 1.35-1.5x the
compiled model, now about 1.2x; in training and for Llama about 1.0x: benchmarks/RESULTS.md)."""

from __future__ import annotations

import copy
import warnings

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


class Settings(nn.Module):
    """Layers read a class setting, a dropout at the end: what the stages check (a setting, a hook on the model,
    a module's mode, a weight's dtype), changed after compiled calls."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x)) * self.scale
        return self.drop(x)


def _compiled(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, object, object]:
    from torch._dynamo.testing import CompileCounter

    sharded = autoshard.shard_model(model, 2, (x,))
    torch._dynamo.reset()
    counter = CompileCounter()
    return sharded, torch.compile(sharded, backend=counter), counter


def test_a_compiled_call_checks_what_an_eager_call_checks():
    """Traced, the stages' check reads the modes, settings, hook dicts and weights' dtypes as Dynamo guards them
    (``HeldState.traced_check``): each change makes a new graph whose check serves it as an eager call would."""
    torch.manual_seed(0)
    model, x = Settings().eval(), torch.randn(3, 8)
    sharded, compiled, _ = _compiled(model, x)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        model.scale = 3.0  # a setting: captured again
        assert torch.equal(compiled(x), model(x))
        handle = model.register_forward_hook(lambda module, args, out: out * 10)  # a hook on traced-through code
        assert torch.equal(compiled(x), model(x))
        handle.remove()
        model.drop.train()  # one module's mode
        torch.manual_seed(1)
        served = compiled(x)
        torch.manual_seed(1)
        assert torch.equal(served, model(x))
        model.drop.eval()
        assert len(sharded.specializations) == 3
        model.layers[3].weight.data = model.layers[3].weight.data.double()  # past FixedDtypes' refusal
        with pytest.raises(autoshard.InputMismatchError, match="float64"):
            compiled(x)


def test_hooks_registered_elsewhere_do_not_make_a_compiled_call_trace_again():
    """An eager call's check compares the hook id counter (every registration moves it); a traced one reads the
    dicts it watches instead: Dynamo guarded the counter's value, a new graph for each hook registered anywhere."""
    torch.manual_seed(0)
    model, x = Settings().eval(), torch.randn(3, 8)
    _, compiled, counter = _compiled(model, x)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(x), model(x))
            torch.zeros(1, requires_grad=True).register_hook(lambda grad: grad)
            nn.Linear(1, 1).register_forward_hook(lambda *args: None)
    assert counter.frame_count == 1


def test_the_compiled_stages_checks_are_guarded_in_cpp_but_a_few():
    """Dynamo guards an object it reaches two ways with a test it runs in Python. The eager check's code holds each
    module it compares in a closure variable of its own: a tiny GPT-2's compiled stages ran 192-224 such guards a
    call (the model: 17). Traced, each module is reached from its stage by path; what is left is a module the
    model's own state also lists, and a settings object several modules hold."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch._dynamo.guards")

    def python_guards(fn: nn.Module, x: torch.Tensor) -> int:
        lines.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(fn, backend="eager", fullgraph=True)(x)
        return "\n".join(lines).count("LAMBDA_GUARD")

    torch.manual_seed(0)
    model, x = _tiny_gpt2().eval(), torch.randint(0, 64, (2, 8))
    logger.addHandler(handler)
    torch._logging.set_logs(guards=True)
    try:
        alone = python_guards(model, x)
        sharded = [python_guards(autoshard.shard_model(model, k, (x,)), x) for k in (1, 2)]
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    leaves = sum(1 for m in model.modules() if not m._modules)
    assert alone > 0 and all(count <= alone + leaves + 10 for count in sharded), (alone, leaves, sharded)


def _patch_linear_forward() -> object:
    original = nn.Linear.forward
    nn.Linear.forward = lambda self, x: original(self, x) + 1

    class Restore:
        def remove(self) -> None:
            nn.Linear.forward = original
    return Restore()


@pytest.mark.parametrize("change", [
    lambda m: m.layers[1].register_forward_hook(lambda module, args, out: out * 10),
    lambda m: m.layers[1].register_forward_pre_hook(lambda module, args: (args[0] * 3,)),
    lambda m: m.register_forward_hook(lambda module, args, out: out * 10),
    lambda m: nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out * 1.5 if isinstance(module, nn.Linear) else out),
    lambda m: _patch_linear_forward(),
], ids=["hook on a layer", "pre-hook on a layer", "hook on the model", "global hook", "class forward patched"])
def test_a_compiled_call_sees_hooks_and_forwards_changed_since(change):
    """Dynamo guards none of these (it skips the hook dicts' guards and makes none of a dict's truth): the
    traced check compares them itself, so each change makes a new graph (review: served stale, off by 0.3)."""
    torch.manual_seed(0)
    model, x = Settings().eval(), torch.randn(3, 8)
    _, compiled, _ = _compiled(model, x)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        handle = change(model)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.compile's warning of global hooks
                assert torch.equal(compiled(x), model(x))
        finally:
            handle.remove()
        assert torch.equal(compiled(x), model(x))
