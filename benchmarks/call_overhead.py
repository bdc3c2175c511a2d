"""What calling a sharded model costs beyond the model's own work, side by side.

    python benchmarks/call_overhead.py            # ~3 minutes on 2 cores
    python benchmarks/call_overhead.py --quick    # fewer repeats, noisier
    python benchmarks/call_overhead.py --only MLP --repeats 31   # one row, best of 31
    python benchmarks/call_overhead.py --clock thread   # CPU time of the thread: steadier under load

One torch thread. Per row: the model called eagerly; autoshard's ``ShardedModel``; autoshard's
stages chained by hand (``vals = stages[0](...)``, then ``stage(*vals)``); and the stage modules of
``torch.distributed.pipelining.pipeline()`` split at the same module boundaries, run in turn by
its ``Pipe`` in one process (n/a where ``pipeline()`` cannot split the model there, and for
forward + backward, where that ``Pipe`` gives the weights no gradients). Each variant runs
``calls`` calls per repeat; the repeats are interleaved (eager, sharded, chained, pipeline(), eager, ...) so
background load weighs on all alike, and the best repeat is kept. ``added / stage call`` is
(sharded - eager) / k: what each stage call adds. Rows: an 8-layer MLP (width 64, batch 4) at
k = 4; the GPT-style LM (width 256, 4 layers, batch 4 x 128) at k = 4 in a no_grad forward and in
forward + backward; a tiny Hugging Face GPT-2 (2 layers, width 64, batch 2 x 32) at k = 2; and
``nn.TransformerEncoder`` (6 layers, width 256, batch 8 x 128) in eval mode under no_grad at k = 3,
whose output is also checked bit-exact against the model's. With ``--cuda`` the same table runs on
the GPU with CUDA-synchronised timings.
"""

from __future__ import annotations

import argparse
import warnings
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

import autoshard
from autoshard.examples import GPTStyleLM


@dataclass
class Row:
    name: str
    model: nn.Module
    args: tuple[Any, ...]
    stages: int
    backward: bool = False


def _mlp() -> Row:
    layers = [m for _ in range(8) for m in (nn.Linear(64, 64), nn.ReLU())]
    return Row("MLP 8x64, batch 4", nn.Sequential(*layers).eval(), (torch.randn(4, 64),), 4)


def _gpt(backward: bool) -> Row:
    model = GPTStyleLM(vocab=512, width=256, layers=4, heads=4, max_seq=128).eval()
    ids = torch.randint(0, 512, (4, 128))
    return Row(f"GPT-style LM, {'forward+backward' if backward else 'no_grad forward'}", model, (ids,), 4, backward)


def _hf_gpt2() -> Row | None:
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                     use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    return Row("HF GPT-2 tiny, no_grad forward", model, (torch.randint(0, 128, (2, 32)),), 2)


def _encoder() -> Row:
    layer = nn.TransformerEncoderLayer(256, 8, 512, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).eval()
    return Row("nn.TransformerEncoder eval, no_grad", model, (torch.randn(8, 128, 256),), 3)


def _pipeline_split(model: nn.Module, sharded: Any, args: tuple[Any, ...]) -> Callable[[], Any] | str:
    """``pipeline()``'s stage modules split where autoshard's stages start, run in turn by its ``Pipe``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    starts = [sharded.plan.modules(stage)[0] for stage in range(1, sharded.num_stages)]
    try:
        pipe = pipeline(model, mb_args=args, split_spec={path: SplitPoint.BEGINNING for path in starts})
    except Exception as exc:  # noqa: BLE001 - a row says why it has no pipeline() column
        return f"n/a ({type(exc).__name__})"
    if pipe.num_stages != sharded.num_stages:
        return f"n/a ({pipe.num_stages} stages)"
    return lambda: pipe(*args)


#: The clock ``_timed`` reads: wall time, or with ``--clock thread`` this thread's CPU time, which
#: leaves out the time other processes hold the core (one torch thread computes on this thread).
_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = _CLOCKS["wall"]


def _timed(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = _clock()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (_clock() - start) / calls


def _variants(row: Row, sharded: Any) -> dict[str, Callable[[], Any] | str]:
    def chained() -> Any:
        values = sharded.stages[0](*row.args)
        for stage in sharded.stages[1:]:
            values = stage(*values)
        return values

    variants: dict[str, Callable[[], Any] | str] = {
        "eager": lambda: row.model(*row.args), "sharded": lambda: sharded(*row.args), "chained": chained,
        "pipeline()": _pipeline_split(row.model, sharded, row.args)}
    if row.backward:
        def with_backward(fn: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: _first(fn()).float().sum().backward()
        variants = {k: with_backward(v) if callable(v) else v for k, v in variants.items()}
        # run in one process, pipeline()'s Pipe gives its stages' weights no gradients (checked on
        # the GPT-style LM): its backward would time less work than the model's
        variants["pipeline()"] = "n/a (no weight gradients)"
    return variants


def measure(row: Row, repeats: int, cuda: bool) -> dict[str, Any]:
    device = "cuda" if cuda else "cpu"
    row.model.to(device)
    row.args = tuple(a.to(device) for a in row.args)
    sharded = autoshard.shard_model(row.model, row.stages, example_inputs=row.args)
    variants = _variants(row, sharded)
    grad = torch.enable_grad() if row.backward else torch.no_grad()
    with grad:
        for fn in variants.values():  # warm up: first calls build caches and kernels
            if callable(fn):
                fn(), fn()
        once = _timed(variants["eager"], 1, cuda)
        calls = max(5, min(500, int(0.2 / max(once, 1e-6))))
        best: dict[str, float] = {}
        for _ in range(repeats):
            for name, fn in variants.items():
                if callable(fn):
                    best[name] = min(best.get(name, float("inf")), _timed(fn, calls, cuda))
        exact = None
        if not row.backward:
            exact = torch.equal(_first(row.model(*row.args)), _first(sharded(*row.args)))
    result: dict[str, Any] = {"row": row.name, "k": row.stages, "exact": exact}
    result.update({name: best.get(name, fn) for name, fn in variants.items()})
    return result


def _first(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]  # a tuple, or a ModelOutput's first


def _us(value: Any) -> str:
    return f"{value * 1e6:.1f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats per row, best kept (more find quieter moments on a loaded machine)")
    parser.add_argument("--only", default="", help="run only the rows whose name contains this (e.g. MLP)")
    parser.add_argument("--cuda", action="store_true", help="run on the GPU (CUDA-synchronised timings)")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                        help="thread: CPU time of this thread, steadier on a loaded machine (not with --cuda)")
    options = parser.parse_args()
    global _clock
    _clock = _CLOCKS["wall" if options.cuda else options.clock]
    repeats = options.repeats or (3 if options.quick else 7)
    warnings.filterwarnings("ignore")  # pipeline()'s and transformers' notices would break the table
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [_mlp(), _gpt(False), _gpt(True), _hf_gpt2(), _encoder()]
    print("| row | k | eager (us) | sharded (us) | chained (us) | pipeline() (us) | sharded / eager "
          "| added / stage call (us) | bit-exact |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        if row is None or options.only not in row.name:
            continue
        r = measure(row, repeats, options.cuda)
        added = (r["sharded"] - r["eager"]) / r["k"]
        exact = "" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        print(f"| {r['row']} | {r['k']} | {_us(r['eager'])} | {_us(r['sharded'])} | {_us(r['chained'])} "
              f"| {_us(r['pipeline()'])} | {r['sharded'] / r['eager']:.3f} | {added * 1e6:.1f} | {exact} |",
              flush=True)


if __name__ == "__main__":
    main()
