"""The plan report: per stage, costs under each model, weights, and boundary values with shape,
dtype and bytes; plain data that serialises to JSON."""

from __future__ import annotations

import json

import torch

import autoshard
from autoshard.examples import load_example
from autoshard.plan_report import plan_report

from gpt_style import GPTStyleLM


def test_the_report_has_every_measured_cost_per_stage_and_adds_up():
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    report = plan_report(sharded)
    assert set(report.cost_models) == {"params", "nodes", "flops", "activations", "memory"}
    dag = sharded.plan.dag
    total_flops = sum(d["flops"] for _, d in dag.nodes(data=True))
    assert sum(s.costs["flops"] for s in report.stages) == total_flops
    assert sum(s.nodes for s in report.stages) == sum(1 for _, d in dag.nodes(data=True) if not d["input"])
    assert sum(s.param_count for s in report.stages) == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers())
    for stage in report.stages:
        assert stage.memory is not None and stage.costs["memory"] == stage.memory.total
        assert stage.memory.in_flight == 3 - stage.index
    assert report.bottleneck("flops") == max(s.costs["flops"] for s in report.stages)


def test_boundary_values_in_the_report_match_what_the_stages_send():
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    report = plan_report(sharded)
    values = sharded.stages[0](*args)
    for j, stage in enumerate(sharded.stages[1:]):
        sent = report.stages[j].values_out
        assert sent == report.stages[j + 1].values_in
        assert [v.name for v in sent] == list(sharded.plan.boundaries[j])
        for described, actual in zip(sent, values):
            assert described.meta.shape == tuple(actual.shape)
            assert described.meta.dtype == str(actual.dtype).removeprefix("torch.")
            assert described.nbytes == actual.numel() * actual.element_size()
        values = stage(*values)


def test_the_report_is_json_and_lists_ties_and_extra_costs():
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=100, width=32, layers=2).eval()
    idx = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_inputs=(idx,))
    ones = {n: 1.0 for n in sharded.plan.dag.nodes}
    report = plan_report(sharded, extra_costs={"mine": ones})
    data = json.loads(json.dumps(report.to_dict()))
    assert [s["costs"]["mine"] for s in data["stages"]] == [
        float(sum(1 for n, j in sharded.plan.assignment.items() if j == s)) for s in range(2)]
    (tie,) = [w for w in data["shared_weights"] if w["name"] == "wte.weight"]
    assert tie["aliases"] == ["wte.weight", "lm_head.weight"]
    first_out = data["stages"][0]["values_out"][0]
    assert first_out["value"]["kind"] == "tensor" and first_out["bytes"] == first_out["value"]["bytes"]
    assert first_out["text"].startswith("float32[")
