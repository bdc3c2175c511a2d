"""Checkpoints keep the original model's names: per stage, whole, and for a stage built on meta."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.errors import CheckpointMismatchError, InvalidArgumentTypeError, PipelineSetupError
from autoshard.examples import GPTStyleLM, ResidualMLP, TransformerLM
from autoshard.examples.models import causal_mask
from autoshard.runtime import load_stage_state, materialize_stage, merge_stage_states, stage_part
from autoshard.runtime.stage import stage_module


class Scaled(nn.Module):
    """A non-persistent buffer (like rotary tables): never in a checkpoint, so in no stage's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scale)


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "scaled":
        return Scaled(), (torch.randn(2, 4),)
    if name == "transformer-lm":
        return TransformerLM().eval(), (torch.randint(0, 100, (12, 3)), causal_mask(12))
    if name == "gpt-lm":
        return GPTStyleLM(), (torch.randint(0, 100, (2, 8)),)
    return ResidualMLP(), (torch.randn(4, 16),)


NAMES = ["residual-mlp", "gpt-lm", "transformer-lm", "scaled"]


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_stage_keys_are_the_models_keys(name):
    model, args = build(name)
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    per_stage = [set(stage.state_dict()) for stage in sharded.stages]
    assert set().union(*per_stage) == set(model.state_dict())
    runtime = [set(stage_module(sharded, i, torch.device("cpu")).state_dict()) for i in range(3)]
    assert runtime == per_stage  # the runtime's stage modules keep the names too


