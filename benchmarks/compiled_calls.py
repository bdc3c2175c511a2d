"""What ``torch.compile(sharded)`` costs against ``torch.compile(model)``, and how many graphs it makes.

    python benchmarks/compiled_calls.py                 # ~4 minutes on 2 cores (inductor compiles each)
    python benchmarks/compiled_calls.py --backend eager --quick   # graphs and breaks alone, in a minute

One torch thread. Per row (k = 4): the model called eagerly, the model compiled and the sharded model
compiled, each ``calls`` calls per repeat, repeats interleaved so background load weighs on all alike,
the best kept; ``ratio`` is compiled sharded / compiled model. ``graphs`` and ``breaks`` count what
torch.compile made of the sharded model over the warm-up calls (torch._dynamo's counters): one graph
with no break is a whole call traced, stages and checks; a break makes each piece its own graph, with
the code between run as Python. ``Python guards`` counts the guards of the graphs those warm-up calls
compiled that Dynamo evaluates in Python on every call (the rest run in C++). ``max diff`` is the largest
difference between the two compiled outputs (a training row: the first output's; the compilers may order
sums differently).
Rows: an 8-layer MLP (width 64, batch 4), and tiny random-weight Hugging Face GPT-2, Llama and BERT (4 layers,
width 64, batch 2 x 32 tokens) in eval mode under no_grad, and GPT-2 in training mode (dropout 0),
forward + backward from the sum of the logits.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch._dynamo
import torch._dynamo.utils
from torch import nn

import autoshard

STAGES = 4


@dataclass(frozen=True)
class Row:
    name: str
    build: Callable[[], nn.Module]
    example: Callable[[], torch.Tensor]
    training: bool = False


def _mlp() -> nn.Module:
    return nn.Sequential(*(layer for _ in range(8) for layer in (nn.Linear(64, 64), nn.ReLU())))


def _gpt2() -> nn.Module:
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0,
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama() -> nn.Module:
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, bos_token_id=0, eos_token_id=0, use_cache=False))


def _bert() -> nn.Module:
    import transformers
    return transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=1000))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 1000, (2, 32))


ROWS = [
    Row("MLP 8x64, batch 4, eval no_grad", _mlp, lambda: torch.randn(4, 64)),
    Row("HF GPT-2 tiny, eval no_grad", _gpt2, _tokens),
    Row("HF Llama tiny, eval no_grad", _llama, _tokens),
    Row("HF BERT tiny, eval no_grad", _bert, _tokens),
    Row("HF GPT-2 tiny, train forward+backward", _gpt2, _tokens, training=True),
]


def _first(output: object) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        output = getattr(output, name, output)
    return output  # type: ignore[return-value]


class PythonGuards(logging.Handler):
    """Counts the guards Dynamo evaluates in Python (``LAMBDA_GUARD``: an object reached two ways, a test of
    its own) among those it logs for the graphs compiled while it is entered; the rest run in C++."""

    def __enter__(self) -> PythonGuards:
        self.count = 0
        logging.getLogger("torch._dynamo.guards").addHandler(self)
        torch._logging.set_logs(guards=True)
        return self

    def __exit__(self, *exc: object) -> None:
        torch._logging.set_logs()
        logging.getLogger("torch._dynamo.guards").removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().count("LAMBDA_GUARD")


def _call(fn: Callable[[torch.Tensor], object], x: torch.Tensor, training: bool) -> torch.Tensor:
    if training:
        out = _first(fn(x))
        out.sum().backward()
        return out.detach()
    with torch.no_grad():
        return _first(fn(x))


def measure(row: Row, backend: str, repeats: int, calls: int, clock: Callable[[], float]) -> list[str]:
    torch.manual_seed(0)
    model = row.build().train(row.training)
    x = row.example()
    sharded = autoshard.shard_model(model, STAGES, (x,))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_sharded = torch.compile(sharded, backend=backend)
    with PythonGuards() as sharded_guards:
        for _ in range(3):
            sharded_out = _call(compiled_sharded, x, row.training)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled_model = torch.compile(model, backend=backend)
    with PythonGuards() as model_guards:
        for _ in range(3):
            model_out = _call(compiled_model, x, row.training)
    variants = {"eager": model, "model": compiled_model, "sharded": compiled_sharded}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name, fn in variants.items():
            start = clock()
            for _ in range(calls):
                _call(fn, x, row.training)
            best[name] = min(best[name], (clock() - start) / calls)
    diff = (sharded_out.float() - model_out.float()).abs().max().item()
    times = [f"{best[name] * 1e6:.1f}" for name in variants]
    ratio = f"{best['sharded'] / best['model']:.3f}"
    return [row.name, str(STAGES), *times, ratio, str(graphs), str(breaks),
            f"{model_guards.count} / {sharded_guards.count}", f"{diff:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: no code generated)")
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--only", default="", help="run only the rows whose name contains this")
    parser.add_argument("--clock", choices=("thread", "wall"), default="wall",
                        help="thread: CPU time of this thread, steadier on a loaded machine")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, backend {args.backend}, one thread, k = {STAGES}")
    print("| row | k | eager model (us) | compiled model (us) | compiled sharded (us) | ratio | graphs | breaks "
          "| Python guards: model / sharded | max diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in ROWS:
        if args.only in row.name:
            cells = measure(row, args.backend, 3 if args.quick else 7, 20, clock)
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
