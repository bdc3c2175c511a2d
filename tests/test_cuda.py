"""The runtime on a CUDA device: the offload runner and a pipeline stage compute what the model does.

These run only where CUDA is present (CI has no GPU); they were run on an H200, see the
"Pipeline runtime" section of benchmarks/RESULTS.md. On the CPU the same behaviour is covered by
tests/test_runtime_offload.py and tests/test_runtime_pipeline.py.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.examples import GPTStyleLM, ResidualMLP, TransformerLM
from autoshard.examples.models import causal_mask
from autoshard.runtime import OffloadRunner, build_schedule, pipeline_stage, run_local

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]
#: GPU kernels sum in another order than the CPU's: compare with a float32 tolerance.
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


def test_offload_inference_on_cuda_matches_the_model_on_cpu():
    torch.manual_seed(0)
    model = TransformerLM().eval()
    args = (torch.randint(0, 100, (12, 3)), causal_mask(12))
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    with torch.no_grad():
        out = OffloadRunner(sharded, "cuda")(*args)
        expected = model(*args)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, **CLOSE)
    assert all(p.device.type == "cpu" for p in model.parameters()), "weights must go back to the CPU"


def test_offload_training_on_cuda_gives_the_models_gradients():
    torch.manual_seed(0)
    model = ResidualMLP()
    x = torch.randn(8, 16)
    model(x).pow(2).mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    runner = OffloadRunner(autoshard.shard_model(model, 3, example_inputs=(x,)), "cuda")
    runner(x).pow(2).mean().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.cpu(), expected[name], **CLOSE, msg=lambda m: f"{name}: {m}")


def test_a_sharded_model_moved_to_cuda_by_hand_matches_the_model():
    """``torch.arange(n, device=idx.device)`` was captured on the CPU; each stage reads its device
    from its inputs again, so the embedding is not indexed with a CPU tensor."""
    torch.manual_seed(0)
    model, ids = GPTStyleLM().eval(), torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        expected = model(ids)
        sharded = copy.deepcopy(autoshard.shard_model(model, 2, example_inputs=(ids,))).to("cuda")
        out = sharded(ids.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, **CLOSE)


def test_stages_on_the_cpu_and_a_gpu_chain_like_the_model():
    """Untied: a weight two stages share moves with either (``nn.Module.to`` moves the parameter)."""
    torch.manual_seed(0)
    model, ids = GPTStyleLM(tied=False).eval(), torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        expected = model(ids)
        sharded = copy.deepcopy(autoshard.shard_model(model, 2, example_inputs=(ids,)))
        sharded.stages[1].to("cuda")
        out = sharded(ids)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, **CLOSE)


def _one_rank_interleaved_step(rank: int, world: int) -> dict:
    """Both stages of a 2-stage plan on this rank's GPU under the interleaved 1F1B schedule."""
    torch.manual_seed(0)
    model = ResidualMLP()
    inputs, target = torch.randn(8, 16), torch.randn(8, 16)
    sharded = autoshard.shard_model(model, 2, example_inputs=(inputs,))
    stages = [pipeline_stage(sharded, index, 2, f"cuda:{rank}") for index in (0, 1)]
    schedule = build_schedule(stages, "interleaved-1f1b", 4, loss_fn=F.mse_loss)
    losses: list[torch.Tensor] = []
    schedule.step(inputs.cuda(), target=target.cuda(), losses=losses)
    grads = {n: p.grad.cpu() for s in stages for n, p in s.submod.named_parameters()}
    return {"loss": torch.stack(losses).mean().cpu(), "grads": grads}


@pytest.mark.multiprocess
def test_pipeline_stages_on_cuda_train_like_the_model():
    torch.manual_seed(0)
    model = ResidualMLP()
    inputs, target = torch.randn(8, 16), torch.randn(8, 16)
    for chunk_in, chunk_target in zip(inputs.chunk(4), target.chunk(4)):
        (F.mse_loss(model(chunk_in), chunk_target) / 4).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    [result] = run_local(_one_rank_interleaved_step, 1, backend="nccl", timeout=240)
    assert result["grads"].keys() == reference.keys()
    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, reference[name], **CLOSE, msg=lambda m: f"{name}: {m}")


def test_measuring_a_cpu_stage_gives_back_the_random_state_of_a_gpu_stage_before_it():
    """Measuring stage 1 runs stage 0 first: its dropout on the GPU draws from the GPU's generator."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).train()
    x = torch.randn(4, 8)
    sharded = copy.deepcopy(autoshard.shard_model(model, 2, example_inputs=(x,)))
    sharded.stages[0].to("cuda")
    assert autoshard.sharded.stage_device(sharded.stages[1]).type == "cpu"
    before = torch.cuda.get_rng_state()
    autoshard.runtime.measure_stage_time(sharded, 1, (x.cuda(),), repeats=1)
    assert torch.equal(torch.cuda.get_rng_state(), before)


def test_a_plan_made_on_the_gpu_predicts_the_memory_its_stages_hold():
    """Planned where it runs, the probe of what autograd saves runs the GPU's kernels (its attention
    saves no attention matrix): each stage's predicted training memory within 10% of the allocator's peak."""
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=512, width=256, layers=4, heads=4, max_seq=128).cuda()
    ids = torch.randint(0, 512, (4, 128), device="cuda")
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids,))
    predicted = autoshard.plan_report(sharded, memory=autoshard.MemoryModel(microbatches=2)).stages
    for j in range(2):
        measured = autoshard.runtime.measure_stage_memory(sharded, j, (ids,), microbatches=2)
        assert measured.source == "torch.cuda.max_memory_allocated"
        assert 0.9 <= predicted[j].memory.total / measured.peak <= 1.1, (j, predicted[j].memory.total, measured.peak)


def test_the_first_stage_measured_in_a_process_does_not_hold_cublas_workspaces():
    """cuBLAS takes a 32 MiB workspace per thread at its first matrix product on a device (autograd's
    in the first backward): measured inside, the first stage of a budget check read 57x its budget."""
    code = """if True:
        import torch, autoshard
        from autoshard.runtime import measure_stage_memory
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).cuda()
        x = torch.randn(4, 8, device="cuda")
        sharded = autoshard.shard_model(model, 2, example_inputs=(x,))
        print(measure_stage_memory(sharded, 0, (x,)).peak, measure_stage_memory(sharded, 0, (x,)).peak)"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True)
    first, second = (int(v) for v in run.stdout.split()[-2:])
    assert first == second < 1 << 20, (first, second)
