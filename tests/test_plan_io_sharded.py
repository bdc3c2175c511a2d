"""A ShardedModel saves its own plan: the file the CLI's ``--out`` writes, byte for byte, which
``load_plan`` turns back into the same stages, on the built-in examples and a Hugging Face GPT-2."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
import transformers
from torch import nn
from torch.utils._pytree import tree_leaves

import autoshard
from autoshard.cli import main
from autoshard.errors import InvalidArgumentTypeError, PlanError
from autoshard.examples import load_example
from autoshard.passes import PassContext, Pipeline, ShardProgram
from autoshard.passes.base import ExampleInputs


def tiny_gpt2() -> tuple[nn.Module, tuple, dict]:
    """A CLI target: Hugging Face's GPT-2 from a config (random weights, no download), its LM head
    tied to the embedding."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     use_cache=False)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    return transformers.GPT2LMHeadModel(config).eval(), (ids,), {}


def target(name: str) -> tuple[nn.Module, tuple, dict]:
    return tiny_gpt2() if name == "test_plan_io_sharded:tiny_gpt2" else load_example(name)


def assert_same_outputs(actual, expected) -> None:
    assert all(torch.equal(a, e) for a, e in zip(tree_leaves(actual), tree_leaves(expected), strict=True))


@pytest.mark.parametrize("name, flags, options", [
    ("residual-mlp", [], {}),
    ("transformer-lm", [], {}),
    ("gpt-lm", ["--cost", "flops", "--optimizer-bytes", "4"],
     {"cost": "flops", "memory_model": autoshard.MemoryModel(optimizer_bytes_per_param=4.0)}),
    ("test_plan_io_sharded:tiny_gpt2", [], {}),
])
def test_sharded_save_plan_writes_the_cli_file_and_load_plan_rebuilds_the_stages(tmp_path, name, flags, options):
    model, args, kwargs = target(name)
    sharded = autoshard.shard_model(model, 3, example_inputs=args, example_kwargs=kwargs, **options)
    written = sharded.save_plan(tmp_path / "python.json")
    assert main(["split", name, "--stages", "3", *flags, "--out", str(tmp_path / "cli.json"), "--quiet"]) == 0
    assert written.read_bytes() == (tmp_path / "cli.json").read_bytes()

    rebuilt = autoshard.load_plan(written, model, args, kwargs)
    assert rebuilt.plan.assignment == sharded.plan.assignment
    assert [s.code for s in rebuilt.stages] == [s.code for s in sharded.stages]
    assert_same_outputs(rebuilt(*args, **kwargs), model(*args, **kwargs))
    # the rebuilt stages save the same file again
    assert rebuilt.save_plan(tmp_path / "again.json").read_bytes() == written.read_bytes()


def test_autoshard_save_plan_takes_a_sharded_model_and_copies_keep_their_origin(tmp_path):
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    written = autoshard.save_plan(sharded, tmp_path / "plan.json")
    assert written == tmp_path / "plan.json"
    for other in (copy.deepcopy(sharded), pickle.loads(pickle.dumps(sharded))):
        assert other.save_plan(tmp_path / "copy.json").read_bytes() == written.read_bytes()


def test_a_cost_function_is_recorded_so_the_plan_saves_and_reloads(tmp_path):
    """A user's cost function exists only for the call that made the stages: its costs go in the file."""
    model, args, _ = load_example("residual-mlp")

    def weighted(node):
        return 1.0 + node.params

    sharded = autoshard.shard_model(model, 2, example_inputs=args, cost=weighted)
    data = json.loads(sharded.save_plan(tmp_path / "plan.json").read_text())
    assert data["cost_model"] == "custom-weighted" and "custom-weighted" in data["pipeline"]
    by_name = {n["name"]: n for n in data["nodes"]}
    assert by_name["linears_0"]["costs"]["custom-weighted"] == 1.0 + 16 * 16 + 16
    rebuilt = autoshard.load_plan(tmp_path / "plan.json", model, args)
    assert rebuilt.plan.assignment == sharded.plan.assignment
    assert rebuilt.save_plan(tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()


def test_stages_from_a_pipeline_run_directly_say_how_to_save_them(tmp_path):
    model, args, _ = load_example("residual-mlp")
    pipeline = autoshard.default_pipeline(2)
    sharded = pipeline.run(ShardProgram(model=model, example_inputs=ExampleInputs(args)), PassContext()).program.sharded
    with pytest.raises(PlanError, match="running a pipeline directly.*autoshard.shard_model"):
        sharded.save_plan(tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()


def test_save_plan_and_load_plan_refuse_what_they_do_not_take(tmp_path):
    model, args, _ = load_example("residual-mlp")
    with pytest.raises(InvalidArgumentTypeError, match="plan of a ShardedModel .* or a SavedPlan, got Sequential"):
        autoshard.save_plan(nn.Sequential(), tmp_path / "plan.json")
    with pytest.raises(InvalidArgumentTypeError, match=r"plan file first, then the model: load_plan\(path, model"):
        autoshard.load_plan(model, model, args)


def test_load_plan_takes_the_model_and_the_file_in_either_order(tmp_path):
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    written = sharded.save_plan(tmp_path / "plan.json")
    for loaded in (autoshard.load_plan(model, written, args), autoshard.load_plan(written, model, args)):
        assert loaded.plan.assignment == sharded.plan.assignment
        assert torch.equal(loaded(*args), model(*args))


def test_a_pipeline_given_to_shard_model_is_the_one_recorded(tmp_path):
    model, args, _ = load_example("residual-mlp")
    spec = "trace,shape-prop,build-dag,linearize,split{cost=flops strategy=greedy},emit"
    sharded = autoshard.shard_model(model, 2, example_inputs=args, pipeline=spec)
    data = json.loads(sharded.save_plan(tmp_path / "plan.json").read_text())
    assert data["pipeline"] == str(Pipeline.parse(spec).with_options(4, stages=2))
    assert data["cost_model"] == "flops" and data["split"]["strategy"] == "greedy"
