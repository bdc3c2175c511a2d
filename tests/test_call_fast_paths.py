"""Calling a plan costs what the model costs: checks worked out once and kept, refusals unchanged.

The timings live in ``benchmarks/call_overhead.py``; these tests hold what makes them cheap (a
stage finds its modules once, a call structure is bound once, a stage's device is found once) and
that every refusal still happens when what was kept goes stale.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.capture import held_state
from autoshard.capture.held_state import NO_KEY, HeldState, kept_check
from autoshard.errors import InputMismatchError
from autoshard.sharded import _BINDERS, fitted_call, moved_to


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.ReLU())]).eval()


def _called_once() -> tuple[nn.Sequential, torch.Tensor, nn.Module]:
    """The MLP, an input and its 2 stages, called once (what the calls keep is made)."""
    model = _mlp()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    return model, x, sharded


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[HeldState]:
    walked: list[HeldState] = []
    walk = HeldState._walk

    def counted(self: HeldState) -> None:
        walked.append(self)
        walk(self)

    monkeypatch.setattr(HeldState, "_walk", counted)
    return walked


class SlicesItsLayers(nn.Module):
    """A forward that builds a container on every call (``self.layers[:2]`` registers its modules
    into a new ModuleList), as many models do: no module of the stage changes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:
            x = layer(x)
        return self.layers[3](self.layers[2](x))


@pytest.mark.parametrize("make", [_mlp, lambda: SlicesItsLayers().eval()])
def test_stages_find_their_modules_once_and_not_on_every_call(make, monkeypatch):
    model = make()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    walked = _walks(monkeypatch)
    for _ in range(5):
        assert torch.equal(sharded(x), model(x))
    assert walked == []


@pytest.mark.parametrize("how", ["setattr", "_modules"])
def test_a_submodule_replaced_in_a_stage_is_found_again_and_its_mode_checked(how, monkeypatch):
    """Replaced by ``setattr`` or straight in ``_modules`` (as quantization's convert does, past
    every hook): each step of the kept paths is checked by identity on every call."""
    model, x, sharded = _called_once()
    walked = _walks(monkeypatch)
    stage = sharded.stages[1]
    path = next(name for name, m in stage.named_modules() if isinstance(m, nn.Linear))
    replacement = nn.Linear(8, 8).train()
    owner, _, name = path.rpartition(".")
    if how == "setattr":
        setattr(stage.get_submodule(owner), name, replacement)
    else:
        stage.get_submodule(owner)._modules[name] = replacement
    with pytest.raises(InputMismatchError, match="switched to another mode"):
        stage(*sharded.stages[0](x))
    assert walked, "the replacement was not noticed"
    replacement.eval()
    walked.clear()
    assert torch.equal(sharded(x), stage(*sharded.stages[0](x)))
    sharded(x)
    assert len(walked) <= 1  # found again once, then kept


class Gated(nn.Module):
    """A branch on a value keeps ``gate`` whole; its code reads its weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x.to(self.proj.weight.dtype))
        return y * 2 if y.sum() > 0 else y


def test_a_weight_swapped_inside_a_module_kept_whole_is_refused():
    """``gate._modules["proj"] = proj.half()`` changes the dtype the capture read, past every hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Gated(), nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    model[1]._modules["proj"] = copy.deepcopy(model[1].proj).half()
    with pytest.raises(InputMismatchError, match="captured with float32 weights"):
        sharded(x)


def test_a_shallow_copy_of_a_stage_is_checked_by_its_own_mode():
    model = _mlp()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    shallow = copy.copy(sharded.stages[0])
    shallow(x)
    shallow.training = True
    with pytest.raises(InputMismatchError, match="captured in eval mode"):
        shallow(x)


