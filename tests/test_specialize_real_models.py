"""Re-specialisation on Hugging Face decoders: planned at batch 2 x 8, called at batch 1 and 3,
sequence 1 and 5, each exact, with every weight in the stage that held it. Sequence 1 flips the
attention's ``q_length > 1`` branch, which the first capture fixed. Every decoder family of the
zoo; ``benchmarks/specialize.py`` times them."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.specialize import holders
from test_real_models import assert_same_output
from test_real_models_zoo import BY_NAME, EXAMPLE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "mistral", "qwen2", "gpt-neox", "mixtral"])
def test_a_decoder_serves_other_batches_and_lengths_with_its_weights_in_their_stages(name):
    family = BY_NAME[name]
    model = family.build()
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE))
    before = holders(sharded)
    with torch.no_grad():
        for batch, seq in ((1, 8), (3, 8), (2, 1), (2, 5), (1, 1)):
            inputs = family.inputs(batch, seq)
            assert_same_output(sharded(**inputs), model(**inputs))
    assert 1 <= len(sharded.specializations) <= 2  # sequence 1 needs one (batch 1 x 1 may reuse it)
    for made in sharded.specializations:
        assert holders(made.sharded) == before
        assert "q_length" in made.guard


def test_a_call_the_model_refuses_gets_the_models_error_and_makes_no_specialisation():
    family = BY_NAME["vit"]
    model = family.build()
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE))
    wrong_size = {"pixel_values": torch.randn(2, 3, 32, 32)}  # the model was built for 16 x 16 images
    with pytest.raises(ValueError) as expected:
        model(**wrong_size)
    with pytest.raises(ValueError) as got:
        sharded(**wrong_size)
    assert str(got.value) == str(expected.value) and sharded.specializations == ()


def test_gpt2_with_its_head_tied_to_the_embedding_respecialises_across_the_stages():
    """GPT-2's LM head reads the token embedding's weight: the first and last stages hold it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_kwargs={"input_ids": ids, "use_cache": False})
    before = holders(sharded)
    assert before["transformer.wte.weight"] == before["lm_head.weight"] == {0, 1}
    with torch.no_grad():
        for seq in (1, 5):
            inputs = {"input_ids": ids[:, :seq], "use_cache": False}
            assert_same_output(sharded(**inputs), model(**inputs))
    (made,) = sharded.specializations  # sequence 1 flips the attention's branch
    assert holders(made.sharded) == before


def test_clip_respecialises_with_its_text_position_table_in_its_stage():
    """CLIP's text embeddings check the sequence length against the position table's shape, a guard
    on the inputs alone: every new capture (``return_dict=False``, under autocast, ...) placed it in
    the stage before the table's and was refused for holding the table there too."""
    import transformers

    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    model = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(small, vocab_size=64, max_position_embeddings=32),
        vision_config=dict(small, image_size=16, patch_size=4), projection_dim=16)).eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8)), "pixel_values": torch.randn(2, 3, 16, 16),
              "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    sharded = autoshard.shard_model(model, 2, example_kwargs=inputs)
    before = holders(sharded)
    with torch.no_grad():
        for extra in ({"return_dict": False}, {"output_hidden_states": True}):
            assert_same_output(sharded(**inputs, **extra), model(**inputs, **extra))
    assert len(sharded.specializations) == 2
    assert all(holders(made.sharded) == before for made in sharded.specializations)


def test_a_diffusers_unet_sharded_with_grad_serves_calls_under_no_grad_and_inference_mode():
    """Every diffusers block asks ``torch.is_grad_enabled() and self.gradient_checkpointing``: a UNet
    sharded with grad was refused under ``torch.no_grad()``, the way a pipeline calls it to sample."""
    family = BY_NAME["diffusers-unet"]
    model = family.build()
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE))
    before = holders(sharded)
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        inputs = family.inputs(*EXAMPLE)
        with mode():
            assert_same_output(sharded(**inputs), model(**inputs))
    (made,) = sharded.specializations
    assert "grad mode" in made.guard and holders(made.sharded) == before


