"""Plain attributes the traced code read are checked on every call: set anew after sharding, the
model is captured again (or the call refused), never run on the old value silently."""

from __future__ import annotations

import collections
import collections.abc
import copy
import functools
import math
import types

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autoshard
from autoshard.capture.fx import trace_with_leaves
from autoshard.errors import SpecializationMismatch
from autoshard.sharded import StateAtCapture


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 2.0
        self.activation = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.scale
        return torch.relu(y) if self.activation == "relu" else torch.tanh(y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def test_an_attribute_set_anew_after_sharding_is_computed_with():
    model, x = _net(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.second.scale = 5.0
    model.first.activation = "tanh"
    assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1
    model.second.scale, model.first.activation = 2.0, "relu"  # back: the first capture serves it again
    assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1


def test_without_respecialize_the_call_is_refused_naming_the_attribute():
    model, x = _net(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,), respecialize=False)
    model.second.scale = float("2")  # another object, the same value: served
    assert torch.equal(sharded(x), model(x))
    model.second.scale = 3.0
    with pytest.raises(SpecializationMismatch, match=r"second\.scale is float 3\.0 now.* was float 2\.0"):
        sharded(x)
    del model.second.scale
    with pytest.raises(SpecializationMismatch, match=r"second\.scale is unset now"):
        sharded(x)


class Offset(nn.Module):
    """Keeps a tensor as a plain attribute (neither parameter nor buffer), which the graph holds."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.offset = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)) + self.offset)


@pytest.mark.parametrize("front_end", ["trace", "export"])
def test_a_tensor_attribute_set_anew_is_computed_with_and_one_changed_in_place_too(front_end):
    """Set to another tensor after sharding, the stages went on adding the old one, silently."""
    torch.manual_seed(0)
    model, x = Offset().eval(), torch.randn(3, 4)
    pipeline = str(autoshard.default_pipeline(2)).replace("capture", front_end, 1)
    sharded = autoshard.shard_model(model, 2, (x,), pipeline=pipeline)
    model.offset.add_(1.0)  # in place: the graph holds this tensor
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 0
    model.offset = torch.full((4,), 5.0)
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1
    refusing = autoshard.shard_model(model, 2, (x,), pipeline=pipeline, respecialize=False)
    model.offset = model.offset.clone()  # equal values, another tensor: a change in place would not reach it
    with pytest.raises(SpecializationMismatch, match="the model's offset was set to another tensor since the stages"):
        refusing(x)


class Counting(nn.Module):
    """Sets a scratch attribute before reading it (as Funnel does): the call fixes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.mult = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mult = 1
        for _ in range(2):
            x = self.linear(x) * self.mult
            self.mult *= 2
        return x


def test_an_attribute_the_call_writes_before_reading_is_not_checked():
    torch.manual_seed(0)
    model, x = Counting().eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,), respecialize=False)
    expected = model(x)  # leaves mult at 4
    assert model.mult == 4
    assert torch.equal(sharded(x), expected)


class Thresholded(nn.Module):
    """Kept whole: its Python branches on a tensor's value, so it reads ``threshold`` on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.threshold = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > self.threshold else x - 1


class WithWholeModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(4, 4), Thresholded(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(self.a(x)))


def test_reads_by_a_module_kept_whole_are_made_by_its_call_and_not_checked():
    torch.manual_seed(0)
    model, x = WithWholeModule().eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert any(leaf.name == "gate" for leaf in sharded.plan.wrapped)
    model.gate.threshold = 1e9
    assert torch.equal(sharded(x), model(x))
    assert sharded.specializations == ()


def test_the_trace_reads_what_the_traced_code_read_and_leaves_no_hook_behind():
    model, x = _net(), torch.randn(3, 4)
    reads = trace_with_leaves(model, (x,)).attributes_read
    assert {(read.holder, read.name, read.value) for read in reads} == {
        (block, name, value) for block in (model.first, model.second)
        for name, value in (("scale", 2.0), ("activation", "relu"))}
    assert "__getattribute__" not in vars(nn.Module)


def test_a_config_field_read_by_a_hugging_face_model_is_checked():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, 2, (ids,))
    assert sharded(ids).hidden_states is None
    model.config.output_hidden_states = True
    out, expected = sharded(ids), model(ids)
    assert len(out.hidden_states) == 3
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, expected.hidden_states))
    assert "__getattribute__" not in vars(type(config))


def test_a_runtime_choosing_its_plan_by_shape_takes_the_capture_made_for_the_attributes_now():
    model, x = _net(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.second.scale = 5.0
    served = sharded.specializer.plan_for(sharded, (x,), {})
    assert served is not sharded
    assert torch.equal(served(x), model(x))
    model.second.scale = 2.0
    assert sharded.specializer.plan_for(sharded, (x,), {}) is sharded


def test_a_specialisation_made_for_an_attribute_names_it():
    model, x = _net(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.second.scale = 5.0
    sharded(x)
    assert "with the model's second.scale=5.0 (" in sharded.specializations[0].describe()


class NamespaceSettings(nn.Module):
    """Keeps its settings in a ``types.SimpleNamespace``, whose built-in class takes no hook."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = types.SimpleNamespace(scale=2.0, unused="x")
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.settings.scale)