def test_a_conversion_that_puts_new_parameters_in_the_modules_is_refused():
    """``torch.__future__.set_overwrite_module_params_on_conversion`` makes ``half()`` register new
    Parameter objects directly in each module's registry, past every hook: read on every call."""
    model, x, sharded = _called_once()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.half()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    with pytest.raises(InputMismatchError, match="captured with float32 weights"):
        sharded.stages[1](torch.randn(2, 8).half())


def test_a_copied_stage_watches_its_own_modules_not_the_originals():
    model = _mlp()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    copied = copy.deepcopy(sharded)
    copied(x)
    next(m for m in copied.stages[1].modules() if isinstance(m, nn.Linear)).train()
    with pytest.raises(InputMismatchError, match="switched to another mode"):
        copied(x)
    assert torch.equal(sharded(x), model(x))  # the original's modules were not switched


def test_a_call_structure_is_bound_once_and_values_are_still_checked_on_every_call():
    """What a call binds to is kept per structure (positional count, keywords); the values the
    binding cannot decide (a tensor where one is due, a left-out default) are checked every time."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
            h = self.a(x) * scale
            return self.b(h if mask is None else h * mask)

    model = Masked().eval()
    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), {"mask": mask}, respecialize=False)
    first = sharded.stages[0]
    for _ in range(3):
        assert torch.equal(sharded(x, mask=mask), model(x, mask=mask))
        assert torch.equal(sharded(x, mask), model(x, mask))
    assert len(_BINDERS[first].bindings) == 2
    # a call the first stage takes as it was made, the sharded model passes on as it is; a runtime gets
    # it by name (PyTorch's pipeline takes only tensors by position)
    assert sharded.fit_call((x, mask), {}) == ((x, mask), {})
    assert fitted_call(first, sharded.model_signature, (x, mask), {}) == ((), {"x": x, "mask": mask})
    with pytest.raises(InputMismatchError, match="mask is None"):
        sharded(x, mask=None)
    assert torch.equal(sharded(x, mask, 1.0), model(x, mask, 1.0))  # the default the example left
    with pytest.raises(InputMismatchError, match="scale=1.0 at the default"):
        sharded(x, mask, 2.0)
    assert len(_BINDERS[first].bindings) == 3


@pytest.mark.parametrize("moved", ["the stage", "its modules"])
def test_a_stage_moved_on_its_own_gets_its_values_on_its_device(moved):
    """Where a stage's weights are is kept, and found again after ``.to()`` on the stage, or on the
    model's modules it holds (moved without it): its boundary values follow it (the meta device
    stands in for a GPU)."""
    model = _mlp()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert sharded(x).device.type == "cpu"
    if moved == "the stage":
        sharded.stages[1].to("meta")
    else:
        for module in sharded.stages[1].children():
            module.to("meta")
    assert sharded(x).device.type == "meta"


class Scaled(nn.Module):
    """A buffer read by traced code: each stage holds its own entry for it, which ``model.to`` leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.5))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * self.scale
        return x


def test_the_models_layers_moved_on_their_own_are_seen_by_their_parameters_not_a_stage_held_buffer():
    """The model moved as a whole puts a new tensor in place of its buffer, which the stages refuse
    (``test_rebinding``); its layers moved leave the buffer where it was."""
    model = Scaled().eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    model.blocks.to("meta")
    assert sharded(x.to("meta")).is_meta  # the stage's weights are on two devices: values pass as they are
    model.to("meta")
    with pytest.raises(InputMismatchError, match="scale was assigned anew"):
        sharded(x.to("meta"))


def test_boundary_values_already_on_the_device_are_passed_on_as_they_are():
    values = (torch.randn(2), torch.randn(3))
    assert moved_to(torch.device("cpu"), values) is values
    assert moved_to(None, values) is values
    keywords = {"x": values[0], "mask": None}
    assert moved_to(torch.device("cpu"), keywords) is keywords
    moved = moved_to(torch.device("meta"), (values[0], [values[1]]))
    assert moved[0].is_meta and moved[1][0].is_meta


