"""Re-specialisation on the Hugging Face decoders: what a new capture costs and what a cached one adds.

    python benchmarks/specialize.py            # every decoder family of the zoo, a few minutes
    python benchmarks/specialize.py --quick    # GPT-2 only (and the dispatch row)
    python benchmarks/specialize.py --arguments  # other arguments than the example's, every zoo family

Each family (``tests/test_real_models_zoo.py``) is sharded into 2 stages at batch 2 x 8, then
called at batch 1 and 3, sequence 1 and 5 (and 1 x 1), each compared with the model (exact:
every output tensor equal). Per family: how many calls needed a new capture, the wall time of each
(first call), whether every weight stayed in its stage, and per-call times under no_grad (best of
``REPEATS``, torch on one thread) of the model, of the first plan on the example's shape, and of a
cached specialisation on a shape that needed one: the dispatch a cached specialisation adds is its
time against the first plan's at the same work. A last row times that dispatch on a model small
enough for microseconds to show (an 8-layer MLP with a size branch, k = 4).

``--arguments``: each family sharded into k = 2 and 3 stages on its example, then called under
no_grad with what its example left out, in this order: the attention mask left out,
``output_hidden_states=True`` (after which transformers keeps output-recording forward hooks on the
layers), ``return_dict=False``, and ``labels=`` where the forward takes them, each compared with the
model's own call: exact, refused (the error's type) or not applicable.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_real_models_zoo import BY_NAME, EXAMPLE  # noqa: E402  (sets HF offline first)

import autoshard  # noqa: E402
from autoshard.specialize import holders, shape_key  # noqa: E402

DECODERS = ("gpt2", "llama", "opt", "mistral", "qwen2", "gpt-neox", "mixtral")
CALLS = ((1, 8), (3, 8), (2, 1), (2, 5), (1, 1))
REPEATS = 30


def best_time(fn, repeats: int = REPEATS) -> float:
    """Best wall time of ``fn()`` in microseconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def equal(a, b) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def run(name: str) -> dict:
    family = BY_NAME[name]
    model = family.build()
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE))
    before = holders(sharded)
    exact = 0
    with torch.no_grad():
        for shape in CALLS:
            inputs = family.inputs(*shape)
            exact += equal(sharded(**inputs), model(**inputs))
        made = sharded.specializations
        example = family.inputs(*EXAMPLE)
        made_for = {m.shapes for m in made}
        new_shape = next((s for s in CALLS if shape_key((), family.inputs(*s)) in made_for), None)
        times = {"model": best_time(lambda: model(**example)), "first plan": best_time(lambda: sharded(**example))}
        if new_shape is not None:
            later = family.inputs(*new_shape)
            times["model (new shape)"] = best_time(lambda: model(**later))
            times["cached specialisation"] = best_time(lambda: sharded(**later))
    return {"name": name, "exact": exact, "made": made, "same": all(holders(m.sharded) == before for m in made),
            "times": times, "new_shape": new_shape}