def test_a_settings_object_of_a_built_in_class_is_checked_whole():
    torch.manual_seed(0)
    model, x = NamespaceSettings().eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.settings.scale = 3.0
    assert torch.equal(sharded(x), model(x))
    assert len(sharded.specializations) == 1


class ClassDefaults(nn.Module):
    """Reads a class attribute, a nested settings object's field, and one it may not have."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.config = types.SimpleNamespace()  # replaced below by a plain class's object
        self.config = Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) * self.scale * getattr(self, "extra", 1.0)
        return self.b(torch.relu(y) if self.config.inner.relu else y)


class Inner:
    relu = True

    def __init__(self) -> None:
        self.relu = True


class Settings:
    def __init__(self) -> None:
        self.inner = Inner()


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "scale", 3.0),  # the instance's own now shadows the class's
    lambda m: setattr(ClassDefaults, "scale", 4.0),
    lambda m: setattr(m, "extra", 0.5),  # had none: getattr's default was read
    lambda m: setattr(m.config.inner, "relu", False),  # a settings object inside one
], ids=["instance-shadows-class", "class", "added", "nested-settings"])
def test_class_attributes_unset_ones_and_nested_settings_are_checked(change, monkeypatch):
    monkeypatch.setattr(ClassDefaults, "scale", 2.0)
    torch.manual_seed(0)
    _set_anew_and_served(ClassDefaults().eval(), change)


class SubDefaults(ClassDefaults):
    """Inherits ``scale`` from ``ClassDefaults``."""


class LeafDefaults(SubDefaults):
    pass


@pytest.mark.parametrize("where", [LeafDefaults, SubDefaults], ids=["own-class", "class-between"])
def test_a_class_attribute_set_on_a_class_before_the_one_it_was_read_from_is_checked(where, monkeypatch):
    """Set on the instance's class or one between it and the class holding it, the value shadows the one read:
    the check reads it through the instance's class (it read the holding class, and the stages ran with 2.0)."""
    monkeypatch.setattr(ClassDefaults, "scale", 2.0)
    torch.manual_seed(0)
    _set_anew_and_served(LeafDefaults().eval(), lambda m: monkeypatch.setattr(where, "scale", 4.0, raising=False))


def _set_anew_and_served(model: nn.Module, change) -> None:
    """``change`` made to ``model`` after sharding changes its output, and a new capture serves it."""
    x = torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    before = sharded(x)
    change(model)
    after = model(x)
    assert not (before.dtype == after.dtype and torch.equal(before, after))
    assert torch.equal(sharded(x), after) and len(sharded.specializations) == 1