def test_a_pipeline_stage_module_carries_the_same_kept_checks(monkeypatch):
    """``pipeline_stage`` hands PyTorch a copy of the stage (``stage_module``): it checks itself as
    cheaply, and still refuses a module switched to another mode."""
    from autoshard.runtime.stage import stage_module

    model = _mlp()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    module = stage_module(sharded, 1, torch.device("cpu"))
    received = sharded.stages[0](x)
    module(*received)
    walked = _walks(monkeypatch)
    for _ in range(3):
        assert torch.equal(module(*received), model(x))
    assert walked == []
    next(m for m in module.modules() if isinstance(m, nn.Linear)).train()
    with pytest.raises(InputMismatchError, match="switched to another mode"):
        module(*received)


def test_hooks_on_a_stage_or_on_every_module_still_run():
    """The sharded model calls a stage's forward straight only when ``__call__`` would add nothing;
    hooks added after calls that took the straight path are seen on the next call."""
    model, x, sharded = _called_once()
    seen = []
    handle = sharded.stages[1].register_forward_hook(lambda module, args, out: seen.append("stage"))
    sharded(x)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append("global") if module is sharded.stages[0] else None)
    try:
        sharded(x)
    finally:
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append("global pre") if module is sharded.stages[1] else None)
    try:
        sharded(x)
    finally:
        handle.remove()
    sharded(x)
    assert seen == ["stage", "global", "global pre"]


def test_a_stage_compiled_on_its_own_runs_compiled():
    """``stage.compile()`` sets what ``nn.Module.__call__`` calls instead of ``forward``."""
    model, x, sharded = _called_once()
    compiled = []

    def counting(gm: torch.fx.GraphModule, inputs: list) -> object:
        compiled.append(gm)
        return gm.forward

    sharded.stages[1].compile(backend=counting)
    assert torch.equal(sharded(x), model(x))
    assert compiled


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_a_jit_trace_records_each_stage_as_a_module_call():
    """Under a JIT trace every stage is called through ``__call__`` (its ``_slow_forward`` records
    it as a module); the trace computes the model."""
    model, x, sharded = _called_once()
    traced = torch.jit.trace(sharded, (x,))
    assert str(traced.graph).count('prim::CallMethod[name="forward"]') == 2
    assert torch.equal(traced(x), model(x))


def test_fx_tracing_through_a_sharded_model_is_refused():
    """fx's proxies are no tensors: the plan, captured with tensors, refuses them by name."""
    model, x, sharded = _called_once()

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = sharded

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1

    with pytest.raises(InputMismatchError, match="input is Proxy"):
        torch.fx.symbolic_trace(Outer())


def test_one_module_switched_to_another_mode_is_refused_before_any_stage_computes():
    """The model's modules are checked at the call's start (``StateAtCapture``, by the first
    stage), not only by the stage that calls them: the stages before it do not run (in training they would update their
    batch-norm statistics and draw random numbers for a call that is then refused)."""
    model = _mlp()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), respecialize=False)
    sharded(x)
    ran = []
    model[0].register_forward_hook(lambda module, args, out: ran.append(module))
    model[-2].train()
    with pytest.raises(InputMismatchError, match="switched to another mode"):
        sharded(x)
    assert ran == []
    model[-2].eval()
    assert torch.equal(sharded(x), model(x))


def test_a_kept_check_passes_only_what_the_last_passing_call_read_by_identity():
    """Anything else (another flag, value or dtype, an equal value that is another object, an item
    gone or set to None) runs the full check."""
    module, registry = nn.Linear(1, 1), {"w": torch.zeros(1)}
    full: list[bool] = []
    check = kept_check([(registry, "w", "dtype"), (module, NO_KEY, "training"), (registry, "w", "")],
                       [torch.float32, True, registry["w"]], "passed", lambda flag: full.append(flag) or "full",
                       flag_seen=False)
    assert check(False) == "passed" and full == []
    assert check(True) == "full"
    module.training = 1  # equal to True, not the flag that was read
    assert check(False) == "full"
    module.training = True
    registry["w"] = torch.zeros(1)  # the same dtype, another tensor
    assert check(False) == "full"
    for gone in ({}, {"w": None}):
        registry.clear()
        registry.update(gone)
        assert check(False) == "full"
    assert full == [True, False, False, False, False]


