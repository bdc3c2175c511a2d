"""What calling a sharded model costs beyond the model's own work, side by side.

    python benchmarks/call_overhead.py            # ~7 minutes on 2 cores
    python benchmarks/call_overhead.py --only "HF BERT" --repeats 15   # one real model at k = 1, 2, 4
    python benchmarks/call_overhead.py --only "train forward" --clock thread   # the HF models in training
    python benchmarks/call_overhead.py --quick    # fewer repeats, noisier
    python benchmarks/call_overhead.py --only MLP --repeats 31   # one row, best of 31
    python benchmarks/call_overhead.py --clock thread   # CPU time of the thread: steadier under load
    python benchmarks/call_overhead.py --only MLP --instructions   # instructions per call (valgrind)

One torch thread. Per row: the model called eagerly; autoshard's ``ShardedModel``; autoshard's
stages chained by hand (``vals = stages[0](...)``, then ``stage(*vals)``); and the stage modules of
``torch.distributed.pipelining.pipeline()`` split at the same module boundaries, run in turn by
its ``Pipe`` in one process (n/a where ``pipeline()`` cannot split the model there, and for
forward + backward, where that ``Pipe`` gives the weights no gradients). Each variant runs
``calls`` calls per repeat; the repeats are interleaved (eager, sharded, chained, pipeline(), eager, ...) so
background load weighs on all alike, and the best repeat is kept. ``added / stage call`` is
(sharded - eager) / k: what each stage call adds. Rows: an 8-layer MLP (width 64, batch 4) at
k = 4, its layers called on a dict of two tensors (``--only dict``: a container argument, which
the input guard checks every call), and its layers after a setting switched before every call
(``--only switched``: each call served by the plan made for the other setting than the last's;
no chained column), and the MLP with a forward hook of a closure made anew before every call
(``--only hook``: a feature extractor's loop; the plan runs that layer's hooks as it finds them)
and with a number argument switched between two values before every call (``--only constant``);
its layers on a dict whose tensor's length, which a branch after the sixth layer reads, is switched
between 1 and 8 before every call (``--only alternated``), and four convolutions around
``F.interpolate`` to a size argument cycled through three values before every call (``--only cycled``):
each call served by the plan made for its shapes or values, no other tried first;
the GPT-style LM (width 256, 4 layers, batch 4 x 128) at k = 4 in a no_grad forward and in
forward + backward; a tiny Hugging Face GPT-2 (2 layers, width 64, batch 2 x 32) at k = 2; and
``nn.TransformerEncoder`` (6 layers, width 256, batch 8 x 128) in eval mode under no_grad at k = 3,
whose output is also checked bit-exact against the model's; and tiny random-weight Hugging Face
models (GPT-2, BERT, T5, ViT, Llama: 4 layers (T5: 2 + 2), width 64, batch 2 x 32 tokens or 2 images of 32 x 32;
about 1 ms a call) in eval mode under no_grad at k = 1, 2 and 4, where the model's own Python per
call meets autoshard's (the capture leaves some of it behind, so the sharded call may be the
faster), and the same models in training mode with dropout 0, forward + backward from the sum of
the first output (``--only train``; ``bit-exact`` there: every parameter's gradient after one step of
each). With ``--cuda`` the same table runs on the GPU with CUDA-synchronised timings.

With ``--instructions`` nothing is timed: the script runs itself again under valgrind's callgrind
and counts the instructions of ``calls`` calls of each variant (eager, sharded, chained; not
``pipeline()``), three rounds each, the median kept, less the loop's own (an empty call): a count
that other processes on the machine do not move. It needs ``valgrind``, its ``callgrind.h`` and a C
compiler (for the few lines that start and dump the count from inside Python); about 3 minutes
for the MLP row, far longer for the others (each instruction runs about 50x slower).
"""

from __future__ import annotations

import argparse
import copy
import collections
import ctypes
import gc
import glob
import linecache
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

import autoshard
from autoshard.examples import GPTStyleLM


@dataclass
class Row:
    name: str
    model: nn.Module
    args: tuple[Any, ...]
    stages: int
    backward: bool = False
    #: a change made to the model before every call (of the model and of the sharded model alike)
    between: Callable[[nn.Module], None] | None = None


