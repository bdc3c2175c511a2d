"""One pipeline step of a tiny Hugging Face GPT-2 on two processes, checked against one process.

    torchrun --nproc-per-node 2 examples/check_gpt2_step.py
    torchrun --nproc-per-node 2 examples/check_gpt2_step.py --plan gpt2-plan.json

Every rank builds the same model from the same seed and splits it into one stage per process (or
rebuilds the stages of a plan saved with ``sharded.save_plan``). ``check_pipeline_step`` then runs
one GPipe step and the unsplit model on the same batch and compares the loss and every gradient;
every rank gets the same verdict, and a mismatch raises ``VerificationError`` on all of them. This
is the page "Hugging Face walk-through" of the docs; it needs ``transformers``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

import autoshard
from autoshard.runtime import (
    TiedGradients, build_schedule, check_pipeline_step, leave_process_group, model_loss, pipeline_stage,
)


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    """GPT-2 with 4 blocks of width 64 and random weights; no dropout, so two runs can agree."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=2,
                                     bos_token_id=0, eos_token_id=0, use_cache=False,
                                     embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", help="a plan file written by sharded.save_plan (default: split here)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = tiny_gpt2()
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    microbatch = ids[:2]  # the plan is made for one microbatch: its memory and times are per microbatch
    if args.plan:
        sharded = autoshard.load_plan(args.plan, model, (microbatch,), {"labels": microbatch})
    else:
        sharded = autoshard.shard_model(model, world, example_inputs=(microbatch,),
                                        example_kwargs={"labels": microbatch},
                                        memory_model=autoshard.MemoryModel(schedule="gpipe", microbatches=4))

    stage = pipeline_stage(sharded, rank, world, "cpu")  # stage i runs on rank i
    schedule = build_schedule(stage, "gpipe", 4, loss_fn=model_loss)  # 4 microbatches of 2 rows
    ties = TiedGradients(sharded, [stage])  # sums the gradients of wte/lm_head, held by both stages
    check = check_pipeline_step(schedule, stage, model, (ids,), {"labels": ids}, target=ids,
                                loss_fn=model_loss, ties=ties)
    if rank == 0:
        print(check)
    leave_process_group()  # (returning instead can abort in gloo's teardown: see its docstring)


if __name__ == "__main__":
    main()
