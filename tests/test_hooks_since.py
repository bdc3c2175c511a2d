"""A hook registered after sharding on a module the capture traced through is run: the model is
captured again with it (or the call refused), never run without it silently. One counter keeps the
check cheap: only a hook registered anywhere makes the first stage check the hook dicts in full."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import autoshard
from autoshard.capture.held_state import HeldState, StayAsCaptured
from autoshard.errors import InputMismatchError, SpecializationMismatch
from autoshard.runtime.offload import OffloadRunner
from autoshard.runtime.stage import stage_module


def _layers(count: int = 4) -> nn.Sequential:
    """Layers the capture traces through (an ``nn.Sequential`` of its own), each of two leaves."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(count)])


X = torch.randn(3, 8)


def test_a_hook_registered_again_with_other_flags_is_not_served_by_the_plan_that_traced_it():
    """The same function registered again ``with_kwargs=True`` is called another way: the plan that traced it
    registered plainly is not the model's (a mutation test compared the hooks alone: x * 2 where the model
    gave x * 3)."""
    model = _layers()

    def pre(module: nn.Module, args: tuple, kwargs: dict | None = None) -> object:
        return (args[0] * 2,) if kwargs is None else ((args[0] * 3,), kwargs)

    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    handle = model.register_forward_pre_hook(pre)
    assert torch.equal(sharded(X), model(X))
    handle.remove()
    model.register_forward_pre_hook(pre, with_kwargs=True)
    assert torch.equal(sharded(X), model(X))
    assert len(sharded.specializations) == 2


def test_a_pre_hook_on_a_layer_whose_forward_hooks_the_graph_runs_is_run():
    """The graph runs a traced layer's forward hooks as they are at each call, not its pre-hooks: those stay
    watched (a mutation test unwatched every hook dict of such a layer: the pre-hook never ran)."""
    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    model[1].register_forward_hook(lambda module, args, out: out * 10)
    assert torch.equal(sharded(X), model(X))
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 3,))
    assert torch.equal(sharded(X), model(X))
    assert len(sharded.specializations) == 2


def test_a_forward_hook_added_to_a_traced_layer_runs_and_removing_it_serves_the_first_plan_again():
    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    before = sharded(X)
    handle = model[1].register_forward_hook(lambda module, args, out: out * 100)
    assert torch.equal(sharded(X), model(X)) and not torch.equal(sharded(X), before)
    (made,) = sharded.specializations
    assert "forward hooks on 1" in made.describe()
    handle.remove()
    assert torch.equal(sharded(X), before) and len(sharded.specializations) == 1


@pytest.mark.parametrize("register", [
    lambda model: model[2].register_forward_pre_hook(lambda module, args: (args[0] * 3,)),
    lambda model: model.register_forward_hook(lambda module, args, out: out - 1),  # the model's own
], ids=["pre-hook", "root"])
def test_pre_hooks_and_hooks_on_the_model_itself_are_run_too(register):
    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    before = sharded(X)
    handle = register(model)
    try:
        assert torch.equal(sharded(X), model(X)) and not torch.equal(model(X), before)
        assert len(sharded.specializations) == 1
    finally:
        handle.remove()