class BranchingMLP(torch.nn.Module):
    """Eight small layers with a Python ``if`` on the batch size: the model's own work is a few
    tens of microseconds, so what the dispatch adds shows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i == 3 and x.shape[0] > 2:
                x = x * 2
        return x


def dispatch_row() -> dict[str, float]:
    """Per-call overhead (sharded - eager, k = 4) on the example's shape (the first plan) and on a
    shape a specialisation serves (batch 2: the branch flips), best of many interleaved repeats."""
    torch.manual_seed(0)
    model = BranchingMLP().eval()
    example, later = torch.randn(4, 64), torch.randn(2, 64)
    sharded = autoshard.shard_model(model, 4, (example,))
    with torch.no_grad():
        sharded(later)
        assert len(sharded.specializations) == 1 and torch.equal(sharded(later), model(later))
        calls = {"eager, example": lambda: model(example), "first plan": lambda: sharded(example),
                 "eager, later": lambda: model(later), "cached specialisation": lambda: sharded(later)}
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(REPEATS):
            for name, call in calls.items():
                best[name] = min(best[name], best_time(lambda: [call() for _ in range(100)], 1) / 100)
    return best


def refusal_row() -> tuple[float, float]:
    """The first call no capture serves (GPT-2 asked for its generation cache: the capture runs and its
    verification refuses), and the best of the same call made again with the model unchanged, which is
    refused without capturing again: seconds, then microseconds."""
    family = BY_NAME["gpt2"]
    model = family.build()
    sharded = autoshard.shard_model(model, 2, example_kwargs=family.inputs(*EXAMPLE))
    call = {**family.inputs(*EXAMPLE), "use_cache": True}

    def refused() -> None:
        try:
            sharded(**call)
        except autoshard.InputMismatchError:
            return
        raise AssertionError("a call asking for the generation cache was served")

    with torch.no_grad():
        start = time.perf_counter()
        refused()
        first = time.perf_counter() - start
        return first, best_time(refused)


ARGUMENT_FAMILIES = ("gpt2", "opt", "mistral", "qwen2", "gpt-neox", "llama", "mixtral", "bert", "distilbert", "t5",
                     "vit", "segformer", "swin", "whisper-encoder")


def argument_calls(name: str, k: int) -> dict[str, str]:
    """What a plan made on ``name``'s example does with each call of other arguments (see the doc)."""
    family = BY_NAME[name]
    model = family.build().eval()
    example = family.inputs(*EXAMPLE)
    sharded = autoshard.shard_model(model, k, example_kwargs=example)
    takes = inspect.signature(model.forward).parameters
    ids = example.get("input_ids")
    calls = {"mask left out": {key: v for key, v in example.items() if key != "attention_mask"}
             if "attention_mask" in example else None,
             "hidden states": {**example, "output_hidden_states": True},
             "tuple out": {**example, "return_dict": False},  # transformers 5 takes it among **kwargs
             "labels": {**example, "labels": ids} if "labels" in takes and ids is not None else None}
    found = {}
    with torch.no_grad():
        for call, inputs in calls.items():
            if inputs is None:
                found[call] = "-"
                continue
            try:
                got = sharded(**inputs)
            except Exception as failure:  # noqa: BLE001 - the table says what each call met
                found[call] = f"refused ({type(failure).__name__})"
                continue
            found[call] = "exact" if equal(got, model(**inputs)) else "DIFFERS"
    return found


def arguments_table() -> None:
    table = Table(title=f"other arguments: planned at {EXAMPLE[0]} x {EXAMPLE[1]} on the example's arguments")
    columns = ("mask left out", "hidden states", "tuple out", "labels")
    for column in ("model", "k", *columns):
        table.add_column(column)
    for name in ARGUMENT_FAMILIES:
        for k in (2, 3):
            found = argument_calls(name, k)
            table.add_row(name, str(k), *(found[c] for c in columns))
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 only")
    parser.add_argument("--arguments", action="store_true", help="calls with other arguments, every zoo family")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.arguments:
        arguments_table()
        return
    table = Table(title=f"re-specialisation: k = 2, planned at {EXAMPLE[0]} x {EXAMPLE[1]}, "
                        f"called at {', '.join(f'{b} x {s}' for b, s in CALLS)}")
    for column in ("model", "exact", "new captures (s)", "weights kept", "model µs", "first plan µs",
                   "new shape: model µs", "cached specialisation µs"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name in (("gpt2",) if args.quick else DECODERS):
        row = run(name)
        times = row["times"]
        table.add_row(
            name, f"{row['exact']}/{len(CALLS)}",
            ", ".join(f"{m.seconds:.1f}" for m in row["made"]) or "none",
            "yes" if row["same"] else "NO",
            f"{times['model']:.0f}", f"{times['first plan']:.0f}",
            f"{times.get('model (new shape)', float('nan')):.0f}",
            f"{times.get('cached specialisation', float('nan')):.0f}",
        )
    Console(width=160).print(table)
    best = dispatch_row()
    first, cached = best["first plan"] - best["eager, example"], best["cached specialisation"] - best["eager, later"]
    print(f"8-layer MLP with a size branch, k = 4, per call (best of {REPEATS} x 100 calls): eager "
          f"{best['eager, example']:.1f} µs, first plan {best['first plan']:.1f} µs (+{first:.1f}); batch 2, served by "
          f"its specialisation: eager {best['eager, later']:.1f} µs, sharded {best['cached specialisation']:.1f} µs "
          f"(+{cached:.1f}); the specialisation's dispatch adds {cached - first:+.1f} µs per call, "
          f"{(cached - first) / 4:+.1f} µs per stage call")
    first_refusal, again = refusal_row()
    print(f"GPT-2 called with use_cache=True (no capture serves it): refused in {first_refusal:.2f} s the first time, "
          f"{again:.0f} µs each time again (best of {REPEATS}; the model unchanged)")


if __name__ == "__main__":
    main()
