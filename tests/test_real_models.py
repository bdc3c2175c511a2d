"""Real models shard end to end: every family, k = 2 and 4, outputs equal to the model's.

A plan is built once from the example (batch 2, sequence 8) and must serve a later call with
another batch size and sequence length (3, 5) exactly; a data-dependent model must serve inputs
that take the other branch. Each family is captured once per front end and split for every k
(``captured``), so the suite stays fast on two cores.

Outputs are compared exactly, with autograd on (the mode a capture records). The one family whose
eager no-grad run takes another op order is compared with ``assert_close`` below, reason stated.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import transformers
from conftest import assert_same_fingerprint, model_fingerprint
from test_real_models_zoo import BY_NAME, DECODER, EXAMPLE, FAMILIES, LATER, LAYERS, gated_inputs
from torch import nn
from torch.utils._pytree import tree_flatten

import autoshard
from autoshard.api import default_pipeline
from autoshard.capture import TraceResult, capture
from autoshard.errors import ExampleInputsError, InputMismatchError, TraceError
from autoshard.passes import Pipeline
from autoshard.passes.base import ExampleInputs, ShardProgram
from autoshard.passes.capture import CapturePass
from autoshard.runtime import build_schedule, check_pipeline_step, model_loss, pipeline_stage, run_local
from autoshard.sharded import ShardedModel

pytestmark = pytest.mark.slow

EXPORTED = ("gpt2", "vit", "whisper-encoder", "gated-gpt2")


def captured(name: str, front_end: str = "auto") -> tuple[nn.Module, TraceResult]:
    """The family's model and its capture from the example; capturing leaves the model as it was."""
    return _captured(name, front_end)


@functools.lru_cache(maxsize=None)
def _captured(name: str, front_end: str) -> tuple[nn.Module, TraceResult]:
    family = BY_NAME[name]
    model = family.build()
    before = model_fingerprint(model)
    result = capture(model, (), family.inputs(*EXAMPLE), front_end=front_end)
    assert_same_fingerprint(before, model_fingerprint(model))
    return model, result


def after_capture(k: int) -> Pipeline:
    """The default pipeline's passes after its front end (those that do not make ``traced``)."""
    return Pipeline([p for p in default_pipeline(k) if "traced" not in p.provides or "traced" in p.requires])


def shard(name: str, k: int, front_end: str = "auto") -> tuple[nn.Module, ShardedModel]:
    model, traced = captured(name, front_end)
    inputs = ExampleInputs((), BY_NAME[name].inputs(*EXAMPLE))
    program = after_capture(k).run(ShardProgram(model=model, example_inputs=inputs, traced=traced)).program
    return model, program.sharded


def assert_same_output(actual, expected) -> None:
    """Same type (a ModelOutput, dict, tuple or tensor), same fields, every tensor equal."""
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys())
    flat_actual, spec_actual = tree_flatten(actual)
    flat_expected, spec_expected = tree_flatten(expected)
    assert spec_actual == spec_expected
    for a, e in zip(flat_actual, flat_expected):
        assert torch.equal(a, e)


def assert_holds_model_weights(model: nn.Module, sharded: ShardedModel) -> None:
    """Every stage parameter is the model's own object, under the model's own name."""
    own = dict(model.named_parameters(remove_duplicate=False))
    for stage in sharded.stages:
        for name, param in stage.named_parameters():
            assert own[name] is param, name


def assert_no_value_crosses_for_nothing(sharded: ShardedModel) -> None:
    """Every value crossing boundary j is a model output or is read past it by a node that runs there; a
    value each reader recomputes (a size) runs in its readers' stages, not where the split put it."""
    dag, stage = sharded.plan.dag, sharded.plan.assignment
    for j in range(sharded.num_stages - 1):
        for value in sharded.plan.boundary_values(j):
            runs_past = [r for r in dag.successors(value.name) if stage[r] > j and not dag.nodes[r].get("readers")]
            assert runs_past or dag.nodes[value.name]["output"], (j, value.name)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_shards_into_k_stages_serving_later_inputs_exactly(family, k):
    model, sharded = shard(family.name, k)
    before = model_fingerprint(model)
    assert sharded.num_stages == k
    assert len([w for w in sharded.plan.wrapped if not w.by_design]) <= family.max_leaves
    for shape in (EXAMPLE, LATER):
        inputs = family.inputs(*shape)
        assert_same_output(sharded(**inputs), model(**inputs))
    assert_holds_model_weights(model, sharded)
    assert_no_value_crosses_for_nothing(sharded)
    assert_same_fingerprint(before, model_fingerprint(model))