class _Branching(nn.Module):
    """A branch on the input at the top that fx cannot trace: torch.export captures it, tracing the hooks
    its layers hold into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _layers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous():
            x = x + 0
        return self.layers(x)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_a_hook_traced_into_the_graph_and_removed_or_replaced_is_not_run(front_end):
    """A capture made while a hook was held ran it in its graph (torch.export's, or fx's of the model's own
    pre-hook): once the hook was removed, the specialisation made with it went on serving calls (a removal
    takes no hook id), and one replaced by another passed the check, which looked for hooks gained only."""
    model = _layers() if front_end == "fx" else _Branching()
    assert autoshard.capture.capture(model, (X,)).front_end == front_end
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    hooked = model if front_end == "fx" else model.layers[1]
    handle = hooked.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    assert torch.equal(sharded(X), model(X)) and len(sharded.specializations) == 1
    handle.remove()
    assert torch.equal(sharded(X), model(X)) and len(sharded.specializations) == 1
    handle = hooked.register_forward_pre_hook(lambda module, args: (args[0] + 3,))
    assert torch.equal(sharded(X), model(X)) and len(sharded.specializations) == 2
    handle.remove()


def test_the_limit_reached_by_captures_made_for_hooks_registered_since_says_so():
    """Transformers installs output recorders on every layer on the first call asking for hidden states:
    from then on every call needed a capture of its own, and the limit said only to raise it (serving probe)."""
    model = _Branching()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,), max_specializations=1)
    model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with pytest.warns(autoshard.specialize.SpecializationLimitWarning):
        assert torch.equal(sharded(X), model(X))
    with pytest.raises(InputMismatchError, match=r"1 of them were made because hooks were registered on the "
                                                 r"model's modules since: shard the model with such a call as the"):
        sharded(torch.randn(8, 3).t())  # (not contiguous: the other branch)


def test_plans_made_before_hooks_were_registered_are_dropped_at_the_limit():
    """After Transformers installed its output recorders, the plans made before served no call, yet
    counted: a model serving a few kinds of call ran out of plans after the first hidden-states call
    (serving probe: GPT-2, Llama, BERT, T5)."""
    model, other = _Branching(), torch.randn(8, 3).t()  # (not contiguous: the other branch)
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,), max_specializations=2)
    assert torch.equal(sharded(other), model(other))
    model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.specialize.SpecializationLimitWarning)  # one plan can be dropped
        assert torch.equal(sharded(X), model(X))
    with pytest.warns(autoshard.specialize.SpecializationLimitWarning):  # (the limit reached by plans that serve)
        assert torch.equal(sharded(other), model(other))
    assert sharded.specializer.retired == 1 and len(sharded.specializations) == 2
    assert all(made.sharded.hooks_hold() for made in sharded.specializations)
    for _ in range(2):  # both served by the plans made with the hook
        assert torch.equal(sharded(X), model(X)) and torch.equal(sharded(other), model(other))
    assert len(sharded.specializations) == 2


def test_hooks_registered_on_every_call_are_refused_once_max_specializations_plans_were_dropped():
    """Dropping the plans made for hooks no longer held has a limit too: a model gaining a hook on every
    call would otherwise be captured again on every call."""
    model = _Branching()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,), max_specializations=2)
    for step in range(4):
        model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
        assert torch.equal(sharded(X), model(X))
    assert sharded.specializer.retired == 2 and len(sharded.specializations) == 2
    model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    with pytest.raises(InputMismatchError, match=r"made because hooks were registered on the model's modules since, "
                                                 r"and 2 plans made for the hooks before were dropped \(at most"):
        sharded(X)


def test_the_same_hook_registered_again_each_step_is_served_by_one_capture():
    """A hook held at capture was compared by its handle's id, which each registration takes anew: a
    hook added and removed around every step made a new capture each step, up to the limit, then a
    refusal."""
    model = _Branching()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))

    def doubled(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * 2
    for step in range(12):
        handle = model.layers[1].register_forward_hook(doubled, with_kwargs=False)
        assert torch.equal(sharded(X), model(X))
        handle.remove()
        if step % 3 == 0:
            assert torch.equal(sharded(X), model(X))
    assert len(sharded.specializations) == 1


def test_a_hook_made_anew_for_each_call_of_a_traced_layer_is_served_by_one_capture():
    """A feature extractor registers a closure of its own making before each call: compared by
    identity, each new one made a capture of its own (eight, then every call refused), though the
    plan runs that layer's forward hooks as it finds them at each call."""
    model, seen = _layers(), []
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    for step in range(12):
        handle = model[1].register_forward_hook(lambda module, args, out, step=step: (seen.append(step), out + step)[1])
        got = sharded(X)
        ran = list(seen)
        assert torch.equal(got, model(X))
        assert ran[-1] == step and ran.count(step) == 1  # (the first call's capture ran it too: set back)
        handle.remove()
    assert torch.equal(sharded(X), model(X))  # and without the hook, by the same plan
    assert len(sharded.specializations) == 1


_GLOBAL_LOG: list = []


class _Recorder:
    def __init__(self) -> None:
        self.outputs: list = []
        self.calls = 0

    def record(self, module, args, out) -> None:
        self.outputs.append(out)
        self.calls += 1


def _collecting_hooks():
    """Hooks keeping what they see in a closure's list, a counter they rebind, their script's
    globals and the object whose method they are; and a read of what each has seen."""
    closure_log: list = []
    count = 0

    def counting(module, args, out) -> None:
        nonlocal count
        count += 1

    def global_log(module, args, out) -> None:
        _GLOBAL_LOG.append(out)

    recorder = _Recorder()
    hooks = {"closure list": lambda module, args, out: closure_log.append(out), "counter": counting,
             "global list": global_log, "method": recorder.record}
    seen = {"closure list": lambda: closure_log, "counter": lambda: [None] * count,
            "global list": lambda: _GLOBAL_LOG, "method": lambda: recorder.outputs[:recorder.calls]}
    return hooks, seen