def test_a_kept_check_of_many_reads_compares_every_one():
    """Past one part of generated code (``_PART`` reads), the reads are compared part by part."""
    modules = [nn.ReLU() for _ in range(3 * held_state._PART + 5)]
    check = kept_check([(m, NO_KEY, "training") for m in modules], [True] * len(modules), "passed",
                       lambda flag: "full")
    assert check(None) == "passed"
    for module in (modules[0], modules[held_state._PART + 1], modules[-1]):
        module.eval()
        assert check(None) == "full"
        module.train()
    assert check(None) == "passed"


class Blocks(nn.Module):
    """Modules two containers deep: fx's code reached each through ``nn.Module.__getattr__`` at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block[1](block[0](x))
        return x


def _getattr_calls_on(watched: list[nn.Module], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    original = nn.Module.__getattr__

    def counted(self: nn.Module, name: str) -> object:
        if any(self is module for module in watched):
            seen.append(name)
        return original(self, name)

    monkeypatch.setattr(nn.Module, "__getattr__", counted)
    return seen


@pytest.mark.parametrize("copied", ["as made", "deepcopy", "pickle"])
def test_a_stage_calls_the_modules_its_check_returned_not_found_again_by_attribute(copied, monkeypatch):
    """The check hands the stage's code the modules it has just checked; copies keep that code."""
    import pickle

    torch.manual_seed(0)
    model = Blocks().eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded = {"as made": sharded, "deepcopy": copy.deepcopy(sharded),
               "pickle": pickle.loads(pickle.dumps(sharded))}[copied]
    stage = sharded.stages[1]
    assert "checked_modules['blocks." in stage.code and "getattr(" not in stage.code
    containers = [m for m in stage.modules() if not isinstance(m, (nn.Linear, nn.ReLU))]
    received = sharded.stages[0](x)
    stage(*received)
    seen = _getattr_calls_on(containers, monkeypatch)
    assert torch.equal(stage.forward(*received), model(x))
    assert seen == []
    assert torch.equal(sharded(x), model(x))  # the copy's own kept checks and binding
    assert "checked_modules" in stage.print_readable(print_output=False)


def test_hooks_on_a_module_inside_a_stage_still_run():
    model, x, sharded = _called_once()
    seen = []
    model[-2].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    sharded(x)
    assert seen == [torch.Size([2, 8])]


def _straight(sharded: autoshard.ShardedModel) -> list[bool]:
    """For each module the stages call, whether their code calls its ``forward`` straight."""
    return [not isinstance(call, nn.Module) for stage in sharded.stages
            for call in stage._autoshard_held_state.check(stage.training).values()]


def test_a_module_nn_module_call_would_only_forward_is_called_by_its_forward():
    """``nn.Module.__call__`` adds two Python frames a module (8-layer MLP: 1.2x the model's time)."""
    import sys

    model, x, sharded = _called_once()
    assert all(_straight(sharded))
    calls = []
    call_impl = nn.Module._call_impl.__code__

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is call_impl:
            calls.append(type(frame.f_locals["self"]))

    sys.setprofile(profile)
    try:
        out = sharded(x)
    finally:
        sys.setprofile(None)
    assert torch.equal(out, model(x)) and calls and nn.Linear not in calls and nn.ReLU not in calls


class _Tripled(nn.Linear):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h) * 3


@pytest.mark.parametrize("change", ["forward hook", "pre-hook", "backward hook", "global hook",
                                    "forward on the module", "forward on the class", "compiled", "class swapped",
                                    "call on the module", "nn.Module's call"])