def _mlp_layers() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.ReLU())])


def _mlp() -> Row:
    return Row("MLP 8x64, batch 4", _mlp_layers().eval(), (torch.randn(4, 64),), 4)


class _ReadsADict(nn.Module):
    """The MLP's layers on the sum of a dict's two tensors: a container argument, which the input
    guard checks (layout, keys, dtypes) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _mlp_layers()

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.layers(inputs["x"] + inputs["y"])


def _dict_input() -> Row:
    return Row("dict input, 8x64 layers, batch 4", _ReadsADict().eval(),
               ({"x": torch.randn(4, 64), "y": torch.randn(4, 64)},), 4)


class _SwitchesItsActivation(nn.Module):
    """The MLP's layers, each followed by the activation a setting names: switched before every call
    (``between``), so each call is served by the plan captured for the other setting than the last."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.act = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x)) if self.act == "relu" else torch.tanh(layer(x))
        return x


def _switched_setting() -> Row:
    def switch(model: nn.Module) -> None:
        model.act = "tanh" if model.act == "relu" else "relu"
    return Row("setting switched every call, 8x64 layers, batch 4", _SwitchesItsActivation().eval(),
               (torch.randn(4, 64),), 4, between=switch)


class _Scaled(nn.Module):
    """The MLP's layers with their input scaled by a number argument, which a capture keeps as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _mlp_layers()

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.layers(x * scale)


def _constant_switched() -> Row:
    """``scale`` switched between two values before every call: each call served by the plan made
    for its value (the plan tried first is keyed by the constant too)."""
    row = Row("constant switched every call, 8x64 layers, batch 4", _Scaled().eval(), (torch.randn(4, 64), 1.0), 4)

    def switch(model: nn.Module) -> None:
        row.args = (row.args[0], 0.5 if row.args[1] == 1.0 else 1.0)
    row.between = switch
    return row


class _BranchesOnALength(nn.Module):
    """The MLP's layers on a dict's tensor, with a branch on its length after the sixth (a decoder's
    ``q_len > 1``): a plan made for the other length computes its first stages before its guard refuses."""

    def __init__(self) -> None:
        super().__init__()
        layers = _mlp_layers()
        self.first, self.late, self.last = layers[:12], nn.Linear(64, 64), layers[12:]

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.first(inputs["x"])
        if inputs["x"].shape[1] > 1:
            x = self.late(x).cumsum(1)
        return self.last(x)


def _length_alternated() -> Row:
    """The dict's tensor switched between lengths 1 and 8 before every call: each call served by the
    plan made for its length (the plan tried first is keyed by the shapes inside a dict too)."""
    short, long = {"x": torch.randn(4, 1, 64)}, {"x": torch.randn(4, 8, 64)}
    row = Row("length in a mapping alternated every call, branch after layer 6, 8x64 layers, batch 4",
              _BranchesOnALength().eval(), (long,), 4)

    def switch(model: nn.Module) -> None:
        row.args = (short if row.args[0] is long else long,)
    row.between = switch
    return row


class _Resizes(nn.Module):
    """Four small convolutions, resized to a size argument after the second: a capture keeps the size as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in ((3, 8), (8, 8), (8, 8), (8, 3)))

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        x = self.convs[1](torch.relu(self.convs[0](x)))
        x = nn.functional.interpolate(x, size=size)
        return self.convs[3](torch.relu(self.convs[2](x)))


def _size_cycled() -> Row:
    """``size`` cycled through (16, 16), (24, 24) and (20, 20) before every call: each value a plan of
    its own, tried first (the plan tried first is keyed by a tuple's items too)."""
    sizes = ((16, 16), (24, 24), (20, 20))
    row = Row("size argument cycled through 3 every call, 4 convolutions, 16x16", _Resizes().eval(),
              (torch.randn(1, 3, 16, 16), sizes[0]), 4)

    def switch(model: nn.Module) -> None:
        row.args = (row.args[0], sizes[(sizes.index(row.args[1]) + 1) % len(sizes)])
    row.between = switch
    return row