def test_gpt2_planned_without_labels_trains_with_them_and_returns_hidden_states_when_asked():
    """Hugging Face's training call passes ``labels=``, a debugging one ``output_hidden_states=True``:
    arguments the example left at their defaults. Each is captured again with it, as torch.compile
    recompiles on a constant; the loss and its gradients are the model's, every weight in its stage."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_kwargs={"input_ids": ids})
    before = holders(sharded)
    loss = sharded(input_ids=ids, labels=ids).loss
    expected = model(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, expected)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(expected, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        assert_same_output(sharded(input_ids=ids, output_hidden_states=True),
                           model(input_ids=ids, output_hidden_states=True))
        # Transformers installed forward hooks on the layers the first plan traced through: a capture
        # that runs them serves the plain call from now on (the hidden states' one does not serve it)
        assert_same_output(sharded(input_ids=ids), model(input_ids=ids))
    assert [sorted(path for path, _ in made.structure) for made in sharded.specializations] == [
        ["['input_ids']", "['labels']"], ["['input_ids']", "['output_hidden_states']"], ["['input_ids']"]]
    assert "forward hooks on transformer.h.0" in sharded.specializations[-1].describe()
    assert_same_output(sharded(input_ids=ids), model(input_ids=ids))
    assert len(sharded.specializations) == 3
    assert all(holders(made.sharded) == before for made in sharded.specializations)


def test_gpt2_split_inside_a_layer_serves_hidden_states_and_every_call_after_them():
    """Transformers installs forward hooks on every layer the first time hidden states are asked
    for, and keeps them. They run after the layer's traced body, so a plan that split inside a
    layer captures such calls again with each weight in its stage, rather than refusing them."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    sharded = autoshard.shard_model(model, 3, example_kwargs={"input_ids": ids})
    before = holders(sharded)
    split = [i for i in range(2) if len({j for path, stages in before.items()
                                         if path.startswith(f"transformer.h.{i}.") for j in stages}) > 1]
    assert split  # a layer's weights in two stages
    with torch.no_grad():
        for extra in ({"output_hidden_states": True}, {"labels": ids}, {"return_dict": False}):
            assert_same_output(sharded(input_ids=ids, **extra), model(input_ids=ids, **extra))
    assert any(module._forward_hooks for module in model.transformer.h)  # installed by the first call
    assert len(sharded.specializations) == 3
    assert all(holders(made.sharded) == before for made in sharded.specializations)


def test_t5_whose_new_capture_reads_its_shared_embedding_in_one_stage_of_two_serves_the_call():
    """The plan holds T5's shared embedding in the encoder's stage and the decoder's; a call without
    the mask is captured again reading it in one of them. That is no new placement, so it is served,
    and its gradient is the model's."""
    family = BY_NAME["t5"]
    model = family.build().eval()
    example = family.inputs(*EXAMPLE)
    sharded = autoshard.shard_model(model, 3, example_kwargs=example)
    before = holders(sharded)
    unmasked = {key: value for key, value in example.items() if key != "attention_mask"}
    got, want = sharded(**unmasked), model(**unmasked)
    assert_same_output(got, want)
    (made,) = sharded.specializations
    after = holders(made.sharded)
    assert all(after[name] <= stages for name, stages in before.items() if name in after)
    assert after != before  # a weight in fewer stages than the plan's
    weights = list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got.last_hidden_state.sum(), weights),
                                                 torch.autograd.grad(want.last_hidden_state.sum(), weights)))


def test_llama_in_training_mode_serves_one_token_though_its_stages_read_a_rotary_buffer():
    """Every stage reading a buffer (Llama's rotary ``inv_freq``, BERT's ``position_ids``) counted as
    updating it in training mode, so the call the first plan's ``q_length > 1`` refused after a stage
    ran was refused too, where eval mode served it."""
    family = BY_NAME["llama"]
    model = family.build().train()
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE))
    for batch, seq in ((2, 1), (2, 5)):
        inputs = family.inputs(batch, seq)
        assert_same_output(sharded(**inputs), model(**inputs))
    assert len(sharded.specializations) == 1