@pytest.mark.parametrize("where", ["closure list", "counter", "global list", "method"])
@pytest.mark.parametrize("when", ["before sharding", "after sharding"])
def test_a_hook_sees_each_call_once_and_none_of_the_capture_s_runs(where, when):
    """A capture runs the model and its graph many times (on the example, on fake tensors, to
    verify): a hook collecting the model's outputs kept 21 of them from one call (one a fake tensor)."""
    _GLOBAL_LOG.clear()
    model = _layers()
    hooks, seen = _collecting_hooks()
    if when == "before sharding":
        model.register_forward_hook(hooks[where])
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    assert seen[where]() == []
    if when == "after sharding":
        model.register_forward_hook(hooks[where])  # the model's own: the call captures again
    got = sharded(X)
    assert len(seen[where]()) == 1
    if where != "counter":
        (kept,) = seen[where]()
        assert type(kept) is torch.Tensor and torch.equal(kept, got)
    sharded(X)
    assert len(seen[where]()) == 2


class _Wrapped(nn.Module):
    """Its layers under a child named ``model``, as in Transformers' ``LlamaForCausalLM``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _layers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@pytest.mark.parametrize("pipeline", [None, "export,shape-prop,build-dag,linearize,split,emit,verify"])
def test_a_hook_on_a_layer_under_a_child_named_model_is_run_too(pipeline):
    model = _Wrapped()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,), respecialize=False,
                                    **({"pipeline": pipeline} if pipeline else {}))
    model.model[1].register_forward_hook(lambda module, args, out: out * 100)
    with pytest.raises(SpecializationMismatch, match="the model's model.1 has a forward hook now"):
        sharded(X)


def test_without_respecialize_the_call_is_refused_naming_the_module_and_the_hook():
    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,), respecialize=False)
    model[3].register_forward_hook(lambda module, args, out: out)
    with pytest.raises(SpecializationMismatch, match="the model's 3 has a forward hook now"):
        sharded(X)


def test_a_hook_on_a_module_called_whole_runs_in_its_stage_without_a_new_capture():
    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    seen = []
    model[2][0].register_forward_hook(lambda module, args, out: seen.append(out.shape) or out + 1)
    assert torch.equal(sharded(X), model(X)) and seen == [X.shape] * 2
    assert len(sharded.specializations) == 0


def test_a_pre_hook_on_a_layer_the_plan_split_is_refused_saying_why():
    """A forward pre-hook keeps its module whole (it may change the inputs the body was traced on); a
    layer whose weights the plan put in two stages cannot be, so the call is refused, never run
    without the hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]))
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    model[0].register_forward_pre_hook(lambda module, args: (args[0] * 3,))
    with pytest.raises(InputMismatchError, match="has a forward pre-hook now"):
        sharded(X)


def test_the_hook_dicts_are_looked_at_only_after_a_hook_was_registered_and_never_checked_in_full(monkeypatch):
    """One counter is compared on every call; a hook registered anywhere (here a tensor's) makes the
    next call look at the dicts once (each watcher's: the first stage's of the modules it traced
    through, and each stage's of the modules whose forward it calls straight), and none makes a
    stage check everything in full."""
    full, looked = [], []
    checked, changed = HeldState.check_in_full, StayAsCaptured.changed
    monkeypatch.setattr(HeldState, "check_in_full", lambda self, training: full.append(1) or checked(self, training))
    monkeypatch.setattr(StayAsCaptured, "changed", lambda self: looked.append(id(self)) or changed(self))
    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    sharded(X)
    full.clear()
    looked.clear()  # the first call checked in full, the dicts with it
    for _ in range(3):
        sharded(X)
    assert looked == [] and full == []
    X.clone().requires_grad_().register_hook(lambda grad: grad)  # any hook, anywhere, moves the counter
    sharded(X)
    watchers = len(looked)
    for _ in range(2):
        sharded(X)
    assert watchers == len(set(looked)) == len(looked) == 3 and full == [] and len(sharded.specializations) == 0