class SettingKinds(nn.Module):
    """Reads settings of kinds that were not checked: set anew, the stages computed with the old."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.out_dtype, self.scales, self.table = torch.float32, [1.0, 1.0], {"scale": 1.0}
        self.act, self.nested, self.count = functools.partial(F.leaky_relu, negative_slope=0.1), ([1.0],), np.int64(1)
        self.step = self.plus
        self.config = Settings()

    def plus(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def minus(self, x: torch.Tensor) -> torch.Tensor:
        return x - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x)) * math.prod(self.scales) * self.table["scale"] * self.nested[0][0] * int(self.count)
        h = self.step(h) if self.config.inner.relu else h
        return self.b(h).to(self.out_dtype)


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "out_dtype", torch.float64),
    lambda m: setattr(m, "scales", [1.0, 3.0]),
    lambda m: setattr(m, "table", {"scale": 5.0}),
    lambda m: setattr(m, "act", functools.partial(F.leaky_relu, negative_slope=0.5)),
    lambda m: setattr(m, "nested", ((3.0,),)),
    lambda m: setattr(m, "count", np.int64(3)),
    lambda m: setattr(m, "step", m.minus),
    lambda m: setattr(m.config, "inner", types.SimpleNamespace(relu=False)),  # the object replaced
    lambda m: m.scales.__setitem__(1, 3.0),  # changed in place: the same list, another item
    lambda m: m.scales.append(3.0),
    lambda m: m.table.update(scale=5.0),
    lambda m: m.nested[0].__setitem__(0, 3.0),
], ids=["dtype", "list", "dict", "partial", "nested-tuple", "numpy-scalar", "bound-method", "settings-replaced",
        "list-in-place", "list-grown", "dict-in-place", "list-in-a-tuple-in-place"])
def test_settings_of_every_kind_set_anew_are_computed_with(change):
    torch.manual_seed(0)
    _set_anew_and_served(SettingKinds().eval(), change)


class _Scaler:
    """A helper object the forward calls: its fields are settings too."""

    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class _Options(collections.abc.Mapping):
    """A read-only mapping of its own class, over a dict it keeps."""

    def __init__(self, **options: float) -> None:
        self._options = dict(options)

    def __getitem__(self, key: str) -> float:
        return self._options[key]

    def __iter__(self) -> Any:
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)


class MoreSettingKinds(nn.Module):
    """Reads settings of kinds a helper probe found unchecked (set anew or changed in place, the stages computed
    with the old): a class, a range, a slice, a complex number, bytes, a deque, a defaultdict, a UserDict, a
    mapping of its own class, a numpy array, a helper object it calls, and a method of its own class."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.act, self.columns, self.cut, self.factor, self.tag = nn.ReLU, range(0, 5), slice(0, 4), 2 + 0j, b"x2"
        self.recent = collections.deque([1.0], maxlen=2)
        self.defaults = collections.defaultdict(float, scale=1.0)
        self.user, self.options = collections.UserDict(scale=1.0), _Options(scale=1.0)
        self.table, self.scaler = np.array([1.0, 2.0]), _Scaler(1.0)

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.act()(self.a(x) - 0.1), -x], 1)[:, list(self.columns)][:, self.cut] * self.factor.real
        h = h * (2.0 if self.tag == b"x2" else 3.0) * self.recent[0] * self.defaults["scale"]
        h = h * self.user["scale"] * self.options["scale"] * torch.from_numpy(self.table).float()[0]
        return self.b(self.helper(self.scaler(h)))


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "act", nn.Tanh), lambda m: setattr(m, "columns", range(1, 5)),
    lambda m: setattr(m, "cut", slice(1, 5)), lambda m: setattr(m, "factor", 3 + 0j),
    lambda m: setattr(m, "tag", b"x3"), lambda m: m.recent.appendleft(2.0),
    lambda m: m.defaults.__setitem__("scale", 2.0), lambda m: m.user.__setitem__("scale", 2.0),
    lambda m: m.options._options.__setitem__("scale", 2.0), lambda m: m.table.__setitem__(0, 2.0),
    lambda m: setattr(m, "table", np.array([3.0, 2.0])), lambda m: setattr(m.scaler, "k", 2.0),
    lambda m: setattr(m, "scaler", _Scaler(2.0)), lambda m: setattr(m, "helper", lambda x: x - 1),
    lambda m: m.scaler.__dict__.__setitem__("k", 2.0),
], ids=["class", "range", "slice", "complex", "bytes", "deque-in-place", "defaultdict-in-place",
        "userdict-in-place", "own-mapping-in-place", "array-in-place", "array", "helper-object-field",
        "helper-object", "method-on-the-module", "helper-object-field-through-its-dict"])
def test_more_settings_of_every_kind_changed_are_computed_with(change):
    torch.manual_seed(0)
    _set_anew_and_served(MoreSettingKinds().eval(), change)