def _hook_made_each_call() -> Row:
    """The MLP's layers in blocks the capture traces through, with a forward hook of a new closure on
    the fourth block before every call, the last call's removed: a feature extractor's loop. The plan
    made for the hook runs that block's hooks as it finds them."""
    handles: list[Any] = []

    def rehook(model: nn.Module) -> None:
        for handle in handles:
            handle.remove()
        handles[:] = [model[3].register_forward_hook(lambda module, args, out: out * 1.0)]
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])
    return Row("forward hook made anew every call, 8x64 layers, batch 4", blocks.eval(),
               (torch.randn(4, 64),), 4, between=rehook)


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


def _hf_tiny(name: str, k: int, train: bool = False) -> Row | None:
    """A Hugging Face model at a tiny random-weight config (4 layers, width 64; about 1 ms a call on
    one core), in eval mode: where a real model's own Python per call meets autoshard's. With
    ``train``: in training mode with every dropout 0 (the same computation in every call), run forward
    + backward from the sum of its first output."""
    try:
        import transformers as T
    except ImportError:
        return None
    layers = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=2, intermediate_size=128)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, mask = torch.randint(0, 128, (2, 32)), torch.ones(2, 32, dtype=torch.long)
    if name == "GPT-2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=4, n_head=2,
                                               use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        args: tuple[Any, ...] = (ids,)
    elif name == "BERT":
        model = T.BertModel(T.BertConfig(vocab_size=128, max_position_embeddings=64, **layers, **no_dropout))
        args = (ids, mask)
    elif name == "T5":
        model = T.T5ForConditionalGeneration(T.T5Config(vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=2,
                                                        num_decoder_layers=2, num_heads=2, use_cache=False,
                                                        dropout_rate=0.0))
        args = (ids, mask, torch.randint(0, 128, (2, 16)))
    elif name == "ViT":
        model = T.ViTModel(T.ViTConfig(image_size=32, patch_size=4, **layers, **no_dropout))
        args = (torch.randn(2, 3, 32, 32),)
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, max_position_embeddings=64, num_key_value_heads=1,
                                                 use_cache=False, attention_dropout=0.0, **layers))
        args = (ids, mask)
    if train:
        return Row(f"HF {name} tiny, train forward+backward", model.train(), args, k, backward=True)
    return Row(f"HF {name} tiny, eval no_grad", model.eval(), args, k)


def _encoder() -> Row:
    layer = nn.TransformerEncoderLayer(256, 8, 512, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).eval()
    return Row("nn.TransformerEncoder eval, no_grad", model, (torch.randn(8, 128, 256),), 3)


#: Every row, by name, built when it runs (``--only`` builds only its own).
ROWS: dict[str, Callable[[], Row | None]] = {
    "MLP 8x64, batch 4": _mlp, "dict input, 8x64 layers, batch 4": _dict_input,
    "setting switched every call, 8x64 layers, batch 4": _switched_setting,
    "forward hook made anew every call, 8x64 layers, batch 4": _hook_made_each_call,
    "constant switched every call, 8x64 layers, batch 4": _constant_switched,
    "length in a mapping alternated every call, branch after layer 6, 8x64 layers, batch 4": _length_alternated,
    "size argument cycled through 3 every call, 4 convolutions, 16x16": _size_cycled,
    "GPT-style LM, no_grad forward": lambda: _gpt(False),
    "GPT-style LM, forward+backward": lambda: _gpt(True), "HF GPT-2 tiny, no_grad forward": _hf_gpt2,
    "nn.TransformerEncoder eval, no_grad": _encoder,
    **{f"HF {name} tiny, eval no_grad, k={k}": (lambda name=name, k=k: _hf_tiny(name, k))
       for name in ("GPT-2", "BERT", "T5", "ViT", "Llama") for k in (1, 2, 4)},
    **{f"HF {name} tiny, train forward+backward, k={k}": (lambda name=name, k=k: _hf_tiny(name, k, train=True))
       for name in ("GPT-2", "BERT", "T5", "ViT", "Llama") for k in (1, 2, 4)}}