def test_a_profiler_s_global_hooks_neither_capture_again_nor_change_the_outputs():
    """``FlopCounterMode`` observes a call through global module hooks: they run for the modules and
    stages called, and are not the model's to capture."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _layers()
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    with FlopCounterMode(display=False) as counter:
        out = sharded(X)
    assert torch.equal(out, model(X)) and counter.get_total_flops() == 4 * 2 * 3 * 8 * 8
    assert len(sharded.specializations) == 0


def _hook_every_leaf(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if not module._modules:
            module.register_forward_hook(lambda module, args, out: out)
    return model


def _chained_stage_modules(sharded):
    """The stages as ``pipeline_stage`` runs them (``stage_module``: copies taking and returning tensors)."""
    modules = [stage_module(sharded, index, torch.device("cpu")) for index in range(sharded.num_stages)]

    def run(x):
        values = (x,)
        for module in modules:
            values = module(*values)
            values = values if isinstance(values, tuple) else (values,)
        return values[0]
    return run


RUNTIMES = {"sharded": lambda sharded: sharded, "offload": lambda sharded: OffloadRunner(sharded, "cpu"),
            "pipeline stages": _chained_stage_modules}


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("register", [torch.nn.modules.module.register_module_full_backward_hook,
                                      torch.nn.modules.module.register_module_full_backward_pre_hook])
@pytest.mark.parametrize("registered", ["before the first call", "after a call"])
@pytest.mark.parametrize("modules_called", ["straight", "whole"])
def test_a_global_backward_hook_is_refused_by_every_runtime(register, runtime, registered, modules_called):
    """It ran on the stages too (not the model's modules), so a hook scaling gradients scaled them
    once more a stage: the input's gradient was 4x the model's. Each stage checks it itself, so a
    runtime's copies of the stages refuse it too, whether the stage calls its modules' forwards
    straight or (each with a forward hook) whole."""
    model = _layers()
    if modules_called == "whole":
        _hook_every_leaf(model)
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    run = RUNTIMES[runtime](sharded)
    if registered == "after a call":
        assert torch.equal(run(X), model(X))
    handle = register(lambda module, *grads: tuple(g * 2 if g is not None else None for g in grads[0]))
    try:
        with pytest.raises(InputMismatchError, match="global module backward hook"):
            run(X.clone().requires_grad_())
    finally:
        handle.remove()
    assert torch.equal(run(X), model(X))


def test_a_stage_alone_refuses_a_global_backward_hook_registered_after_its_first_call():
    """As a pipeline's later rank runs its stage: only the first stage also watches the model's hooks."""
    model = _hook_every_leaf(_layers())  # so the stage calls its modules whole
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    last = stage_module(sharded, 1, torch.device("cpu"))
    received = stage_module(sharded, 0, torch.device("cpu"))(X)
    received = received if isinstance(received, tuple) else (received,)
    assert torch.equal(last(*received), model(X))
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda module, grad_in, grad_out: None)
    try:
        with pytest.raises(InputMismatchError, match="global module backward hook"):
            last(*received)
    finally:
        handle.remove()
    assert torch.equal(last(*received), model(X))


class _ReadsItsMode(nn.Module):
    """Traced through, with no module of its own: its mode is read by its traced code alone."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x @ self.weight, 0.5, self.training)


def test_a_traced_layer_under_a_child_named_model_switched_to_another_mode_is_seen():
    """The modules whose code a plan runs are found by their paths in the model, ``model.`` included."""
    model = _Wrapped()
    model.model = nn.Sequential(_ReadsItsMode(), _ReadsItsMode()).eval()
    sharded = autoshard.shard_model(model.eval(), 2, example_inputs=(X,), respecialize=False)
    model.model[1].train()
    with pytest.raises(InputMismatchError, match="switched to another mode"):
        sharded(X)


def test_a_hook_whose_closure_holds_a_recursive_helper_is_walked_once():
    """The helper's closure holds the helper: the walk of what hooks keep looped for ever."""
    seen: list = []

    def flatten(value):
        return [y for item in value for y in flatten(item)] if isinstance(value, (list, tuple)) else [value]

    model = _layers()
    model.register_forward_hook(lambda module, args, out: seen.extend(flatten(out)))
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    assert torch.equal(sharded(X), model(X))


def test_a_pre_hook_installing_its_post_hook_once_installs_it_once():
    """Its flag set back after each of the capture's runs, it installed the post hook on every run
    (18 post hooks, each run by every later call)."""
    state = {"installed": False}
    calls: list = []

    def pre(module, args):
        if not state["installed"]:
            module.register_forward_hook(lambda *_: calls.append(1))
            state["installed"] = True

    model = _layers()
    model[0].register_forward_pre_hook(pre)
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    assert len(model[0]._forward_hooks) == 1
    calls.clear()
    sharded(X)
    assert len(calls) == 1


def test_a_one_shot_hook_keeps_what_it_saw_when_a_capture_s_run_removed_it():
    first: list = []

    def once(module, args, out):
        first.append(out)
        handle.remove()

    model = _layers()
    handle = model[0].register_forward_hook(once)
    autoshard.shard_model(model, 2, example_inputs=(X,))
    assert len(first) == 1 and type(first[0]) is torch.Tensor


def test_a_partial_hook_s_bound_list_sees_each_call_once():
    seen: list = []
    model = _layers()
    model.register_forward_hook(functools.partial(lambda store, module, args, out: store.append(out), seen))
    sharded = autoshard.shard_model(model, 2, example_inputs=(X,))
    assert seen == []
    sharded(X)
    assert len(seen) == 1
