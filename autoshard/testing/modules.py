"""Hypothesis strategies for random ``nn.Module``s whose dataflow is a random DAG.

Each DAG node becomes one block reading the sum of its predecessors' values (sources read the
model's first input). Blocks are linear layers, activations, and two kinds that ``torch.fx``
cannot trace: a module that branches on its input's values and a free function that does.
The capture must wrap those, so a splitter meets leaves and wrapped calls, not only clean
graphs. The model returns its ``output`` nodes (or its last node). Requires ``hypothesis`` and
``torch``.
"""

from __future__ import annotations

import networkx as nx
import torch
from hypothesis import strategies as st
from torch import nn

from autoshard.testing.strategies import dags, shaped_dags

WIDTH = 4


class Gate(nn.Module):
    """Data-dependent control flow: which linear runs depends on the input's sign."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) if x.sum() > 0 else self.down(x)


def clip_large(x: torch.Tensor) -> torch.Tensor:
    """A free function with data-dependent control flow (fx wraps the call)."""
    if x.abs().max() > 3:
        return x.clamp(-3, 3)
    return x * 2


class ClipLarge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clip_large(x)


BLOCKS = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "gate": Gate,
    "clip": ClipLarge,
}


class DagNet(nn.Module):
    """Runs ``blocks[i]`` on the sum of the values ``reads[i]`` names (0 = the input x)."""

    def __init__(self, blocks: list[nn.Module], reads: list[tuple[int, ...]], outputs: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.reads = reads
        self.outputs = outputs

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        values = [x + y]
        for block, reads in zip(self.blocks, self.reads):
            h = values[reads[0]]
            for r in reads[1:]:
                h = h + values[r]
            values.append(block(h))
        picked = tuple(values[i] for i in self.outputs)
        return picked[0] if len(picked) == 1 else picked


def module_from_dag(dag: nx.DiGraph, kinds: list[str]) -> DagNet:
    """A ``DagNet`` with one block per non-input node of ``dag``, ``kinds[i]`` for the i-th."""
    computed = [v for v in dag.nodes if not dag.nodes[v].get("input", False)]
    slot = {v: i + 1 for i, v in enumerate(computed)}
    reads = [tuple(sorted(slot.get(p, 0) for p in dag.predecessors(v))) or (0,) for v in computed]
    outputs = tuple(slot[v] for v in computed if dag.nodes[v].get("output", False)) or (len(computed),)
    return DagNet([BLOCKS[kind]() for kind in kinds], reads, outputs)


@st.composite
def dag_modules(draw: st.DrawFn, max_blocks: int = 6) -> tuple[DagNet, tuple[torch.Tensor, torch.Tensor]]:
    """A random ``DagNet`` (chains, diamonds, skips, fan-out/in, wrapped blocks) and its inputs."""
    graphs = shaped_dags(max_nodes=max_blocks) | dags(max_nodes=max_blocks)
    dag = draw(graphs)
    count = sum(1 for v in dag.nodes if not dag.nodes[v].get("input", False))
    kinds = draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=count, max_size=count))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = module_from_dag(dag, kinds).eval()
    x = torch.randn(2, WIDTH) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    return model, (x, torch.randn(2, WIDTH))
