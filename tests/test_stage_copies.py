"""Stages saved and loaded (pickle, torch.save) or deep-copied keep their graph, checks included."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.errors import InputMismatchError
from autoshard.examples import load_example


def _through_torch_save(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"pickle": lambda value: pickle.loads(pickle.dumps(value)), "torch.save": _through_torch_save,
          "deepcopy": copy.deepcopy}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", ["gpt-lm", "transformer-lm"])
def test_a_copied_sharded_model_computes_the_model_and_checks_its_inputs(name, how):
    """fx's own pickling traces the stage's code again, which ran the input check on proxies."""
    model, args, _ = load_example(name)
    copied = COPIES[how](autoshard.shard_model(model, 3, args))
    with torch.no_grad():
        assert torch.equal(copied(*args), model(*args))
    with pytest.raises(InputMismatchError):
        copied(args[0].float(), *args[1:])


class DropsOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(F.dropout(self.first(x), 0.5, self.training))


@pytest.mark.parametrize("how", COPIES)
def test_a_copied_stage_still_refuses_the_other_mode(how):
    """The mode check reads only module flags: fx's re-trace ran it eagerly and left it out."""
    sharded = autoshard.shard_model(DropsOut().train(), 2, (torch.randn(4, 8),))
    stage = COPIES[how](sharded.stages[0])
    nn.Module.train(stage, False)  # around the stage's own refusal, as a runtime setting flags might
    with pytest.raises(InputMismatchError, match="captured in train mode"):
        stage(torch.randn(4, 8))


# -- what a plan fixes: its weights' dtypes and its mode ------------------------------------------
class CastsToItsWeights(nn.Module):
    """Reads its weights' dtype: the capture answers that once, for the example's float32."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x.to(self.first.weight.dtype)))


def test_weights_converted_after_sharding_are_refused_by_every_stage():
    model, x = CastsToItsWeights(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    model.half()  # the stages hold these parameters: they are converted too
    with pytest.raises(InputMismatchError, match="weights are float16, but the plan was captured with float32"):
        sharded(x)
    with pytest.raises(InputMismatchError, match="weights are float16"):
        sharded.stages[1](torch.randn(4, 8, dtype=torch.float16))


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double()])
def test_converting_a_sharded_model_or_a_stage_is_refused_before_anything_changes(convert):
    model, x = CastsToItsWeights(), torch.randn(4, 8)
    sharded = autoshard.shard_model(model, 2, (x,))
    for target in (sharded, sharded.stages[0]):
        with pytest.raises(autoshard.errors.InvalidArgumentError, match="convert the model first"):
            convert(target)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    sharded.to("cpu")  # a move to a device goes through
    assert torch.equal(sharded(x), model(x))


def test_a_stage_refuses_the_other_mode_before_switching_the_models_modules():
    model = DropsOut().eval()
    sharded = autoshard.shard_model(model, 2, (torch.randn(4, 8),))
    with pytest.raises(InputMismatchError, match="captured in eval mode"):
        sharded.stages[1].train()
    assert not any(m.training for m in model.modules())
    sharded.stages[1].eval()  # staying in the mode is allowed