@pytest.mark.parametrize("name", EXPORTED)
def test_export_front_end_shards_and_serves_later_inputs(name):
    model, sharded = shard(name, 2, front_end="export")
    _, traced = captured(name, "export")
    assert traced.front_end == "export"
    assert sharded.num_stages == 2
    inputs = BY_NAME[name].inputs(*LATER)
    assert_same_output(sharded(**inputs), model(**inputs))
    assert_holds_model_weights(model, sharded)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_data_dependent_model_serves_both_branches_with_the_gate_kept_opaque(front_end):
    model, traced = captured("gated-gpt2", front_end)
    assert [(w.kind, w.name) for w in traced.wrapped] == [
        ("module", "gate"), ("function", "test_real_models_zoo.halve_until_small")]
    assert all("test_real_models_zoo.py" in w.reason for w in traced.wrapped)  # where it failed
    _, sharded = shard("gated-gpt2", 4, front_end)
    for sign in (1.0, -1.0):  # the example took +1; -1 takes the gate's other path
        for shape in (EXAMPLE, LATER):
            inputs = gated_inputs(*shape, sign=sign)
            assert_same_output(sharded(**inputs), model(**inputs))


def test_auto_keeps_the_capture_with_fewer_wrapped_modules():
    _, mixtral = captured("mixtral")  # its experts route tokens with item assignment, which fx records
    assert mixtral.front_end == "fx" and mixtral.considered == ("fx: wrapped modules 0, functions 0",)
    _, gated = captured("gated-gpt2")
    assert gated.front_end == "fx" and len(gated.considered) == 2  # a tie keeps fx
    _, gpt2 = captured("gpt2")
    assert gpt2.front_end == "fx" and gpt2.considered == ("fx: wrapped modules 0, functions 0",)
    _, unet = captured("diffusers-unet")  # its forward asks torch.is_tensor of the timestep
    assert unet.front_end == "fx" and unet.considered == ("fx: wrapped modules 0, functions 0",)


def test_shard_model_takes_a_pipeline_starting_with_capture():
    family = BY_NAME["distilbert"]
    model = family.build()
    pipeline = Pipeline([CapturePass(), *after_capture(2)])
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE), pipeline=pipeline)
    inputs = family.inputs(*LATER)
    assert_same_output(sharded(**inputs), model(**inputs))


def test_requested_hidden_states_are_returned_by_the_last_stage():
    """Transformers records hidden states with hooks it installs on the first such call, and a flag
    saying so; the capture is that first call, and the flag must stay with the hooks (clearing it
    made the next call install a second set, recording every layer twice)."""
    family = BY_NAME["llama"]
    model = family.build().model
    inputs = {**family.inputs(*EXAMPLE), "output_hidden_states": True}
    sharded = autoshard.shard_model(model, 3, example_kwargs=inputs)
    later = {**family.inputs(*LATER), "output_hidden_states": True}
    out = sharded(**later)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert_same_output(out, model(**later))


def test_requested_attentions_are_computed_not_the_examples():
    """Transformers records attention weights with hooks inside each layer; fx keeps the hooked
    layers whole, so the weights fx saw are the example's own: it refuses, and export captures."""
    family = BY_NAME["llama"]
    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(**DECODER, attn_implementation="eager")).eval()
    inputs = {**family.inputs(*EXAMPLE), "output_attentions": True}
    sharded = autoshard.shard_model(model, 2, example_kwargs=inputs)
    later = {**family.inputs(*LATER), "output_attentions": True}
    assert_same_output(sharded(**later), model(**later))
    assert "reached the graph by another way than its outputs" in capture(model, (), inputs).considered[0]


def test_a_generation_cache_in_the_output_is_refused_saying_what_to_do():
    family = BY_NAME["llama"]
    inputs = {k: v for k, v in family.inputs(*EXAMPLE).items() if k != "use_cache"}  # the config's True
    # refused once traced, before any split (and with verify=False, which used to return it emptied)
    for verify in (True, False):
        with pytest.raises(TraceError, match=r"returns a DynamicCache holding values its forward computed.*"
                                             r"call the model with use_cache=False"):
            autoshard.shard_model(family.build(), 2, example_kwargs=inputs, verify=verify)