def test_what_makes_a_modules_call_more_than_its_forward_is_seen_on_the_next_call(change):
    """Each change a module's ``__call__`` would act on, made after calls that took its forward
    straight: the next call runs it as the model does, and calls it whole from then on (a hook removed
    moves no counter to tell; the whole call is right either way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(2, 8, requires_grad=True)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    leaf, seen = model[2], []
    undo = {
        "forward hook": lambda: leaf.register_forward_hook(lambda m, a, out: seen.append(1) or out * 2).remove,
        "pre-hook": lambda: leaf.register_forward_pre_hook(lambda m, a: seen.append(1) or (a[0] * 2,)).remove,
        "backward hook": lambda: leaf.register_full_backward_hook(
            lambda m, grad_in, grad_out: seen.append(1) or (grad_in[0] * 2,)).remove,
        "global hook": lambda: torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, out: (seen.append(1) or out * 2) if m is leaf else None).remove,
        "forward on the module": lambda: _patched(leaf, lambda h: seen.append(1) or nn.Linear.forward(leaf, h) * 2),
        "forward on the class": lambda: _patched(
            nn.Linear, lambda self, h, linear=nn.Linear.forward: seen.append(1) or linear(self, h) * 2),
        "compiled": lambda: _patched(leaf, lambda *a, **k: seen.append(1) or nn.Module._call_impl(leaf, *a, **k) * 2,
                                     "_compiled_call_impl"),
        "class swapped": lambda: _patched(leaf, _Tripled, "__class__"),
        "call on the module": lambda: _patched(
            leaf, lambda *a, **k: seen.append(1) or nn.Module._call_impl(leaf, *a, **k) * 2, "_call_impl"),
        "nn.Module's call": lambda: _patched(nn.Module, lambda self, *a, call=nn.Module.__call__: (
            seen.append(1) if self is leaf else None, call(self, *a))[1], "__call__"),
    }[change]()
    try:
        for run in (model, sharded):
            seen.clear()
            out = run(x)
            out.sum().backward()
            grad = x.grad
            x.grad = None
            if run is model:
                expected, expected_grad, calls = out, grad, list(seen)
        assert (calls or change == "class swapped") and seen == calls
        assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
        if change != "class swapped":  # (a class of the tests': later modules are called whole)
            assert all(_straight(sharded)) == change.startswith("forward on")  # a patched forward is all it runs
    finally:
        undo()
    assert torch.equal(sharded(x), model(x))


def _patched(owner: object, value: object, name: str = "forward") -> object:
    """``owner.name`` set to ``value``; returns what undoes it."""
    if name == "__class__":
        old_class = type(owner)
        owner.__class__ = value
        return lambda: setattr(owner, "__class__", old_class)
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    return lambda: setattr(owner, name, old) if had else delattr(owner, name)


def test_a_hook_a_stages_module_registers_on_a_later_one_runs_in_that_call():
    """A pre-hook of the first module registers a one-shot hook on a later module of the same stage,
    after the stage chose what to call: from a module that runs hooks on, each is called whole."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model.eval(), 2, (x,))
    sharded(x)

    def register_once(module: nn.Module, args: tuple) -> None:
        handles: list = []
        handles.append(model[2].register_forward_hook(lambda m, a, out: handles[0].remove() or out * 3))

    model[0].register_forward_pre_hook(register_once)
    for _ in range(2):
        assert torch.equal(sharded(x), model(x))


class _RegistersOnLater(nn.Module):
    """Kept whole (it branches on values); its forward registers a one-shot hook on ``later``."""

    def __init__(self, later: list[nn.Module]) -> None:
        super().__init__()
        self.later = later  # a list: not a submodule

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        handles: list = []
        handles.append(self.later[0].register_forward_hook(lambda m, a, out: handles[0].remove() or out * 3))
        return h if h.sum() > -1e9 else -h


class _Registering(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.reg = _RegistersOnLater([self.c])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(torch.relu(self.reg(self.a(x)))))


