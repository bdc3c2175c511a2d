"""The exact search's count of one stage at a time (``costs.memory.ContiguousStages``) is ``stage_memory``'s,
bit for bit: stage j running ``rest[a:b]`` of the order, what comes before in stage j - 1 and after in j + 1
(``graph.partition.stage_between``). It finds the values crossing the stage's cuts once per cut and charges
the weights of its nodes alone, where ``stage_memory`` walks the whole graph; a change to either count that
the other misses fails here."""

from __future__ import annotations

import functools

import pytest
import torch

import autoshard
from autoshard.costs.memory import ContiguousStages, stage_memory
from autoshard.examples import GPTStyleLM
from autoshard.graph.linearize import non_inputs, program_order

#: Planning without building and verifying stages (what is checked here is the count).
PLAN_ONLY = "capture,shape-prop,build-dag,linearize,split,emit"


def around(inputs, rest, j: int, a: int, b: int) -> dict[str, int]:
    """The assignment the search judges stage j by, built node by node as the search once did."""
    assignment = dict.fromkeys(inputs, 0)
    for i, v in enumerate(rest):
        assignment[v] = j - 1 if i < a else j if i < b else j + 1
    return assignment


def stages_of(n: int, k: int, every: int):
    """Stage j running ``rest[a:b]``: the first stage from the start, the last to the end, every ``every``-th
    start and end between (each end next to a start too)."""
    for j in range(k):
        starts = [0] if j == 0 else range(1, n, every)
        for a in starts:
            ends = [n] if j == k - 1 else sorted({*range(a + 1, n, every), a + 1})
            yield from ((j, a, b) for b in ends)


def gpt2(layers: int = 2):
    """A tiny Hugging Face GPT-2, its LM head tied to the embedding, trained on its own labels."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=layers, n_head=2,
                                     use_cache=False)
    ids = torch.randint(0, 100, (2, 8))
    return transformers.GPT2LMHeadModel(config).train(), (ids,), {"labels": ids}


def gpt_style():
    torch.manual_seed(0)
    return GPTStyleLM(vocab=200, width=16, layers=2), (torch.randint(0, 200, (2, 8)),), {}


@functools.cache
def planned(build, k: int):
    model, args, kwargs = build()
    return autoshard.shard_model(model, k, example_inputs=args, example_kwargs=kwargs, pipeline=PLAN_ONLY).plan.dag


@pytest.mark.parametrize("memory", [
    autoshard.MemoryModel(), autoshard.MemoryModel(schedule="gpipe", microbatches=3, optimizer="sgd"),
    autoshard.MemoryModel(data_parallel="fsdp", dp=2, mixed_precision="bf16", activation_checkpointing=True),
    autoshard.MemoryModel(schedule="interleaved-1f1b", stages_per_rank=2, microbatches=4)])
@pytest.mark.parametrize("build, k, every", [(gpt_style, 4, 5), (gpt2, 4, 17)])
def test_one_stage_of_a_contiguous_split_counts_what_the_whole_graph_count_does(build, k, every, memory):
    dag = planned(build, k)
    order = program_order(dag)
    inputs, rest = [v for v in order if dag.nodes[v].get("input")], non_inputs(dag, order)
    stages = ContiguousStages(dag, inputs, rest, k, memory)
    judged = list(stages_of(len(rest), k, every))
    assert {j for j, _, _ in judged} == set(range(k)) and len(judged) > 40
    for j, a, b in judged:
        (whole,) = stage_memory(dag, around(inputs, rest, j, a, b), k, memory, stages={j})
        assert stages.stage(j, a, b) == whole, (j, a, b)
