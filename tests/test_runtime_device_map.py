"""A plan whose boundaries fall between modules exports as ``{module_path: device}``; otherwise the
split modules are named."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autoshard
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, ModuleSplitError
from autoshard.examples import GPTStyleLM, LongSkip, ResidualMLP, TransformerLM
from autoshard.examples.models import causal_mask
from autoshard.runtime import TiedAcrossDevicesWarning, device_map, split_modules


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x))) + x


class ScaledInput(nn.Module):
    """The model's own forward multiplies its input by a buffer before the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x * self.scale))


class TwoResiduals(nn.Module):
    """Two residual blocks: three stages must cut inside one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Residual(), Residual())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class SizeOut(nn.Module):
    """Returns its output with a size of it, which the next module reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        h = self.lin(x * 2)
        return h, h.size(-1)


class SizeIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, n: int) -> torch.Tensor:
        return self.lin(h.reshape(-1, n))


class SizeAcross(nn.Module):
    """A size made in ``a`` and read in ``b``, the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.a, self.b, self.post = nn.Linear(8, 8), SizeOut(), SizeIn(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, n = self.a(self.pre(x))
        return self.post(self.b(h, n))


def shard(model, k, *args):
    torch.manual_seed(0)
    return autoshard.shard_model(model, k, example_inputs=args)


def test_a_plan_cut_between_blocks_maps_whole_modules():
    """The embedding and the head it is tied to land on different devices, which the map cannot hold
    as one tensor: said (a dispatcher would move it on every call)."""
    torch.manual_seed(0)
    sharded = shard(GPTStyleLM(vocab=64, layers=4), 4, torch.randint(0, 64, (2, 8)))
    with pytest.warns(TiedAcrossDevicesWarning, match="'wte.weight' on 0, 'lm_head.weight' on 3"):
        mapping = device_map(sharded)
    assert mapping == {
        "wte": 0, "wpe": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 2, "blocks.3": 3,
        "ln_f": 3, "lm_head": 3,
    }


def test_a_buffer_the_models_own_forward_reads_gets_an_entry():
    sharded = shard(ScaledInput(), 2, torch.randn(2, 8))
    assert sharded.plan.boundaries == (("first",),)
    expected = {"first": "cuda:0", "second": "cuda:1", "scale": "cuda:0"}
    assert device_map(sharded, ["cuda:0", "cuda:1"]) == expected


def test_devices_are_given_per_stage_and_returned_as_given():
    torch.manual_seed(0)
    sharded = shard(TransformerLM().eval(), 2, torch.randint(0, 100, (12, 3)), causal_mask(12))
    mapping = device_map(sharded, ["cuda:0", torch.device("cpu")])
    assert mapping["encoder"] == "cuda:0" and mapping["decoder"] == torch.device("cpu")
    covered = {name for name, _ in TransformerLM().named_parameters()}
    assert all(any(p == m or p.startswith(m + ".") for m in mapping) for p in covered)


@pytest.mark.parametrize("devices, expected", [
    (["cpu", "gpu"], r"devices\[1\] is str 'gpu', which is not a device: give a GPU index, 'cpu'"),
    ([object(), 1], r"devices\[0\] is object"),
    ([0, -1], r"devices\[1\] is int -1, which is not a device"),
    ([True, 0], r"devices\[0\] is bool True"),
    ("ab", r"devices takes one device per stage, such as \[0, 1\] or \['cuda:0', 'cpu'\], got str 'ab'"),
    ("cpu", r"one device per stage.*got str 'cpu'"),  # was read as 'c', 'p', 'u': three devices
])
def test_a_device_that_is_none_is_refused_naming_it(devices, expected):
    """Devices were not checked: ['cpu', 'gpu'] made a map with 'gpu' in it, and a string was one
    device per character."""
    sharded = shard(nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))), 2, torch.randn(2, 4))
    assert device_map(sharded, [1, "disk"])["3"] == "disk"  # accelerate's disk offload is one
    with pytest.raises((InvalidArgumentError, InvalidArgumentTypeError), match=expected):
        device_map(sharded, devices)
    with pytest.raises(InvalidArgumentTypeError, match="a device map is made of shard_model's result, got Sequential"):
        device_map(nn.Sequential())


def test_a_sequential_model_maps_layer_by_layer():
    sharded = shard(nn.Sequential(*(nn.Linear(4, 4) for _ in range(6))), 3, torch.randn(2, 4))
    assert device_map(sharded, ["cuda:0", "cuda:1", "cpu"]) == {
        "0": "cuda:0", "1": "cuda:0", "2": "cuda:1", "3": "cuda:1", "4": "cpu", "5": "cpu"}


@pytest.mark.parametrize("model, split", [
    (LongSkip(), ("",)),      # the input is added to the stack's output in the last stage
    (ResidualMLP(), ("",)),   # each x + linear(x) is the model's own code
])
def test_cuts_inside_the_models_own_forward_are_reported(model, split):
    sharded = shard(model, 2, torch.randn(4, 16))
    assert split_modules(sharded) == split
    with pytest.raises(ModuleSplitError, match=r"the model's own forward") as info:
        device_map(sharded)
    assert info.value.modules == split
    assert "no-split" not in str(info.value) and "no_split" not in str(info.value)  # the top level cannot be kept whole
    assert "cut_before=[PATH], split{cut-before=PATH}" in str(info.value)


def test_a_cut_inside_a_submodule_names_it():
    sharded = shard(TwoResiduals(), 3, torch.randn(2, 8))
    split = split_modules(sharded)
    assert split and all(name.startswith("blocks.") for name in split)
    with pytest.raises(ModuleSplitError, match=split[0]) as info:
        device_map(sharded)
    assert f"no_split={list(split)!r}" in str(info.value)  # as a Python call takes it, and as a pipeline does
    assert f"split{{no-split={','.join(split)}}}" in str(info.value)
    assert "cut-before" not in str(info.value) and "cut_before" not in str(info.value)


def test_stages_on_the_same_device_are_not_split():
    sharded = shard(ResidualMLP(), 2, torch.randn(4, 16))
    assert device_map(sharded, ["cpu", "cpu"]) == {"": "cpu"}


def test_one_device_per_stage_is_required():
    sharded = shard(ResidualMLP(), 2, torch.randn(4, 16))
    with pytest.raises(InvalidArgumentError, match="2 stages but 3 devices"):
        device_map(sharded, [0, 1, 2])


def test_a_size_read_in_the_next_stage_leaves_the_module_making_it_whole():
    """Each stage reading a size recomputes it, so it runs on no one device: placed with its reader, it no longer
    shows the module whose code makes it as cut (that module's own code reads a value from the stage before)."""
    sharded = autoshard.shard_model(SizeAcross(), 3, (torch.randn(2, 8),), cut_before=["a", "b"])
    assert device_map(sharded) == {"pre": 0, "a": 1, "b": 2, "post": 2}


class ShapeReadEarly(nn.Module):
    """Reads its input's sizes first and reshapes with them last (GPT-2's ``input_ids.shape``): across a
    cut only the sizes cross, as a shape carrier, which in the model is a ``torch.Size`` no hook moves."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return self.head(self.blocks(x)).reshape(b, t * 2)


def test_a_shape_carried_across_a_cut_inside_the_models_forward_leaves_it_whole():
    """The carrier crossing inside the root's forward was refused as a cut there (ModuleSplitError naming
    the root), for Hugging Face's GPT-2 cut between whole blocks too."""
    sharded = autoshard.shard_model(ShapeReadEarly(), 2, (torch.randn(2, 3, 8),))
    assert any(value.endswith("_shape") for value in sharded.plan.boundaries[0])
    assert split_modules(sharded) == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TiedAcrossDevicesWarning)  # (nothing tied here)
        assert device_map(sharded) == {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1, "head": 1}