def test_a_method_patched_on_the_class_is_computed_with(monkeypatch):
    """The method's code is in the graph (fx traced through it): patched on the class, as attention patches
    do (``GPT2Attention._attn = ...``), the stages computed with the old code."""
    torch.manual_seed(0)
    _set_anew_and_served(MoreSettingKinds().eval(),
                         lambda m: monkeypatch.setattr(MoreSettingKinds, "helper", lambda self, x: x * 3))


def test_a_numpy_scalar_the_forward_computes_with_is_served():
    """fx takes an ``np.float64`` as the float it subclasses, and wrote ``np.float64(2.0)`` into the stage's code,
    which has no ``np``: sharding failed with a NameError at verification."""
    torch.manual_seed(0)
    model = Block().eval()
    model.scale = np.float64(2.0)
    x = torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    assert torch.equal(sharded(x), model(x))
    model.scale = np.float64(3.0)  # checked as the value it is: another captures again
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1


class _Tags(list):
    pass


class ContainerKinds(nn.Module):
    """Settings in containers of other classes: an ``OrderedDict``, a list of a class of its own, a set."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.table, self.tags, self.skip = collections.OrderedDict(scale=1.0), _Tags(["relu"]), {"none"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.table["scale"]
        h = torch.relu(h) if self.tags[0] == "relu" else torch.tanh(h)
        return self.b(h if "b" in self.skip else h + 1)


@pytest.mark.parametrize("change", [
    lambda m: m.table.update(scale=2.0), lambda m: m.tags.__setitem__(0, "tanh"), lambda m: m.skip.add("b"),
], ids=["ordered-dict", "list-subclass", "set"])
def test_containers_of_other_classes_changed_in_place_are_computed_with(change):
    """``copied`` and the checks took lists and dicts of those exact classes only: these were neither
    kept as read nor compared, and the stages computed with the old items."""
    torch.manual_seed(0)
    _set_anew_and_served(ContainerKinds().eval(), change)


class FillsItsOwnCache(nn.Module):
    """A forward that changes the containers it reads: a cache filled by length (rotary embeddings'), a
    log appended to on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.cache: dict[int, torch.Tensor] = {}
        self.log: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in self.cache:
            self.cache[n] = torch.arange(n, dtype=torch.float32)[:, None]
        self.log.append(n)
        return self.b(self.a(x) + self.cache[n])


def test_a_container_the_forward_changes_itself_is_watched_by_identity_only():
    """Kept as read and compared, the cache and the log differed at verification (the capture refused
    the model) and on every call after."""
    torch.manual_seed(0)
    model, x = FillsItsOwnCache(), torch.randn(2, 4)
    with pytest.warns(autoshard.StateNotReplayedWarning, match=r"changes FillsItsOwnCache\.log on every call") as seen:
        sharded = autoshard.shard_model(model, 2, (x,))
    assert "cache" not in str(seen[0].message)  # filled on the first call only
    assert model.cache == {} and model.log == []  # sharding leaves the model as it was given
    for _ in range(3):
        assert torch.equal(sharded(x), model(x))
    assert sharded.specializations == ()


class _Decided:
    scale = None  # (on the class: the instance's own attribute is what the first call adds)


class DecidesOnItsFirstCall(nn.Module):
    """A forward that fills a setting in on its first call and computes with it from then on, as a
    Hugging Face model sets ``config.problem_type`` on its first call with labels."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config, self.a, self.b = config, nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.scale is None:
            self.config.scale = 2.0 if x.shape[0] > 1 else 3.0
            self.config.seen = ["decided"]  # (written without a read)
        return self.b(torch.relu(self.a(x))) * self.config.scale


@pytest.mark.parametrize("config", [_Decided, lambda: types.SimpleNamespace(scale=None)], ids=["class", "namespace"])
def test_a_setting_the_forward_fills_in_is_written_by_the_sharded_call_too(config):
    """The graph holds no attribute writes: the setting stayed unset after sharded calls, so a call of
    another shape was captured again with it unset and took the other value (1.5x the model's output);
    and sharding itself left the model's config with the values its runs wrote (a class default
    shadowed, a list). A settings object of a built-in class, whose class takes no hook of ours, too."""
    torch.manual_seed(0)
    model = DecidesOnItsFirstCall(config())
    twin = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (torch.randn(2, 4),))
    assert vars(model.config) == vars(twin.config)  # sharding leaves the model as it was given
    for x in (torch.randn(2, 4), torch.randn(1, 4), torch.randn(2, 4)):
        assert torch.equal(sharded(x), twin(x))
        assert model.config.scale == twin.config.scale == 2.0 and model.config.seen == twin.config.seen == ["decided"]


def test_a_setting_switched_between_calls_is_served_by_the_plan_made_for_it_without_a_full_check(monkeypatch):
    """Each call tried the plan that served the last call of its shapes, whose check failed and ran in
    full to raise, before the plan made for the setting ran: 1.5x the model's time on a small MLP."""
    torch.manual_seed(0)
    model, x = SettingKinds().eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    switched = ([1.0, 1.0], [1.0, 3.0])
    for scales in switched * 2:  # each plan made, and called as it stands
        model.scales = scales
        sharded(x)
    full = []
    checked = StateAtCapture.check_in_full
    monkeypatch.setattr(StateAtCapture, "check_in_full", lambda self, mode: full.append(1) or checked(self, mode))
    for scales in switched * 3:
        model.scales = scales
        assert torch.equal(sharded(x), model(x))
    assert full == [] and len(sharded.specializations) == 1


def test_an_equal_setting_set_anew_is_served_by_the_same_plan():
    torch.manual_seed(0)
    model, x = SettingKinds().eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.scales, model.table, model.count = [1.0, 1.0], {"scale": 1.0}, np.int64(1)
    model.act = functools.partial(F.leaky_relu, negative_slope=0.1)
    assert torch.equal(sharded(x), model(x)) and sharded.specializations == ()


class CondBranches(nn.Module):
    """``torch.cond`` on the data at the top: only export captures it, and its branches are compiled
    by torch.compile's tracer, which refuses a module class's own ``__getattribute__``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.cond(h.sum() > 0, lambda h: self.b(h), lambda h: self.c(h), (h,))


def test_a_model_whose_branches_torch_compile_traces_is_exported_without_the_recorder():
    torch.manual_seed(0)
    model, x = CondBranches(), torch.randn(2, 8)
    result = autoshard.capture.capture(model, (x,))
    assert result.front_end == "export" and result.attributes_read == ()
    assert "__getattribute__" not in vars(nn.Module)


def test_a_tuple_of_tensors_set_anew_is_computed_with():
    torch.manual_seed(0)
    model, x = _net(), torch.randn(3, 4)
    model.first.offsets = (torch.zeros(4), torch.ones(4))
    model.first.forward = lambda h: Block.forward(model.first, h + model.first.offsets[1])
    sharded = autoshard.shard_model(model, 2, (x,))
    model.first.offsets = (torch.zeros(4), torch.full((4,), 3.0))
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1


class _Counting(nn.Module):
    """Counts its calls: it writes its own state, so the plan calls it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(8, 8), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


class _WarmingUp(nn.Module):
    """Reads the count its kept-whole counter has just moved on: a warm-up for its first two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.counter, self.head = _Counting(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.counter(x)
        if self.counter.calls <= 2:
            h = h * 0
        return self.head(h)


def test_a_count_moved_by_code_kept_whole_and_read_after_it_is_checked_never_frozen():
    """The read of ``counter.calls`` after the counter ran was dropped (the capture's refused write of it
    looked like the trace's own, and the value read was one its run had set): no check, and the stages
    kept the warm-up's path from the third call on (and after the count was reset) — a wrong answer."""
    torch.manual_seed(0)
    model, x = _WarmingUp().eval(), torch.randn(2, 8)
    reference = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (x,), max_specializations=4)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(sharded(x), reference(x))
        model.counter.calls = reference.counter.calls = 0
        assert torch.equal(sharded(x), reference(x))
        with pytest.raises(autoshard.InputMismatchError, match=r"counter\.calls is int \d+ now.*max_specializations"):
            for _ in range(8):
                sharded(x)


class _FillsInItsScale(nn.Module):
    """Fills in its scale on its first call: it writes its own state, so the plan calls it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.scale = nn.Linear(8, 8), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = 2
        return self.linear(x)


class _ScaledByWhatItsLayerFilledIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lazy, self.head = _FillsInItsScale(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lazy(x) * self.lazy.scale)


def test_a_setting_code_kept_whole_fills_in_once_is_served_by_one_more_plan_and_settles():
    """Read after the layer filled it in, the scale counted as moving on every call: a pipeline (which runs
    one plan for every microbatch) refused the model, which takes one more capture and is then served."""
    torch.manual_seed(0)
    model, x = _ScaledByWhatItsLayerFilledIn().eval(), torch.randn(2, 8)
    reference = copy.deepcopy(model)
    sharded = autoshard.shard_model(model, 2, (x,))
    settled = sharded.specializer.settled(sharded, sharded)  # the plan for the model as its first call leaves it
    assert settled is not sharded and model.lazy.scale == 2 and not settled.attributes_moved_by_each_call()
    reference(x)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(settled.run_stages((x,), {}), reference(x))
            assert torch.equal(sharded(x), reference(x))
    assert len(sharded.specializations) == 1


class _Flags:
    """A settings object whose flag has a name ``nn.Module`` uses too."""

    def __init__(self) -> None:
        self.half = True


class _ReadsItsConfig(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(torch.relu(y) if getattr(self.config, "half", True) and self.config.relu else y)


def _config(half: bool = True, relu: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(half=half, relu=relu)


def test_a_config_flag_named_as_a_module_attribute_is_watched():
    """The reads of ``nn.Module``'s own names (``half``, ``train``, ``double``) were left out on settings objects too
    (a mutation probe): ``config.half = False`` was served with the old branch, silently."""
    flags = _Flags()
    flags.relu = True
    torch.manual_seed(0)
    model, x = _ReadsItsConfig(flags).eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    flags.half = False
    assert torch.equal(sharded(x), model(x)) and len(sharded.specializations) == 1


def test_a_settings_object_replaced_by_an_equal_one_is_watched_from_then_on():
    """The plan read flags of the config it was captured with; one replaced by an equal object (a copy) compares
    equal, but a flag set later on the new one must be seen too (a mutation probe: the identity of the holder)."""
    torch.manual_seed(0)
    model, x = _ReadsItsConfig(_config()).eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x)
    model.config = _config()
    assert torch.equal(sharded(x), model(x))
    model.config.relu = False
    assert torch.equal(sharded(x), model(x))


class _Base(nn.Module):
    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class HoldsOtherKinds(_Base):
    """A method its base class defines, an array kept in a list, a ``torch.distributions`` prior (mutation probes:
    the method patched on this class and the array changed in place were served with what was captured, with
    the read of the base class's dict or the array shared by the copy; the prior set anew, since PyTorch's objects
    were all taken for no settings)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.tables = [np.array([2.0, 5.0])]
        self.prior = torch.distributions.Normal(torch.zeros(4), torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.helper(self.a(x)) * torch.from_numpy(self.tables[0]).float()[0]
        return self.b(h + self.prior.mean)


@pytest.mark.parametrize("change", [
    lambda m: setattr(HoldsOtherKinds, "helper", lambda self, x: x * 3),
    lambda m: m.tables[0].__setitem__(0, 3.0),
    lambda m: setattr(m, "prior", torch.distributions.Normal(torch.ones(4), torch.ones(4))),
], ids=["method-patched-on-the-subclass", "array-in-a-list-in-place", "torch-object-set-anew"])
def test_other_kinds_changed_are_computed_with(change, monkeypatch):
    monkeypatch.setattr(HoldsOtherKinds, "helper", _Base.helper, raising=False)  # (undone after the test)
    monkeypatch.delattr(HoldsOtherKinds, "helper")
    torch.manual_seed(0)
    _set_anew_and_served(HoldsOtherKinds().eval(), change)


def _counted(h: torch.Tensor) -> torch.Tensor:
    _counted.calls += 1  # type: ignore[attr-defined]
    return h * 2.0


_counted.calls = 0  # type: ignore[attr-defined]


class HoldsAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.fn = nn.Linear(4, 4), nn.Linear(4, 4), _counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn(self.a(x)))


def test_a_function_the_model_holds_is_no_settings_object():
    """Its ``__dict__`` holds its own bookkeeping (a call counter), not settings the graph fixed: watched as one, each
    call of an unchanged model captured again (a mutation probe)."""
    torch.manual_seed(0)
    model, x = HoldsAFunction().eval(), torch.randn(3, 4)
    sharded = autoshard.shard_model(model, 2, (x,))
    for _ in range(3):
        assert torch.equal(sharded(x), model(x))
    assert not sharded.specializations