@pytest.mark.parametrize("name", NAMES)
def test_saving_every_stage_and_loading_into_a_fresh_model_round_trips_exactly(name, tmp_path):
    model, args = build(name)
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    for index, stage in enumerate(sharded.stages):
        torch.save(stage.state_dict(), tmp_path / f"stage{index}.pt")
    fresh, _ = build(name, seed=1)
    assert not torch.equal(next(fresh.parameters()), next(model.parameters()))
    saved = [torch.load(tmp_path / f"stage{i}.pt", weights_only=True) for i in range(3)]
    fresh.load_state_dict(merge_stage_states(saved), strict=True)
    assert_same_state(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_each_stage_loads_its_part_of_the_models_checkpoint(name, tmp_path):
    model, args = build(name)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh, _ = build(name, seed=1)
    sharded = autoshard.shard_model(fresh, 3, example_inputs=args)
    for stage in sharded.stages:
        load_stage_state(stage, tmp_path / "model.pt")
    assert_same_state(fresh.state_dict(), model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(sharded(*args), model(*args), rtol=0, atol=0)


def test_stage_part_picks_only_the_stages_keys():
    model, args = build("gpt-lm")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    part = stage_part(sharded.stages[1], model.state_dict())
    assert set(part) == set(sharded.stages[1].state_dict())
    assert "lm_head.weight" in part and "wte.weight" not in part


def test_diverged_copies_of_a_shared_parameter_are_refused():
    model, args = build("gpt-lm")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    states = [dict(stage.state_dict()) for stage in sharded.stages]
    states[1]["wte.weight"] = states[0]["wte.weight"] + 1  # as if stage 1 also held it, drifted
    with pytest.raises(CheckpointMismatchError,
                       match="stages 0 and 1 hold different values for 'wte.weight'"):
        merge_stage_states(states)


@pytest.mark.parametrize("states", [{"a": torch.zeros(1)}, [torch.zeros(1)], "stage.pt"])
def test_merging_something_else_than_a_list_of_state_dicts_is_refused(states):
    with pytest.raises(InvalidArgumentTypeError, match="takes a list of every stage's state_dict"):
        merge_stage_states(states)  # an AttributeError ('Tensor' has no attribute 'items')


def test_checkpoint_mismatches_name_the_tensor():
    model, args = build("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    state = model.state_dict()
    missing = {k: v for k, v in state.items() if k != "linears.7.bias"}
    with pytest.raises(CheckpointMismatchError, match="'linears.7.bias'"):
        load_stage_state(sharded.stages[1], missing)
    wrong = {**state, "linears.0.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointMismatchError, match=r"shape \(16, 16\).*\(3, 3\)"):
        load_stage_state(sharded.stages[0], wrong)
    integers = {**state, "linears.0.weight": state["linears.0.weight"].long()}  # was copied in, silently
    with pytest.raises(CheckpointMismatchError, match=r"needs 'linears.0.weight' as floats \(torch.float32\), the "
                                                      r"checkpoint holds torch.int64"):
        load_stage_state(sharded.stages[0], integers)
    half = {**state, "linears.0.weight": state["linears.0.weight"].half()}  # another width: copied, as torch does
    load_stage_state(sharded.stages[0], half)
    loaded = sharded.stages[0].get_parameter("linears.0.weight")
    assert loaded.dtype == torch.float32 and torch.equal(loaded, half["linears.0.weight"].float())


def test_a_file_that_is_no_state_dict_torch_saved_is_refused_naming_it(tmp_path):
    model, args = build("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    whole = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "plan.json").write_text("{}")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    for name, expected in [("cut.pt", "cannot read the checkpoint .*cut.pt"),
                           ("plan.json", "cannot read the checkpoint .*plan.json.*pass the path of a state dict"),
                           ("list.pt", "holds a list, not a state dict")]:
        with pytest.raises(CheckpointMismatchError, match=expected):
            load_stage_state(sharded.stages[0], tmp_path / name)


def saved_and_planned_on_meta(name: str, factory, tmp_path):
    """The model (its checkpoint saved as model.pt) and a 2-stage plan of it made on meta."""
    model, args = build(name)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with torch.device("meta"):
        meta_model = factory()
    return model, args, meta_model, autoshard.shard_model(meta_model, 2)


def test_a_meta_plan_gets_real_weights_for_one_stage_only(tmp_path):
    model, args, meta_model, planned = saved_and_planned_on_meta("gpt-lm", GPTStyleLM, tmp_path)
    last = materialize_stage(planned, 1, tmp_path / "model.pt")
    assert all(t.is_meta for t in meta_model.state_dict().values())  # neither the model ...
    assert all(t.is_meta for t in planned.stages[1].state_dict().values())  # ... nor the plan changed
    assert all(not t.is_meta for t in last.stages[1].state_dict().values())
    # stage 0 stays meta, except the embedding it shares with the head: that is real in both
    assert last.stages[0].get_parameter("wte.weight") is last.stages[1].get_parameter("lm_head.weight")
    assert last.stages[0].get_parameter("blocks.0.fc.weight").is_meta
    assert_same_state(last.stages[1].state_dict(), stage_part(last.stages[1], model.state_dict()))
    with torch.no_grad():
        hidden = autoshard.shard_model(model, 2).stages[0](*args)
        torch.testing.assert_close(last.stages[1](*hidden), model(*args), rtol=0, atol=0)


def test_a_stage_materialised_from_a_state_dict_holds_copies_of_its_tensors(tmp_path):
    """The tensors of a state dict given as the checkpoint were used as they were: training the copy
    trained the model the dict came from, and two copies from one dict shared their weights."""
    model, _, _, planned = saved_and_planned_on_meta("gpt-lm", GPTStyleLM, tmp_path)
    state = model.state_dict()
    first, second = (materialize_stage(planned, [0, 1], state) for _ in range(2))
    weight = first.stages[1].get_parameter("lm_head.weight")
    assert weight.untyped_storage().data_ptr() != state["lm_head.weight"].untyped_storage().data_ptr()
    assert weight.untyped_storage().data_ptr() != second.stages[1].get_parameter(
        "lm_head.weight").untyped_storage().data_ptr()
    assert_same_state(first.stages[1].state_dict(), stage_part(first.stages[1], state))


def test_materialize_arguments_of_the_wrong_kind_get_typed_errors(tmp_path):
    _, _, meta_model, planned = saved_and_planned_on_meta("residual-mlp", ResidualMLP, tmp_path)
    with pytest.raises(CheckpointMismatchError, match="on the meta device and holds no values"):
        materialize_stage(planned, 0, meta_model.state_dict())  # the meta model's own: an easy slip
    for index in (1.0, "1", True):
        with pytest.raises(InvalidArgumentTypeError, match="stage_index must be an int"):
            materialize_stage(planned, index, tmp_path / "model.pt")
    with pytest.raises(CheckpointMismatchError, match="cannot read the checkpoint"):
        materialize_stage(planned, 0, tmp_path / "missing.pt")
    with pytest.raises(InvalidArgumentTypeError, match="a checkpoint is a state dict or the path"):
        materialize_stage(planned, 0, None)


def test_a_stage_loads_from_its_own_checkpoint_file(tmp_path):
    model, args = build("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    torch.save(sharded.stages[1].state_dict(), tmp_path / "stage1.pt")
    with torch.device("meta"):
        meta_model = ResidualMLP()
    built = materialize_stage(autoshard.shard_model(meta_model, 2), [1], tmp_path / "stage1.pt")
    assert_same_state(built.stages[1].state_dict(), sharded.stages[1].state_dict())


def test_a_non_persistent_buffer_of_a_meta_model_cannot_come_from_a_checkpoint(tmp_path):
    _, _, _, planned = saved_and_planned_on_meta("scaled", Scaled, tmp_path)
    with pytest.raises(CheckpointMismatchError, match="'scale'.*non-persistent buffer is never saved"):
        materialize_stage(planned, [0, 1], tmp_path / "model.pt")


def test_a_hugging_face_checkpoint_of_a_tied_t5_loads_into_a_meta_plan(tmp_path):
    """T5 ties its embeddings and head to ``shared``, which its forward never calls; Hugging Face
    saves the tied weight as ``shared.weight`` only. (Called with its default ``use_cache``, it returns a
    generation cache, which a capture refuses.)"""
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta_model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 64, (2, 6))
    call = {"decoder_input_ids": ids, "use_cache": False}
    planned = autoshard.shard_model(meta_model, 2, example_inputs=(ids,), example_kwargs=call)
    built = materialize_stage(planned, [0, 1], tmp_path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(built(ids, **call).logits, model(ids, **call).logits, rtol=0, atol=0)


def test_a_pipeline_stage_of_a_meta_plan_says_to_use_the_materialised_copy(tmp_path):
    _, _, _, planned = saved_and_planned_on_meta("residual-mlp", ResidualMLP, tmp_path)
    materialize_stage(planned, 0, tmp_path / "model.pt")  # its return value dropped: the slip
    with pytest.raises(PipelineSetupError, match=r"sharded = autoshard.runtime.materialize_stage\(sharded, "
                                                 r"stage_index, checkpoint\) returns a copy"):
        stage_module(planned, 0, torch.device("cpu"))  # what pipeline_stage builds its stage with


def test_a_copy_with_stages_still_on_meta_called_whole_is_refused_not_answered_on_meta(tmp_path):
    """A stage on meta hands its received tensors to meta: the copy ``materialize_stage`` returns, called whole,
    returned a meta tensor for a real input without a word; and the plan itself, torch's device error."""
    from autoshard.errors import PlanError

    model, (x,), _, planned = saved_and_planned_on_meta("residual-mlp", ResidualMLP, tmp_path)
    first = materialize_stage(planned, 0, tmp_path / "model.pt")
    for sharded in (first, planned):
        with pytest.raises(PlanError, match="a stage whose weights are on the meta device .* was handed real"):
            sharded(x)
    assert planned(x.to("meta")).is_meta  # shapes from the plan itself: served
    assert not any(t.is_meta for t in first.stages[0](x))  # the stage materialised computes
    whole = materialize_stage(planned, [0, 1], tmp_path / "model.pt")
    assert torch.equal(whole(x), model(x))


@pytest.mark.parametrize("name", ["gpt-lm", "scaled"])
def test_the_sharded_models_state_dict_is_the_models_and_it_loads_the_models_checkpoint(name):
    model, args = build(name)
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    assert_same_state(sharded.state_dict(), model.state_dict())
    twin, _ = build(name, seed=1)
    sharded.load_state_dict(twin.state_dict())  # strict: every key of the model's taken by its stages
    assert_same_state(model.state_dict(), twin.state_dict())
    assert torch.equal(sharded(*args), twin(*args))
    nested = nn.ModuleDict({"sharded": sharded})  # under a prefix too
    assert list(nested.state_dict()) == [f"sharded.{key}" for key in model.state_dict()]
    nested.load_state_dict(nested.state_dict())
    # by name as in the model (optimizer groups, freezing): were ``stages.1.h.0...``
    for named in ("named_parameters", "named_buffers"):
        assert sorted((n, id(t)) for n, t in getattr(sharded, named)()) == sorted(
            (n, id(t)) for n, t in getattr(model, named)())
        assert sorted(n for n, _ in getattr(sharded, named)(prefix="mod")) == sorted(
            n for n, _ in getattr(model, named)(prefix="mod"))


def tiny_bert(seed: int):
    """BERT's masked-LM head holds ``cls.predictions.bias``, the same Parameter as
    ``cls.predictions.decoder.bias``: a tie under two names, of which the stages hold only the second."""
    import transformers

    config = transformers.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(config).eval()


def test_a_tied_weight_no_stage_holds_under_one_of_its_names_round_trips_strictly_both_ways(tmp_path):
    model, twin, fresh = tiny_bert(0), tiny_bert(1), tiny_bert(2)
    ids = torch.randint(0, 128, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids,))
    assert "cls.predictions.bias" not in set().union(*(stage.state_dict() for stage in sharded.stages))
    assert_same_state(sharded.state_dict(), model.state_dict())
    fresh.load_state_dict(sharded.state_dict(), strict=True)
    assert_same_state(fresh.state_dict(), model.state_dict())
    sharded.load_state_dict(twin.state_dict(), strict=True)
    assert_same_state(model.state_dict(), twin.state_dict())
    with torch.no_grad():
        assert torch.equal(sharded(ids).logits, twin(ids).logits)


class AuxHead(nn.Module):
    """A head only ``aux=True`` calls and a buffer no forward reads: no stage of a plan made
    without ``aux`` holds them, yet both are the model's, in its checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.aux_head = nn.Linear(8, 2)
        self.register_buffer("stat", torch.zeros(8))

    def forward(self, x: torch.Tensor, aux: bool = False):
        h = self.b(torch.relu(self.a(x)))
        return (h, self.aux_head(h)) if aux else h


def aux_head(seed: int) -> AuxHead:
    torch.manual_seed(seed)
    model = AuxHead()
    model.stat.normal_()
    return model


def test_weights_of_a_branch_not_taken_and_an_unread_buffer_are_in_the_sharded_checkpoint_and_load():
    model, twin = aux_head(0), aux_head(1)
    sharded = autoshard.shard_model(model, 2, example_inputs=(torch.randn(2, 8),))
    held = set().union(*(stage.state_dict() for stage in sharded.stages))
    assert {"aux_head.weight", "aux_head.bias", "stat"}.isdisjoint(held)
    assert_same_state(sharded.state_dict(), model.state_dict())
    assert sharded.state_dict(keep_vars=True)["aux_head.weight"] is model.aux_head.weight  # the model's own
    assert set(copy.deepcopy(sharded).state_dict()) == held  # a copy holds its stages' tensors, not the model
    sharded.load_state_dict(twin.state_dict(), strict=True)  # into the model's own tensors
    assert_same_state(model.state_dict(), twin.state_dict())
    fresh = aux_head(2)
    fresh.load_state_dict(sharded.state_dict(), strict=True)
    assert_same_state(fresh.state_dict(), twin.state_dict())
    nested = nn.ModuleDict({"sharded": sharded})  # under a prefix too
    assert list(nested.state_dict()) == [f"sharded.{key}" for key in model.state_dict()]
    nested.load_state_dict(nested.state_dict())
    lacking = {key: value for key, value in twin.state_dict().items() if key != "stat"}
    with pytest.raises(RuntimeError, match='Missing key.*"stat"'):
        sharded.load_state_dict(lacking)
    assert sharded.load_state_dict(lacking, strict=False).missing_keys == ["stat"]
    wrong = {**twin.state_dict(), "aux_head.weight": torch.zeros(3, 8)}
    with pytest.raises(RuntimeError, match="size mismatch for aux_head.weight"):
        sharded.load_state_dict(wrong)


def test_merging_stage_states_over_the_models_checkpoint_gives_the_whole_checkpoint(tmp_path):
    model = tiny_bert(0)
    ids = torch.randint(0, 128, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids,))
    states = [{key: value.clone() for key, value in stage.state_dict().items()} for stage in sharded.stages]
    alone = merge_stage_states(states)  # no model to take the keys no stage holds from: left out
    assert set(model.state_dict()) - set(alone) == {"cls.predictions.bias"}
    assert_same_state(merge_stage_states(states, base=model.state_dict()), model.state_dict())
    torch.save(model.state_dict(), tmp_path / "model.pt")
    trained = next(state for state in states if "cls.predictions.decoder.bias" in state)
    trained["cls.predictions.decoder.bias"] += 1  # as a step of training moves it
    merged = merge_stage_states(states, base=tmp_path / "model.pt")
    assert list(merged) == list(model.state_dict())
    assert torch.equal(merged["cls.predictions.bias"], trained["cls.predictions.decoder.bias"])  # not the stale one
    fresh = tiny_bert(2)
    fresh.load_state_dict(merged, strict=True)
    assert torch.equal(fresh.cls.predictions.bias, trained["cls.predictions.decoder.bias"])
    own = aux_head(0)
    split = autoshard.shard_model(own, 2, example_inputs=(torch.randn(2, 8),))
    assert_same_state(merge_stage_states([stage.state_dict() for stage in split.stages], base=own.state_dict()),
                      own.state_dict())
