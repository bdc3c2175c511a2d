"""A module, parameter or buffer the stages call or read, assigned anew in the model after sharding: refused,
where the stages would go on computing with the old one (found by helper B: Qwen3's replaced ``lm_head``,
final norm weight, ``q_proj`` and ``embed_tokens`` served stale values, silently; a buffer replaced by
``load_state_dict(sd, assign=True)``, by a later probe)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.errors import InputMismatchError


class ScaledBlocks(nn.Module):
    """Blocks a stage calls whole, a head, and a parameter the traced code reads itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)))
        self.head = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 2.0))
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)) * self.scale + self.shift


def sharded_blocks() -> tuple[ScaledBlocks, autoshard.ShardedModel, torch.Tensor]:
    torch.manual_seed(0)
    model, x = ScaledBlocks().eval(), torch.randn(2, 8)
    return model, autoshard.shard_model(model, 2, (x,)), x


@pytest.mark.parametrize("rebind, named", [
    (lambda m: setattr(m, "head", nn.Linear(8, 8)), "head"),
    (lambda m: setattr(m, "scale", nn.Parameter(torch.ones(8))), "scale"),
    (lambda m: setattr(m.blocks, "2", nn.Sequential(nn.Linear(8, 8), nn.ReLU())), "2"),
    (lambda m: setattr(m, "blocks", nn.Sequential(*m.blocks)), "blocks"),
    (lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True), "scale"),
    (lambda m: m.load_state_dict({"shift": torch.ones(8)}, strict=False, assign=True), "shift"),
    (lambda m: setattr(m, "shift", torch.ones(8)), "shift"),
])
def test_a_module_or_parameter_assigned_anew_in_the_model_is_refused(rebind, named):
    model, sharded, x = sharded_blocks()
    rebind(model)
    with pytest.raises(InputMismatchError, match=f"{named} was assigned anew after sharding"):
        sharded(x)
    with pytest.raises(InputMismatchError, match="assigned anew"):  # the stages called as they are too
        sharded.stages[-1](*sharded.stages[0](x))


def test_updates_in_place_and_the_same_objects_assigned_again_are_served():
    """What the stages read live stays served: values updated in place, a parameter of a module a stage
    calls whole (it reads its own), and a module or parameter assigned back as itself."""
    model, sharded, x = sharded_blocks()
    with torch.no_grad():
        model.scale.mul_(3)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    model.blocks[0][0].weight = nn.Parameter(torch.randn(8, 8))
    model.head, model.scale, model.shift = model.head, model.scale, model.shift
    model.shift.add_(1)
    model.blocks[1][0].register_buffer("cache", torch.ones(1))  # a buffer no stage reads
    assert torch.equal(sharded(x), model(x))


class ScaledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.a(x) * scale)


def test_every_plan_watching_a_module_refuses_once_it_is_assigned_anew():
    """A specialisation's stages watch the same modules as the first plan's: each must refuse (a mutation probe
    telling only the first watcher left the specialisation serving the old head)."""
    torch.manual_seed(0)
    model, x = ScaledHead().eval(), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    sharded(x, 2.0)
    assert len(sharded.specializations) == 1
    model.head = nn.Linear(8, 8)
    for scale in (1.0, 2.0):
        with pytest.raises(InputMismatchError, match="head was assigned anew after sharding"):
            sharded(x, scale)


def test_a_module_the_stages_call_swapped_through_modules_is_refused():
    """``model._modules[name] = m`` bypasses PyTorch's registration hooks: torch.ao's ``quantize_dynamic`` swaps each
    Linear so, and the stages went on calling the float ones (a helper probe). The first stage reads each module it
    or a later stage calls from its parent's submodules, and refuses as for an assignment."""
    model, sharded, x = sharded_blocks()
    sharded(x)
    model.blocks[3]._modules["0"] = nn.Linear(8, 8)
    with pytest.raises(InputMismatchError, match=r"Sequential.0 was assigned anew after sharding"):
        sharded(x)
    model, sharded, x = sharded_blocks()
    torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, inplace=True)
    with pytest.raises(InputMismatchError, match="was assigned anew after sharding"):
        sharded(x)


def test_a_buffer_converted_by_the_model_is_refused():
    """``model.half()``, ``.float()`` and ``.to()`` put each converted buffer in ``_buffers`` as a dict, past the
    registration hooks: after ``half().float()`` the stages added the buffer they were sharded with, the model its
    rounded copy (a helper probe: Llama's ``inv_freq``, 9e-8 off). Each stage reads the buffers and parameters its
    code reads from the model's registries, so it refuses; a conversion that leaves a tensor as it is is served."""
    model, sharded, x = sharded_blocks()
    model.float()  # float32 already: each tensor stays itself
    assert torch.equal(sharded(x), model(x))
    with torch.no_grad():
        model.shift.fill_(1 / 3)
    model.half().float()
    with pytest.raises(InputMismatchError, match=r"ScaledBlocks.shift was assigned anew after sharding .*\.half\(\)"):
        sharded(x)
    with pytest.raises(InputMismatchError, match="shift was assigned anew"):  # the last stage, called alone
        sharded.stages[-1](torch.zeros(2, 8))


def test_a_parameter_put_in_its_registry_as_a_dict_is_refused():
    """With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, ``model.to()`` registers new
    parameters through ``_parameters`` as a dict (no hook sees it): refused, by the same read."""
    model, sharded, x = sharded_blocks()
    model._parameters["scale"] = nn.Parameter(torch.ones(8))
    with pytest.raises(InputMismatchError, match="ScaledBlocks.scale was assigned anew after sharding"):
        sharded(x)
    model._parameters["scale"] = sharded.stages[-1].scale  # the one sharded with, back: served again
    assert torch.equal(sharded(x), model(x))


def test_a_deep_copy_computes_with_its_own_tensors_whatever_the_model_does_with_its_own():
    """A deep copy holds copies of the tensors: the model converted or moved since (to free its memory) changes
    neither them nor what the copy computes, so the copy serves on, where the stages it was copied from refuse."""
    model, sharded, x = sharded_blocks()
    expected = model(x)
    copied = copy.deepcopy(sharded)
    with torch.no_grad():
        model.shift.fill_(1 / 3)
    model.half().float()
    with pytest.raises(InputMismatchError, match="shift was assigned anew"):
        sharded.stages[-1](*sharded.stages[0](x))
    assert torch.equal(copied(x), expected)
    model.to("meta")
    assert torch.equal(copied(x), expected)
