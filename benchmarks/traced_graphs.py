"""Traced models as the splitter sees them under ``shard_model``, for the splitter benchmarks.

Each model is captured, shape-propagated with its example inputs, turned into the DAG and
ordered by the default pipeline's own passes (``capture,shape-prop,build-dag,linearize``), so
every value's ``bytes`` is its true size; ``cost`` is parameter bytes, what ``cost="params"``
(the default) balances. Models: the built-in examples, and a few real families with more
layers than the test zoo's (Hugging Face GPT-2, BERT and Llama with tiny widths, random
weights, nothing downloaded) plus a torchvision-free ResNet of bottleneck blocks.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from typing import Any, Callable  # noqa: E402

import networkx as nx  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from autoshard.api import run_pipeline  # noqa: E402
from autoshard.costs.models import param_costs  # noqa: E402
from autoshard.passes import Pipeline  # noqa: E402
from autoshard.passes.base import ExampleInputs  # noqa: E402
from autoshard.costs.split_search import weighted_in_order  # noqa: E402

#: The passes ``shard_model`` runs before its split, with example inputs.
BEFORE_SPLIT = "capture,shape-prop,build-dag,linearize"
VOCAB, BATCH, SEQ = 1000, 2, 32


class Bottleneck(nn.Module):
    """A ResNet bottleneck block: 1x1, 3x3, 1x1 convolutions with batch norm, plus the skip."""

    def __init__(self, width: int, inner: int, stride: int = 1, project: bool = False) -> None:
        super().__init__()
        out = inner * 4
        self.conv1, self.bn1 = nn.Conv2d(width, inner, 1, bias=False), nn.BatchNorm2d(inner)
        self.conv2, self.bn2 = nn.Conv2d(inner, inner, 3, stride, 1, bias=False), nn.BatchNorm2d(inner)
        self.conv3, self.bn3 = nn.Conv2d(inner, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = (nn.Sequential(nn.Conv2d(width, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if project else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return torch.relu(h + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50's layout (3, 4, 6, 3 bottleneck blocks) at a quarter of its widths."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 16, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, width = [], base
        for i, count in enumerate(blocks):
            inner = base * 2**i
            for b in range(count):
                layers.append(Bottleneck(width, inner, stride=2 if b == 0 and i else 1, project=b == 0))
                width = inner * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _text() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, : SEQ // 4] = 0
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator), "attention_mask": mask}


def _transformers() -> dict[str, Callable[[], tuple[nn.Module, ExampleInputs]]]:
    import transformers

    return {
        "gpt2-12 (HF)": lambda: (transformers.GPT2Model(transformers.GPT2Config(
            n_layer=12, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB)),
            ExampleInputs((), {**_text(), "use_cache": False})),
        "bert-6 (HF)": lambda: (transformers.BertModel(transformers.BertConfig(
            num_hidden_layers=6, hidden_size=64, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=64, vocab_size=VOCAB)), ExampleInputs((), _text())),
        "llama-8 (HF)": lambda: (transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=192, max_position_embeddings=64, vocab_size=VOCAB)),
            ExampleInputs((), {**_text(), "use_cache": False})),
    }


def models() -> dict[str, Callable[[], tuple[nn.Module, ExampleInputs]]]:
    """Benchmark name -> factory of (model, example inputs)."""
    from autoshard.examples import EXAMPLES, load_example

    def example(name: str) -> Callable[[], tuple[nn.Module, ExampleInputs]]:
        def build() -> tuple[nn.Module, ExampleInputs]:
            model, args, kwargs = load_example(name)
            return model, ExampleInputs(tuple(args), dict(kwargs or {}))
        return build

    table = {f"example {name}": example(name) for name in EXAMPLES}
    table["resnet-50/4 (conv)"] = lambda: (ResNet(), ExampleInputs((torch.randn(BATCH, 3, 64, 64),), {}))
    table.update(_transformers())
    return table


def traced_graph(model: nn.Module, inputs: ExampleInputs) -> nx.DiGraph:
    """The DAG ``split`` receives from ``shard_model(model, k, ...)``: true value bytes, parameter-byte costs."""
    torch.manual_seed(0)
    program = run_pipeline(model.eval(), Pipeline.parse(BEFORE_SPLIT), inputs).program
    return weighted_in_order(program.dag, program.order, param_costs(program.dag))


def traced_graphs() -> dict[str, nx.DiGraph]:
    graphs = {}
    for name, build in models().items():
        torch.manual_seed(0)
        graphs[name] = traced_graph(*build())
    return graphs
