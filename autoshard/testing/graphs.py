"""Seeded synthetic workload graphs shaped like real models, for benchmarks and scale tests.

Each generator returns a graph that satisfies the splitter's contract, with roughly ``n``
nodes, ``cost`` modelled on parameter bytes and ``bytes`` on activation sizes. The shapes are
the ones that make splitting hard: residual skips (ResNet), values read by every layer (the
attention mask and rotary tables of a transformer) and long skips with heavy-tailed costs.
The same ``(n, seed)`` always gives the same graph. networkx only, no torch.
"""

from __future__ import annotations

import random
from typing import Callable

import networkx as nx


class _Builder:
    """Appends nodes in program order and wires each to the values it reads."""

    def __init__(self) -> None:
        self.dag = nx.DiGraph()

    def input(self, name: str, nbytes: float) -> str:
        self.dag.add_node(name, cost=0.0, bytes=float(nbytes), input=True)
        return name

    def op(self, name: str, reads: list[str], cost: float, nbytes: float) -> str:
        self.dag.add_node(name, cost=float(cost), bytes=float(nbytes))
        self.dag.add_edges_from((r, name) for r in reads)
        return name

    def finish(self, last: str) -> nx.DiGraph:
        self.dag.nodes[last]["output"] = True
        return self.dag


def chain_graph(n: int, seed: int = 0) -> nx.DiGraph:
    """A path of ``n`` layers with log-normal costs and activation sizes."""
    rng, b = random.Random(seed), _Builder()
    prev = b.input("x", 1024)
    for i in range(n - 1):
        prev = b.op(f"l{i}", [prev], rng.lognormvariate(10, 1), rng.choice([512, 1024, 4096]))
    return b.finish(prev)


def resnet_graph(n: int, seed: int = 0) -> nx.DiGraph:
    """Bottleneck residual blocks in four stages; each stage's first block has a downsample branch.

    Activations shrink 4x in size per stage while convolution weights grow 4x, as in ResNet.
    """
    rng, b = random.Random(seed), _Builder()
    x = b.op("stem", [b.input("img", 3 * 224 * 224 * 4)], 9408 * 4, 64 * 112 * 112 * 4)
    blocks = max(4, (n - 2) // 9)
    for i in range(blocks):
        stage = min(3, 4 * i // blocks)
        act, weight = 256 * 56 * 56 * 4 / 2**stage, 70_000 * 4.0 * 4**stage
        first = i == 0 or stage != min(3, 4 * (i - 1) // blocks)
        h = x
        for c, part in enumerate(("conv1", "bn1", "relu1", "conv2", "bn2", "relu2", "conv3")):
            conv = part.startswith("conv")
            cost = weight * rng.uniform(0.8, 1.2) if conv else (weight / 100 if part.startswith("bn") else 0.0)
            h = b.op(f"b{i}.{part}", [h], cost, act / (4 if c < 6 else 1))
        skip = b.op(f"b{i}.down", [x], weight / 2, act) if first else x
        x = b.op(f"b{i}.add", [h, skip], 0.0, act)
    return b.finish(b.op("fc", [b.op("pool", [x], 0.0, 8192)], 2048 * 1000 * 4, 4000))


def transformer_graph(n: int, seed: int = 0, seq: int = 2048, width: int = 4096) -> nx.DiGraph:
    """Decoder layers that all read one causal mask and the rotary cos/sin tables.

    Those three values are live across every boundary, so they cost the same wherever the cuts
    fall; the attention scores (seq x seq) are the values a cut must avoid.
    """
    rng, b = random.Random(seed), _Builder()
    act, layer_w = seq * width * 2.0, 12 * width * width * 2.0
    h = b.op("embed", [b.input("tokens", seq * 8)], 32000 * width * 2, act)
    mask = b.op("mask", [b.input("positions", seq * 8)], 0.0, seq * seq)
    cos = b.op("rotary.cos", ["positions"], 0.0, seq * width)
    sin = b.op("rotary.sin", ["positions"], 0.0, seq * width)
    for i in range(max(1, (n - 7) // 16)):
        w = layer_w * rng.uniform(0.9, 1.1)
        p = f"layer{i}."
        ln = b.op(p + "ln1", [h], width * 2, act)
        q = b.op(p + "q", [ln], w / 6, act)
        k = b.op(p + "k", [ln], w / 6, act)
        v = b.op(p + "v", [ln], w / 6, act)
        q = b.op(p + "q_rot", [q, cos, sin], 0.0, act)
        k = b.op(p + "k_rot", [k, cos, sin], 0.0, act)
        scores = b.op(p + "scores", [q, k, mask], 0.0, 32 * seq * seq * 2)
        probs = b.op(p + "softmax", [scores], 0.0, 32 * seq * seq * 2)
        attn = b.op(p + "attn", [probs, v], 0.0, act)
        h = b.op(p + "add1", [b.op(p + "o", [attn], w / 6, act), h], 0.0, act)
        up = b.op(p + "up", [b.op(p + "ln2", [h], width * 2, act)], w / 6, 4 * act)
        down = b.op(p + "down", [b.op(p + "act", [up], 0.0, 4 * act)], w / 6, act)
        h = b.op(p + "add2", [down, h], 0.0, act)
    return b.finish(b.op("lm_head", [b.op("ln_f", [h], width * 2, act)], 32000 * width * 2, seq * 32000 * 2))


def layered_graph(n: int, seed: int = 0, width: int = 4, skip_rate: float = 0.15) -> nx.DiGraph:
    """Random layers of ``width`` nodes: edges from the previous layer plus long skips.

    Costs are Pareto-distributed (a few nodes dominate) and a tenth of the nodes cost nothing;
    skips reach back up to a quarter of the graph, so values stay live across many cuts.
    """
    rng, b = random.Random(seed), _Builder()
    layers = [[b.input("x", 4096)]]
    count = 0
    while count < n - 1:
        layer = []
        for _ in range(min(width, n - 1 - count)):
            name = f"n{count}"
            reads = rng.sample(layers[-1], min(len(layers[-1]), rng.randint(1, 2)))
            if rng.random() < skip_rate and len(layers) > 2:
                back = rng.randint(2, max(2, min(len(layers) - 1, n // (4 * width))))
                reads.append(rng.choice(layers[-back]))
            cost = 0.0 if rng.random() < 0.1 else 1000 * rng.paretovariate(1.5)
            layer.append(b.op(name, sorted(set(reads)), cost, rng.choice([256, 1024, 4096, 65536])))
            count += 1
        layers.append(layer)
    last = b.op("out", layers[-1], 0.0, 4096)
    return b.finish(last)


#: The synthetic workloads by name: ``GRAPHS[kind](n, seed)``.
GRAPHS: dict[str, Callable[..., nx.DiGraph]] = {
    "chain": chain_graph,
    "resnet": resnet_graph,
    "transformer": transformer_graph,
    "layered": layered_graph,
}