def test_no_grad_inference_runs_the_fused_fast_path_as_the_model_does():
    # nn.TransformerEncoderLayer runs a fused kernel in no-grad eager inference; in eval mode the
    # plan keeps it (and nn.MultiheadAttention) whole, so the stages take the same path: equal.
    model, sharded = shard("nn-transformer", 2)
    inputs = BY_NAME["nn-transformer"].inputs(*LATER)
    assert {w.name for w in sharded.plan.wrapped if w.by_design} >= {"encoder.layers.0", "encoder.layers.1"}
    with torch.no_grad():
        assert torch.equal(sharded(**inputs), model(**inputs))


def test_a_constant_argument_with_another_value_is_refused():
    _, sharded = shard("gpt2", 2)
    inputs = {**BY_NAME["gpt2"].inputs(*LATER), "use_cache": True}
    captured_with = "use_cache=True, but the plan was captured with use_cache=False"
    with pytest.raises(InputMismatchError, match=captured_with):
        sharded(**inputs)


def test_a_shape_the_export_pinned_is_refused_naming_the_shapes_served():
    _, sharded = shard("vit", 2, front_end="export")
    problem = re.escape("pixel_values.shape[2] is 32, but the plan only serves 16")
    with pytest.raises(InputMismatchError, match=problem) as info:
        sharded(pixel_values=torch.randn(2, 3, 32, 32))
    assert re.search(r"pixel_values: float32 of shape \(s\d+, 3, 16, 16\)", str(info.value))


def test_a_shape_condition_the_trace_fixed_is_refused_when_flipped():
    _, sharded = shard("vit", 2)  # fx: `if height != self.image_size[0]` was False on the example
    with pytest.raises(InputMismatchError, match=r"condition at modeling_vit.py:\d+ \(`if height != self\."):
        sharded(pixel_values=torch.randn(2, 3, 32, 32))
    _, sharded = shard("gpt2", 2)  # `is_causal = q_length > 1 and ...` was True with 8 tokens
    with pytest.raises(InputMismatchError, match="q_length > 1"):
        sharded(**BY_NAME["gpt2"].inputs(3, 1))


def _cache_contents(cache: transformers.DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("filled", [False, True])
def test_a_generation_cache_passed_in_is_refused_and_left_as_it_was(filled):
    family = BY_NAME["gpt2"]
    model = family.build()
    inputs = {k: v for k, v in family.inputs(*EXAMPLE).items() if k != "use_cache"}
    cache = transformers.DynamicCache()
    if filled:
        with torch.no_grad():
            cache = model(**inputs, use_cache=True).past_key_values
    before = [(k.clone(), v.clone()) for k, v in _cache_contents(cache)]
    held = _cache_contents(cache)
    with pytest.raises(ExampleInputsError, match=r"past_key_values is a DynamicCache, a generation cache.*"
                                                 r"call the model with use_cache=False"):
        autoshard.shard_model(model, 2, example_kwargs={**inputs, "past_key_values": cache})
    sharded = autoshard.shard_model(model, 2, example_kwargs={**inputs, "use_cache": False})
    # passed to a call, it is a call the plan cannot serve (it was the example's error type, not this one)
    with pytest.raises(InputMismatchError, match=r"past_key_values is a DynamicCache, a generation cache"):
        sharded(**inputs, past_key_values=cache, use_cache=False)
    after = _cache_contents(cache)
    assert len(after) == len(before) and all(a[0] is h[0] and a[1] is h[1] for a, h in zip(after, held))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(after, before))


def tiny_t5() -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16, num_heads=2, d_ff=64, vocab_size=100,
        decoder_start_token_id=0)).eval()


def test_t5_with_labels_and_its_default_cache_says_to_pass_use_cache_false():
    """The head builds its ``CrossEntropyLoss`` in forward (fx now traces through it); the cache it
    returns by default is what a pipeline cannot serve."""
    model = tiny_t5()
    ids, labels = torch.randint(0, 100, (2, 8)), torch.randint(0, 100, (2, 5))
    with pytest.raises(TraceError, match=r"EncoderDecoderCache.*call the model with use_cache=False"):
        autoshard.shard_model(model, 2, example_kwargs={"input_ids": ids, "labels": labels})
    sharded = autoshard.shard_model(model, 2, example_kwargs={"input_ids": ids, "labels": labels, "use_cache": False})
    later = {"input_ids": torch.randint(0, 100, (3, 6)), "labels": torch.randint(0, 100, (3, 4)), "use_cache": False}
    assert_same_output(sharded(**later), model(**later))


