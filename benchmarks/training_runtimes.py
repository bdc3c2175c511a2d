"""A training step of a model computing its own loss, eager and through autoshard's one-process runners.

    python benchmarks/training_runtimes.py                        # GPT-2, T5, Llama at k = 1, 2, 4
    python benchmarks/training_runtimes.py --only Llama --stages 4 --repeats 9

Tiny random-weight Hugging Face models (``call_overhead.py``'s configs: 4 layers (T5: 2 + 2), width
64, batch 2 x 32 tokens, dropout 0) in training mode, given ``labels``; one step is forward +
``loss.backward()``, the gradients set to None before it. Per row: the model itself (eager); its
``ShardedModel`` (sharded); ``OffloadRunner(sharded, "cpu")`` (offload: every stage under activation
checkpointing, run on copies of its weights, so it computes each forward twice by design); and
every stage's ``pipeline_stage`` in this one process (a gloo group of one) under interleaved 1F1B
(GPipe at k = 1) with one microbatch (pipeline). Each is checked against eager: every parameter's
gradient after one step (a weight tied across the pipeline's stages is held by each as a copy;
their gradients are summed, in another order: a rounding difference there is expected). Best of
``--repeats`` interleaved repeats, timed in this thread's CPU time, one torch thread.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.runtime import OffloadRunner, build_schedule, model_loss, pipeline_stage


def _model(name: str) -> tuple[nn.Module, dict[str, Any]]:
    import transformers as T

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 32))
    if name == "GPT-2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=4, n_head=2,
                                               use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif name == "T5":
        model = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2,
            use_cache=False, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
        return model.train(), {"input_ids": ids, "labels": torch.randint(0, 128, (2, 16))}
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, max_position_embeddings=64, num_key_value_heads=1,
                                                 use_cache=False, num_hidden_layers=4, hidden_size=64,
                                                 num_attention_heads=2, intermediate_size=128))
    return model.train(), {"input_ids": ids, "labels": ids}


def _loss(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output[0]


def _gradients(model: nn.Module, held: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every gradient by the model's name for its parameter; ``held`` (the pipeline's stages'
    parameters by name) adds the gradients of copies, summed into the parameter they copy."""
    own = {id(p): name for name, p in model.named_parameters()}
    name_of = {name: own[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    found = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for name, p in held.items():
        if p.grad is not None and id(p) not in own:
            key = name_of[name]
            found[key] = found[key] + p.grad if key in found else p.grad.clone()
    return found


def _verdict(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    if expected.keys() != found.keys():
        return f"NO ({len(found)} gradients, {len(expected)} expected)"
    if all(torch.equal(expected[name], found[name]) for name in expected):
        return "yes"
    return f"max diff {max((expected[n] - found[n]).abs().max().item() for n in expected):.1e}"


def measure(name: str, k: int, repeats: int) -> str:
    model, inputs = _model(name)
    sharded = autoshard.shard_model(model, k, example_kwargs=inputs)
    runner = OffloadRunner(sharded, "cpu")
    stages = [pipeline_stage(sharded, i, k, "cpu") for i in range(k)]
    schedule = build_schedule(stages if k > 1 else stages[0], "interleaved-1f1b" if k > 1 else "gpipe", 1,
                              loss_fn=model_loss)
    held = {n: p for stage in stages for n, p in stage.submod.named_parameters()}
    everything = list(model.parameters()) + list(held.values())

    def step(run: Callable[[], Any]) -> Callable[[], None]:
        def stepped() -> None:
            for p in everything:
                p.grad = None
            run()
        return stepped

    steps = {
        "eager": step(lambda: _loss(model(**inputs)).backward()),
        "sharded": step(lambda: _loss(sharded(**inputs)).backward()),
        "offload": step(lambda: _loss(runner(**inputs)).backward()),
        "pipeline": step(lambda: schedule.step(**inputs, target=inputs["labels"], return_outputs=False)),
    }
    steps["eager"]()
    expected = _gradients(model, {})
    verdicts = {}
    for variant in ("sharded", "offload", "pipeline"):
        steps[variant]()
        verdicts[variant] = _verdict(expected, _gradients(model, held))
    for run in steps.values():
        run(), run()
    start = time.thread_time()
    steps["eager"]()
    calls = max(5, min(100, int(0.15 / max(time.thread_time() - start, 1e-6))))
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for variant, run in steps.items():
            start = time.thread_time()
            for _ in range(calls):
                run()
            best[variant] = min(best[variant], (time.thread_time() - start) / calls)
    cells = [f"{best['eager'] * 1e6:.0f}"]
    for variant in ("sharded", "offload", "pipeline"):
        cells += [f"{best[variant] * 1e6:.0f}", f"{best[variant] / best['eager']:.3f}", verdicts[variant]]
    return f"| {name} | {k} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="the models whose name contains this (GPT-2, T5, Llama)")
    parser.add_argument("--stages", default="1,2,4", help="numbers of stages, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats, best kept")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        print("| model | k | eager (us) | sharded (us) | sharded / eager | grads | offload (us) | offload / eager "
              "| grads | pipeline, 1 microbatch (us) | pipeline / eager | grads |")
        print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- |")
        for name in [n for n in ("GPT-2", "T5", "Llama") if options.only in n]:
            for k in (int(k) for k in options.stages.split(",")):
                print(measure(name, k, options.repeats), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