def test_a_hook_a_module_of_the_models_own_registers_on_a_later_one_runs_in_that_call():
    """Past a module whose code is not torch's, a stage calls each module whole."""
    torch.manual_seed(0)
    model = _Registering().eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), cut_before=["d"])
    assert [w.name for w in sharded.plan.wrapped] == ["reg"]
    for _ in range(3):
        assert torch.equal(sharded(x), model(x))


class Weighted(nn.Module):
    """Traced through: the stage's code reads ``w`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_a_weight_set_to_none_is_checked_in_full_and_one_of_another_dtype_put_back_is_refused():
    """What the last call read is compared first; a weight gone (None) sends every call to the
    full check, which refuses a half-precision one put back in its place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Weighted(), nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    holder = sharded.stages[0].get_submodule("1")  # the stage's own holder of the weight it reads
    weight = holder.w
    holder.w = None
    with pytest.raises(TypeError):  # the model's code fails on the None weight, not the check
        sharded(x)
    holder.w = nn.Parameter(weight.detach().half())
    with pytest.raises(InputMismatchError, match="captured with float32 weights"):
        sharded(x)
    holder.w = weight
    assert torch.equal(sharded(x), model(x))


def test_an_export_stage_reads_its_weights_from_the_registries_its_check_returns():
    """torch.export's graphs read each weight by path (``getattr(self, "4").weight``: a
    ``nn.Module.__getattr__`` a step, which made the export MLP 1.3x the model); the stage now reads
    them from the ``_parameters`` its check returns. A weight changed in place and one loaded are read
    as getattr would; torch.compile traces the code whole."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.ReLU())]).eval()
    x = torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), pipeline="export,shape-prop,build-dag,linearize,split,emit,verify")
    assert "#parameters" in sharded.stages[1].code and "getattr(self" not in sharded.stages[1].code
    with torch.no_grad():
        model[6].weight.mul_(2)
    assert torch.equal(sharded(x), model(x))
    model.load_state_dict({name: t + 1 for name, t in model.state_dict().items()})
    assert torch.equal(sharded(x), model(x))
    torch._dynamo.reset()
    stage = sharded.stages[1]
    received = sharded.stages[0](x)
    assert torch.equal(torch.compile(stage, fullgraph=True, backend="eager")(*received), stage(*received))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _TripledBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 3


class _Blocks(nn.Module):
    """Blocks the capture traces through: their code is in the stages' graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _served_after(model: nn.Module, change: object) -> autoshard.ShardedModel:
    """``model``, sharded and called once (the next call compares what that one read), then ``change(model)``:
    its next two calls answer as the model does."""
    torch.manual_seed(0)
    model, x = model.eval(), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), verify=False)
    assert torch.equal(sharded(x), model(x))
    change(model)
    for _ in range(2):
        assert torch.equal(sharded(x), model(x))
    return sharded


@pytest.mark.parametrize("patch", [
    lambda m: setattr(m.blocks[2], "forward", lambda x: x * 10),
    lambda m: setattr(m.blocks[2], "__class__", _TripledBlock),
    lambda m: setattr(m, "forward", lambda x: -m.blocks[1](m.blocks[0](x))),
])
def test_a_forward_patched_or_a_class_swapped_on_a_module_traced_through_is_captured_again(patch):
    """The stages held the code a module ran at capture; patched after sharding (found by a helper probe), they
    went on computing it, silently. Seen by the first stage's check: the model is captured with the new code."""
    sharded = _served_after(_Blocks(), patch)
    assert len(sharded.specializations) == 1  # served by it from then on


