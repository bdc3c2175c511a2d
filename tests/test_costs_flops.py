"""Acceptance: FLOPs per node add up to the whole model's; flops and params plans differ and are
each optimal; a >4 GB GPT-2-style LM on the meta device is planned without allocating it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autoshard
from autoshard.api import default_pipeline, run_pipeline
from autoshard.costs.flops import flop_counter_mode
from autoshard.examples import load_example
from autoshard.graph import min_bottleneck
from autoshard.graph.linearize import non_inputs, program_order
from autoshard.passes import ExampleInputs

from autoshard.examples import GPTStyleLM

TESTS = Path(__file__).parent


def model_flops(model: nn.Module, *args) -> int:
    counter = flop_counter_mode()  # torch's, counting the CPU attention kernel it misses
    with counter, torch.no_grad():
        model(*args)
    return counter.get_total_flops()


def dag_flops(model: nn.Module, *args) -> int:
    program = run_pipeline(model, default_pipeline(2), ExampleInputs(args)).program
    return sum(data["flops"] for _, data in program.dag.nodes(data=True))


def test_transformer_lm_flops_sum_to_the_whole_model():
    model, args, _ = load_example("transformer-lm")
    expected = model_flops(model, *args)
    assert expected > 0
    assert dag_flops(model, *args) == pytest.approx(expected, rel=0.01)


class CausalLMLogits(nn.Module):
    """A Hugging Face causal LM called with token ids only, returning the logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def test_tiny_gpt2_from_transformers_flops_sum_to_the_whole_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = CausalLMLogits(GPT2LMHeadModel(config).eval())
    ids = torch.randint(0, 100, (2, 8))
    expected = model_flops(model, ids)
    assert expected > 0
    assert dag_flops(model, ids) == pytest.approx(expected, rel=0.01)
    sharded = autoshard.shard_model(model, 3, example_inputs=(ids,), cost="flops")
    assert torch.equal(sharded(ids), model(ids))


def _bottleneck_and_optimum(sharded, cost: str) -> tuple[float, float]:
    plan = sharded.plan
    dag = plan.dag
    costs = {"flops": lambda d: float(d["flops"]), "params": lambda d: float(d["param_bytes"])}[cost]
    weights = [costs(dag.nodes[v]) for v in non_inputs(dag, program_order(dag))]
    return max(plan.stage_costs(cost)), min_bottleneck(weights, plan.num_stages)


def test_flops_and_params_give_different_plans_each_optimal_for_its_cost():
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=50_000, width=64, layers=4, heads=4, tied=False).eval()
    idx = torch.randint(0, 50_000, (2, 16))
    by_flops = autoshard.shard_model(model, 2, example_inputs=(idx,), cost="flops")
    by_params = autoshard.shard_model(model, 2, example_inputs=(idx,), cost="params")
    assert by_flops.plan.assignment != by_params.plan.assignment
    for sharded, cost in ((by_flops, "flops"), (by_params, "params")):
        bottleneck, optimum = _bottleneck_and_optimum(sharded, cost)
        assert bottleneck == pytest.approx(optimum)
        assert torch.equal(sharded(idx), model(idx))
    # Each plan is strictly worse under the other's cost.
    assert max(by_params.plan.stage_costs("flops")) > max(by_flops.plan.stage_costs("flops"))
    assert max(by_flops.plan.stage_costs("params")) > max(by_params.plan.stage_costs("params"))


META_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    sys.path.insert(0, {tests!r})
    import autoshard
    from autoshard.examples import GPTStyleLM
    with torch.device("meta"):
        model = GPTStyleLM(vocab=50257, width=4096, layers=6, heads=32, max_seq=64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    idx = torch.randint(0, 50257, (1, 16))
    plans = {{}}
    for cost in ("params", "flops"):
        sharded = autoshard.shard_model(model, 4, example_inputs=(idx,), cost=cost)
        plans[cost] = sharded.plan.stage_costs(cost)
        assert all(p.is_meta for p in sharded.parameters())
    try:  # this process's own peak: ru_maxrss keeps the forking parent's (Linux carries it across exec)
        with open("/proc/self/status") as status:
            peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({{"weights": weights, "peak": peak, "plans": plans}}))
""")


@pytest.mark.timeout(300)
def test_a_4gb_lm_on_the_meta_device_is_planned_without_allocating_it():
    script = META_SCRIPT.format(tests=str(TESTS))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280,
                            env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["weights"] > 4e9
    assert report["peak"] < report["weights"] / 5  # far below: torch itself is most of it
    for cost in ("params", "flops"):
        assert len(report["plans"][cost]) == 4 and all(c > 0 for c in report["plans"][cost])


class LearnedLatents(nn.Module):
    """Learned queries expanded to the batch (Perceiver): under no_grad a view of a parameter
    still requires grad, and torch's FLOP counter failed on a leaf called with one."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(8, 32))
        self.norm, self.proj = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.latents.expand(x.shape[0], -1, -1)) + x)


def test_a_leaf_called_with_a_view_of_a_parameter_is_counted():
    model, x = LearnedLatents().eval(), torch.randn(2, 8, 32)
    counter = FlopCounterMode(display=False)
    with counter:  # with grad enabled: the counter itself fails on this model under no_grad
        model(x)
    assert counter.get_total_flops() > 0
    assert dag_flops(model, x) == pytest.approx(counter.get_total_flops(), rel=0.01)
    sharded = autoshard.shard_model(model, 2, example_inputs=(x,), cost="flops")
    later = torch.randn(3, 8, 32)
    assert torch.equal(sharded(later), model(later))


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v).squeeze(1))


def test_attention_is_counted_on_the_cpu_as_on_the_meta_device():
    """On the CPU, scaled_dot_product_attention runs a kernel torch's counter has no formula for:
    a plan made with real tensors would balance as if attention cost nothing."""
    batch, tokens, width = 2, 64, 16
    x = torch.randn(batch, tokens, width)
    with torch.device("meta"):
        on_meta = _Attention(width)

    def attention_flops(model: nn.Module) -> int:
        dag = autoshard.shard_model(model, 2, (x,), cost="flops").plan.dag
        return dag.nodes["scaled_dot_product_attention"]["flops"]

    assert attention_flops(_Attention(width)) == attention_flops(on_meta) == 4 * batch * tokens * tokens * width