def _pipeline_split(model: nn.Module, sharded: Any, args: tuple[Any, ...]) -> Callable[[], Any] | str:
    """``pipeline()``'s stage modules split where autoshard's stages start, run in turn by its ``Pipe``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    if not all(isinstance(a, torch.Tensor) for a in args):
        return "n/a (its Pipe takes a container's tensors apart)"
    starts = [sharded.plan.modules(stage)[0] for stage in range(1, sharded.num_stages)]
    try:  # (on a copy: it patches the forward of each module a split point names, which the plan then sees)
        pipe = pipeline(copy.deepcopy(model), mb_args=args, split_spec={path: SplitPoint.BEGINNING for path in starts})
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


def _calls(row: Row, sharded: Any) -> dict[str, Callable[[], Any]]:
    """The model called eagerly, ``sharded`` called, and its stages chained by hand, each with a
    backward in a forward + backward row: what every mode runs (``pipeline()``'s split is timed alone)."""
    first, *rest = sharded.stages  # once: slicing the ModuleList builds a new one (5-10 us a call)

    def chained() -> Any:
        values = first(*row.args)
        for stage in rest:
            values = stage(*values)
        return values

    calls = {"eager": lambda: row.model(*row.args), "sharded": lambda: sharded(*row.args), "chained": chained}
    if row.between is not None:  # the stages of one plan serve one setting: no chaining them by hand
        calls = {name: _after(row.between, row.model, fn) for name, fn in calls.items() if name != "chained"}
    if row.backward:
        return {name: _with_backward(fn) for name, fn in calls.items()}
    return calls


def _after(change: Callable[[nn.Module], None], model: nn.Module, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        change(model)
        return fn()
    return call


def _with_backward(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` and a backward from its first output's sum, a loss as cheap as it gets."""
    return lambda: _first(fn()).float().sum().backward()


def _variants(row: Row, sharded: Any) -> dict[str, Callable[[], Any] | str]:
    """``_calls`` and ``pipeline()``'s split, or why the row has none (its split is built only to be timed)."""
    if row.backward:
        # run in one process, pipeline()'s Pipe gives its stages' weights no gradients (checked on
        # the GPT-style LM): its backward would time less work than the model's
        split: Callable[[], Any] | str = "n/a (no weight gradients)"
    elif _COUNTER is not None:
        split = "n/a (not counted)"
    elif row.between is not None:
        split = "n/a (one split serves one setting)"
    else:
        split = _pipeline_split(row.model, sharded, row.args)
    return {"chained": "n/a (one plan serves one setting)", **_calls(row, sharded), "pipeline()": split}


def _sharded_on(row: Row, device: str) -> Any:
    """``row``'s model and inputs moved to ``device``, and the plan made there."""
    row.model.to(device)
    row.args = tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, row.args)
    return autoshard.shard_model(row.model, row.stages, example_inputs=row.args)


def _rows(only: str) -> Iterator[Row]:
    """The rows whose name contains ``only``, each built as it comes (``--only`` builds only its own)."""
    for name, make in ROWS.items():
        row = make() if only in name else None
        if row is not None:
            yield row


def measure(row: Row, repeats: int, cuda: bool) -> dict[str, Any]:
    sharded = _sharded_on(row, "cuda" if cuda else "cpu")
    variants = _variants(row, sharded)
    grad = torch.enable_grad() if row.backward else torch.no_grad()
    with grad:
        for fn in variants.values():  # warm up: first calls build caches and kernels
            if callable(fn):
                fn(), fn()
        once = _timed(variants["eager"], 1, cuda)
        if _COUNTER is not None:
            return _counted(row, variants, max(3, min(200, int(2.0 / max(once, 1e-6)))))
        calls = max(5, min(500, int(0.2 / max(once, 1e-6))))
        best: dict[str, float] = {}
        for _ in range(repeats):
            for name, fn in variants.items():
                if callable(fn):
                    best[name] = min(best.get(name, float("inf")), _timed(fn, calls, cuda))
        if row.backward:
            exact = _same_gradients(row.model, variants["eager"], variants["sharded"])
        else:
            exact = torch.equal(_first(row.model(*row.args)), _first(sharded(*row.args)))
    result: dict[str, Any] = {"row": row.name, "k": row.stages, "exact": exact}
    result.update({name: best.get(name, fn) for name, fn in variants.items()})
    return result


def _syncs(fn: Callable[[], Any]) -> list[str]:
    """Where one call waits for the GPU: the caller of each synchronising operation (a value read
    back, a copy to the host), as ``torch.cuda.set_sync_debug_mode`` warns of it."""
    sites: list[str] = []

    def note(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        sites.append(f"{os.path.basename(filename)}:{lineno} {linecache.getline(filename, lineno).strip()[:90]}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def _kernels(fn: Callable[[], Any]) -> collections.Counter:
    """The GPU kernels one call launches, by name (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")


def syncs(row: Row) -> None:
    """``--syncs``: where one call of the model and of its stages waits for the GPU, and the kernels
    each launches that the other does not (on the GPU, a small call's time is its launches)."""
    sharded = _sharded_on(row, "cuda")
    launched = {}
    with torch.enable_grad() if row.backward else torch.no_grad():
        for name, fn in _calls(row, sharded).items():
            fn()  # warm: first calls build caches
            found = _syncs(fn)
            launched[name] = _kernels(fn)
            print(f"{row.name}, k={row.stages}, {name}: {len(found)} synchronising operations, "
                  f"{sum(launched[name].values())} kernels"
                  + "".join(f"\n    {site}" for site in dict.fromkeys(found)), flush=True)
    for name in (name for name in ("sharded", "chained") if name in launched):
        more, fewer = launched[name] - launched["eager"], launched["eager"] - launched[name]
        for sign, kernels in (("+", more), ("-", fewer)):
            for kernel, count in kernels.most_common(6):
                print(f"    {name} {sign}{count} {kernel[:110]}")


# -- instruction counts (--instructions) ----------------------------------------------------------
_REQUESTS = """#include <valgrind/callgrind.h>
int running(void) { return RUNNING_ON_VALGRIND; }
void start(void) { CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void zero(void) { CALLGRIND_ZERO_STATS; }
void dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""

#: The callgrind requests (``_REQUESTS``) loaded in the run under valgrind; None when timing.
_COUNTER: Any = None
_ROUNDS = 3
_VARIANTS_COUNTED = ("eager", "sharded", "chained")


def _counted(row: Row, variants: dict[str, Callable[[], Any] | str], calls: int) -> dict[str, Any]:
    """Dump the instructions of ``calls`` calls of each variant, ``_ROUNDS`` times, each labelled
    ``row|variant|calls``; the run outside valgrind reads the dumps (``_read_counts``)."""
    counted = {name: variants[name] for name in _VARIANTS_COUNTED}
    regions = {"empty": lambda: None, **{name: fn for name, fn in counted.items() if callable(fn)}}
    _COUNTER.start()
    for fn in regions.values():  # the code is instrumented again from here: run it once first
        fn()
    for _ in range(_ROUNDS):
        for name, fn in regions.items():
            gc.collect()
            _COUNTER.zero()
            for _ in range(calls):
                fn()
            _COUNTER.dump(f"{row.name}|{name}|{calls}".encode())
    _COUNTER.stop()
    return {}


def _callgrind_requests(folder: str) -> str:
    """Build the few lines that start and dump callgrind's count from inside Python."""
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        sys.exit("--instructions needs valgrind and a C compiler (cc) on PATH")
    source, library = os.path.join(folder, "requests.c"), os.path.join(folder, "requests.so")
    with open(source, "w") as out:
        out.write(_REQUESTS)
    built = subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if built.returncode:
        sys.exit(f"--instructions could not build its callgrind requests (is valgrind's callgrind.h "
                 f"installed?):\n{built.stderr}")
    return library


def _count_instructions(argv: list[str]) -> None:
    """Run this script again under callgrind and print instructions per call from its dumps."""
    with tempfile.TemporaryDirectory() as folder:
        library = _callgrind_requests(folder)
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={os.path.join(folder, 'callgrind.out')}",
                   sys.executable, os.path.abspath(__file__), *argv]
        run = subprocess.run(command, env={**os.environ, _REQUESTS_ENV: library, "PYTHONHASHSEED": "0"},
                             capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"the run under valgrind failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
        counts = _read_counts(folder)
    print("| row | k | eager (instr) | sharded (instr) | chained (instr) | sharded / eager "
          "| added / stage call (instr) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, stages in _stage_counts(run.stdout):
        per = {name: statistics.median(counts[row, name]) - statistics.median(counts[row, "empty"])
               if (row, name) in counts else float("nan") for name in _VARIANTS_COUNTED}
        print(f"| {row} | {stages} | {per['eager']:.0f} | {per['sharded']:.0f} | {per['chained']:.0f} "
              f"| {per['sharded'] / per['eager']:.3f} | {(per['sharded'] - per['eager']) / stages:.0f} |")


def _read_counts(folder: str) -> dict[tuple[str, str], list[float]]:
    """Instructions per call by (row, variant), one per round, from callgrind's dumps."""
    counts: dict[tuple[str, str], list[float]] = {}
    for path in glob.glob(os.path.join(folder, "callgrind.out*")):
        with open(path) as dump:
            text = dump.read()
        label = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if label and total:
            row, variant, calls = label.group(1).split("|")
            counts.setdefault((row, variant), []).append(int(total.group(1)) / int(calls))
    return counts


def _stage_counts(stdout: str) -> list[tuple[str, int]]:
    """The rows the run under valgrind counted, with their k (it prints one line per row)."""
    return [(name, int(k)) for name, k in re.findall(r"^counted: (.+) \| (\d+)$", stdout, re.M)]


#: The environment variable that hands the run under valgrind the built requests.
_REQUESTS_ENV = "AUTOSHARD_CALLGRIND_REQUESTS"


def _same_gradients(model: nn.Module, eager: Callable[[], Any], sharded: Callable[[], Any]) -> bool | None:
    """Whether one forward + backward of the stages leaves every parameter the gradient the model's
    own leaves, bit for bit (None for a model whose computation differs between calls: dropout)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in model.modules()):
        return None
    grads = []
    for step in (eager, sharded):
        model.zero_grad(set_to_none=True)
        step()
        grads.append([p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(*grads))


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
    parser.add_argument("--syncs", action="store_true",
                        help="on the GPU, nothing timed: where one call of each variant waits for the GPU")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                        help="thread: CPU time of this thread, steadier on a loaded machine (not with --cuda)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per call under valgrind instead of timing (CPU; use with --only)")
    options = parser.parse_args()
    global _clock, _COUNTER
    if options.instructions and os.environ.get(_REQUESTS_ENV) is None:
        _count_instructions(sys.argv[1:])
        return
    if options.instructions:
        _COUNTER = ctypes.CDLL(os.environ[_REQUESTS_ENV])
        if not _COUNTER.running():
            sys.exit(f"{_REQUESTS_ENV} is set outside valgrind")
    _clock = _CLOCKS["wall" if options.cuda else options.clock]
    repeats = options.repeats or (3 if options.quick else 7)
    warnings.filterwarnings("ignore")  # pipeline()'s and transformers' notices would break the table
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if options.syncs:
        for row in _rows(options.only):
            syncs(row)
        return
    if not options.instructions:
        print("| row | k | eager (us) | sharded (us) | chained (us) | pipeline() (us) | sharded / eager "
              "| added / stage call (us) | bit-exact |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in _rows(options.only):
        r = measure(row, repeats, options.cuda)
        if options.instructions:
            print(f"counted: {row.name} | {row.stages}", flush=True)
            continue
        added = (r["sharded"] - r["eager"]) / r["k"]
        exact = "" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        print(f"| {r['row']} | {r['k']} | {_us(r['eager'])} | {_us(r['sharded'])} | {_us(r['chained'])} "
              f"| {_us(r['pipeline()'])} | {r['sharded'] / r['eager']:.3f} | {added * 1e6:.1f} | {exact} |",
              flush=True)


if __name__ == "__main__":
    main()