class _NamedBlocks(nn.Module):
    """Blocks in a ``ModuleDict`` the forward iterates."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: _Block() for name in "abcd"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


@pytest.mark.parametrize("model_class, change", [
    (_Blocks, lambda m: m.blocks.append(_Block())),
    (_Blocks, lambda m: m.blocks.__delitem__(1)),  # (renumbers the rest: a new dict of submodules)
    (_Blocks, lambda m: m.blocks.insert(0, _Block())),
    (_Blocks, lambda m: m.blocks.pop(3)),
    (_NamedBlocks, lambda m: m.blocks.pop("b")),
    (_NamedBlocks, lambda m: m.blocks.update({"e": _Block()})),
    (_Blocks, lambda m: setattr(m.blocks[2], "extra", nn.Linear(8, 8))),  # (not called: served as before)
])
def test_a_container_the_traced_code_iterated_changed_after_sharding_is_captured_again(model_class, change):
    """A layer appended, deleted or inserted in a ``ModuleList`` or ``ModuleDict`` the forward loops over (pruning
    a layer): the stages went on calling the layers held at sharding (a helper probe: a pruned DistilBERT answered
    0.012 off, silently). The first stage compares those containers' submodules with the ones it was captured with."""
    _served_after(model_class(), change)


class _Gelu(nn.Module):
    """An activation of the model's own, which the capture traces through (Hugging Face's ``NewGELUActivation``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x)


class _Activated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.act = _Gelu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.act(block(x))
        return x


class _Tanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "act", _Tanh()),
    lambda m: m._modules.__setitem__("act", _Tanh()),  # (no registration hook: torch.ao's swaps write so)
])
def test_a_module_traced_through_assigned_anew_is_captured_again(change):
    """Its code is in the stages' graphs, and it holds no weight the rebinding watch would see: an activation
    swapped after sharding (GPT-2's ``mlp.act = nn.ReLU()``, a helper probe) was served with the old one."""
    _served_after(_Activated(), change)


def test_the_first_stage_counts_a_containers_submodules_and_reads_each_by_name_not_its_keys():
    """A container's submodules are compared by their count and by each name (``LENGTH``, an item or ``HOLDS``),
    not by comparing its keys with a frozenset, which hashed every name on every call (a third of a tiny GPT-2's
    first-stage check): no ``EQUALS`` read of a keys view is left in the check."""
    sharded = _served_after(_NamedBlocks(), lambda m: None)
    reads, seen = sharded.__dict__["_state_at_capture"].reads_now()
    keys_view = type({}.keys())
    assert not any(isinstance(owner, keys_view) for owner, _, _ in reads)
    blocks = sharded.__dict__["_model_held"].model.blocks._modules
    assert seen[reads.index((blocks, NO_KEY, held_state.LENGTH))] == 4
    assert all((blocks, name, "") in reads for name in "abcd")


def test_a_kept_length_read_passes_while_the_count_is_as_read():
    registry = {"a": 1, "b": 2}
    check = kept_check([(registry, NO_KEY, held_state.LENGTH), (registry, "a", held_state.HOLDS)], [2, True],
                       "passed", lambda flag: "full")
    assert check(None) == "passed"
    registry["c"] = 3
    assert check(None) == "full"
    del registry["a"]
    assert check(None) == "full"  # as many as read, but not the same names


@pytest.mark.parametrize("change", [
    lambda m: m.blocks.update({"e": m.blocks.pop("b")}),  # renamed: as many submodules, one name another
    lambda m: m.blocks._modules.__setitem__("b", _Block()),  # assigned anew, through the dict
])
def test_a_container_changed_but_not_in_its_count_is_captured_again(change):
    """The count and the names read stand for the keys compared: a submodule renamed or assigned anew leaves the
    count as it was and is still seen."""
    sharded = _served_after(_NamedBlocks(), change)
    assert len(sharded.specializations) == 1


class _LooksUp(nn.Linear):
    """A module that records each attribute looked up on it by name (``__getattribute__``)."""

    looked_up: list[str] = []

    def __getattribute__(self, name: str) -> object:
        _LooksUp.looked_up.append(name)
        return super().__getattribute__(name)


def test_a_kept_check_reads_a_modules_class_and_flag_without_an_attribute_lookup():
    """``type(m)`` and the flag in ``m.__dict__`` (what ``m.__class__`` and ``m.training`` find): a module's class
    defines ``__getattr__``, so each attribute read took Python's slow path, twice the cost of a dict's item."""
    module = _LooksUp(1, 1)
    check = kept_check([(module, NO_KEY, "__class__"), (module, NO_KEY, "training")], [_LooksUp, True],
                       "passed", lambda flag: "full")
    _LooksUp.looked_up.clear()
    assert check(None) == "passed"
    assert _LooksUp.looked_up == []
    module.eval()
    assert check(None) == "full"
    module.train()
    module.__class__ = nn.Linear
    assert check(None) == "full"


class _FlagElsewhere(nn.Linear):
    """A module whose class answers ``training`` itself (a data descriptor), whatever its ``__dict__`` holds."""

    frozen = False

    @property
    def training(self) -> bool:
        return not self.frozen

    @training.setter
    def training(self, mode: bool) -> None:
        self.__dict__["training"] = mode  # (left there, and not what the attribute finds)


def test_a_kept_check_reads_a_flag_a_class_answers_through_the_class():
    module = _FlagElsewhere(1, 1)
    check = kept_check([(module, NO_KEY, "training")], [True], "passed", lambda flag: "full")
    assert check(None) == "passed"
    module.frozen = True
    assert check(None) == "full"


def test_a_stages_device_read_walks_a_batch_dict_to_its_first_tensor_without_pytree(monkeypatch):
    """``stage_device`` (``torch.arange(n, device=x.device)`` in a stage taking a batch dict) flattened the whole
    argument with pytree on every call; a dict, list or tuple is walked up to its first tensor, in pytree's
    order, and any other container still by pytree."""
    from torch.utils._pytree import tree_leaves

    from autoshard import emit
    flattened: list[object] = []
    monkeypatch.setattr(emit, "tree_leaves", lambda value: flattened.append(value) or tree_leaves(value))
    cpu, meta = torch.device("cpu"), torch.zeros(1, device="meta")
    assert emit.stage_device(cpu, {"n": 3, "x": [None, (meta,)]}, torch.zeros(1)) == meta.device
    assert emit.stage_device(meta.device, {"n": 3}, [None, "s"]) == meta.device  # no tensor: the default
    assert flattened == []
    pair = collections.namedtuple("Pair", "a b")(1, meta)
    assert emit.stage_device(cpu, {"p": pair}, torch.zeros(1)) == meta.device  # (pytree's: the namedtuple's)
    assert flattened == [pair]


class _ReadsNested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, batch: dict[str, object]) -> torch.Tensor:
        first, second = batch["pair"]
        return self.layers(batch["x"] + first * second)


def test_an_export_plan_reads_a_container_arguments_tensors_by_path_not_by_flattening_it():
    """torch.export takes a container's tensors flat; the first stage found them with ``tree_leaves`` on every
    call. It reads each by its path (``batch['pair'][0]``), as fx's code does: the input guard holds the call's
    containers to the example's, so a dict with its keys in another order is still captured again."""
    torch.manual_seed(0)
    model, tensors = _ReadsNested().eval(), [torch.randn(2, 8) for _ in range(3)]
    batch = {"x": tensors[0], "pair": [tensors[1], tensors[2]]}
    pipeline = "export,shape-prop,build-dag,linearize,split,emit,verify"
    sharded = autoshard.shard_model(model, 2, (batch,), pipeline=pipeline)
    assert "tree_leaves" not in sharded.stages[0].code
    other = {"x": torch.randn(2, 8), "pair": [torch.randn(2, 8), torch.randn(2, 8)]}
    assert torch.equal(sharded(other), model(other))
    reordered = {"pair": other["pair"], "x": other["x"]}
    assert torch.equal(sharded(reordered), model(reordered))
    assert len(sharded.specializations) == 1