def test_t5_takes_encoder_outputs_as_a_model_output():
    from transformers.modeling_outputs import BaseModelOutput

    model = tiny_t5()

    def inputs(batch: int, seq: int) -> dict:
        with torch.no_grad():
            hidden = model.encoder(input_ids=torch.randint(0, 100, (batch, seq))).last_hidden_state
        return {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden),
                "decoder_input_ids": torch.randint(0, 100, (batch, seq // 2 + 1)), "use_cache": False}

    example = inputs(*EXAMPLE)
    kept = example["encoder_outputs"].last_hidden_state
    sharded = autoshard.shard_model(model, 2, example_kwargs=example)
    assert example["encoder_outputs"].last_hidden_state is kept
    later = inputs(*LATER)
    assert_same_output(sharded(**later), model(**later))


@pytest.mark.parametrize("num_labels, labels", [(3, torch.tensor([0, 2])), (1, torch.tensor([0.5, -1.0]))],
                         ids=["single-label", "regression"])
def test_a_classification_head_given_labels_leaves_its_config_as_it_was(num_labels, labels):
    """The head fills in ``config.problem_type`` (None) from the labels on a call; sharding is no
    call of the user's, so the model's next call still chooses from its own labels."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**LAYERS, num_labels=num_labels))
    ids = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model.eval(), 2, example_kwargs={"input_ids": ids, "labels": labels})
    assert model.config.problem_type is None
    later = {"input_ids": torch.randint(0, 100, (3, 5)), "labels": torch.cat([labels, labels[:1]])}
    assert_same_output(sharded(**later), model(**later))


def _distilbert_step_with_labels(rank: int, world: int) -> tuple[bool, str, object]:
    """A DistilBERT classifier's pipeline step with labels, both stages on this one rank, checked."""
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64, n_layers=2, n_heads=2, num_labels=3,
                                           max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                           seq_classif_dropout=0.0)
    model = transformers.DistilBertForSequenceClassification(config)
    ids, labels = torch.randint(0, 100, (4, 8)), torch.tensor([0, 2, 1, 0])
    sharded = autoshard.shard_model(model, 2, example_kwargs={"input_ids": ids[:2], "labels": labels[:2]})
    stages = [pipeline_stage(sharded, j, 2, "cpu") for j in (0, 1)]
    schedule = build_schedule(stages, "interleaved-1f1b", 2, loss_fn=model_loss)
    check = check_pipeline_step(schedule, stages, model, kwargs={"input_ids": ids, "labels": labels}, target=labels,
                                loss_fn=model_loss, raise_on_mismatch=False)
    return check.ok, str(check), model.config.problem_type


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_a_classifier_trains_through_a_pipeline_with_labels_as_the_model():
    """DistilBERT's head sets ``config.problem_type`` on its first call with labels: the stages captured
    with it unset refused the step's second microbatch (``SpecializationMismatch``), unless the user set it
    before sharding. The stages are those of the plan for the model as its first call leaves it."""
    [(ok, check, problem_type)] = run_local(_distilbert_step_with_labels, 1, timeout=300)
    assert ok, check
    assert problem_type == "single_label_classification"


def test_the_check_of_the_inputs_stays_in_the_first_stage_where_the_split_owes_it_nothing():
    # Reformer at k = 4: its encoder a leaf, the embeddings the only other cost; the split placed the check, at no
    # cost, in stage 1 after a stage of a mode check alone, and the stages refused their own example's use_cache
    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=64, local_attn_chunk_length=4,
        is_decoder=False)
    model = transformers.ReformerModel(config).eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long),
              "use_cache": False}
    sharded = autoshard.shard_model(model, 4, example_kwargs=inputs)
    first = [node.target for node in sharded.stages[0].graph.nodes]
    assert any(getattr(target, "__name__", None) == "check_inputs" for target in first)
    assert_same_output(sharded(**inputs), model(**inputs))
