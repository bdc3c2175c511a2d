"""Per-rank weight-state memory of pipelining alone against pipelining x FSDP (``parallelize``).

    python benchmarks/parallel_memory.py            # 2 + 4 gloo processes on this machine's CPUs
    python benchmarks/parallel_memory.py --quick    # a smaller model

A GPT-style LM split into k = 2 stages runs one Adam step on 2 processes (pipelining alone, a
2 x 1 mesh) and on 4 (2 pipeline x 2 FSDP ranks). On every rank the bytes of what the step leaves
behind are measured from the tensors themselves: the storages of the parameters, their gradients
and the optimizer's state (each storage once, padding included: FSDP pads a shard to an equal
share). FSDP's target: every rank holds within 10% of its stage's unsharded state / dp. The
resident memory each process gained during setup and step is printed beside them (it also holds
activations freed since, which the allocator may keep), and the peak the step itself added over
what the process held before it (the resident high-water mark).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource

import torch

import autoshard
from autoshard.examples import GPTStyleLMWithLoss
from autoshard.runtime import model_loss, parallelize, run_local

BATCH, MICROBATCHES = 8, 4
MB = 2 ** 20


def build(quick: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    width, layers = (128, 4) if quick else (512, 8)
    model = GPTStyleLMWithLoss(vocab=8192, width=width, layers=layers, heads=8)
    ids = torch.randint(0, 8192, (BATCH, 32), generator=torch.Generator().manual_seed(1))
    return model, ids, ids.roll(-1, dims=1)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard's)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """The process's resident high-water mark (``VmHWM``), since start or the last reset."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear:  # "5": reset the high-water mark (Linux >= 4.0)
        clear.write("5")


def measure(rank: int, world: int, sharded: autoshard.ShardedModel, ids: torch.Tensor, targets: torch.Tensor,
            dp: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    before = rss()
    mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
    parallel = parallelize(sharded, mesh, microbatches=MICROBATCHES, loss_fn=model_loss,
                           data_parallel="fsdp" if dp > 1 else None)
    params = list(parallel.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)
    my_ids, my_targets = parallel.local_rows((ids, targets))
    before_step = rss()
    reset_peak_rss()
    parallel.schedule.step(*((my_ids, my_targets) if parallel.is_first else ()),
                           target=my_targets if parallel.is_last else None, return_outputs=False)
    parallel.sync_gradients()
    optimizer.step()
    step_peak = peak_rss() - before_step
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    unsharded = sum(sharded.stages[stage.stage_index].get_parameter(name).nbytes
                    for stage in parallel.stages for name, _ in stage.submod.named_parameters())
    return {"stage": parallel.stages[0].stage_index, "weights": storage_bytes(params),
            "grads": storage_bytes(p.grad for p in params), "optimizer": storage_bytes(state),
            "stage weights unsharded": unsharded, "rss growth": rss() - before, "step peak": step_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    args = parser.parse_args()
    model, ids, targets = build(args.quick)
    sharded = autoshard.shard_model(model, 2, example_inputs=(ids[:1], targets[:1]))
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT-style LM, {params / 1e6:.1f} M parameters ({params * 4 / MB:.0f} MB fp32), k = 2, Adam; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {datetime.date.today()}")
    print("| layout | rank | stage | weights (MB) | grads (MB) | Adam state (MB) | weight state (MB) "
          "| unsharded stage state / dp (MB) | ratio | RSS growth (MB) | step peak (MB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dp, world in ((1, 2), (2, 4)):
        rows = run_local(measure, world, args=(sharded, ids, targets, dp), timeout=900)
        for rank, row in enumerate(rows):
            state = row["weights"] + row["grads"] + row["optimizer"]
            target = 4 * row["stage weights unsharded"] / dp  # weights, grads and Adam's two moments
            print(f"| {'PP alone (2 x 1)' if dp == 1 else 'PP x FSDP (2 x 2)'} | {rank} | {row['stage']} "
                  f"| {row['weights'] / MB:.2f} | {row['grads'] / MB:.2f} | {row['optimizer'] / MB:.2f} "
                  f"| {state / MB:.2f} | {target / MB:.2f} | {state / target:.3f} | {row['rss growth'] / MB:.0f} "
                  f"| {row['step peak'] / MB:.0f} |")


if __name__ == "__main__":
    main()
