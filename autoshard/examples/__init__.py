"""Built-in example models, each a factory returning ``(model, example_args, example_kwargs)``.

They make the README's main command and the CLI tests need nothing outside the package.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from autoshard.errors import InvalidArgumentError
from autoshard.examples.models import (
    BranchedNetwork,
    GPTStyleLM,
    GPTStyleLMWithLoss,
    LongSkip,
    ResidualMLP,
    TransformerLM,
    causal_mask,
)

Example = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]


def branched() -> Example:
    torch.manual_seed(0)
    return BranchedNetwork(), (torch.randn(4, 10),), {}


def transformer_lm() -> Example:
    torch.manual_seed(0)
    model = TransformerLM().eval()
    seq_len, batch = 12, 3
    src = torch.randint(0, 100, (seq_len, batch))
    return model, (src, causal_mask(seq_len)), {}


def residual_mlp() -> Example:
    torch.manual_seed(0)
    return ResidualMLP(), (torch.randn(4, 16),), {}


def gpt_lm() -> Example:
    torch.manual_seed(0)
    return GPTStyleLM(layers=4).eval(), (torch.randint(0, 100, (2, 16)),), {}


def long_skip() -> Example:
    torch.manual_seed(0)
    return LongSkip(), (torch.randn(4, 16),), {}


EXAMPLES: dict[str, tuple[Callable[[], Example], str]] = {
    "branched": (branched, "10 blocks with data-dependent `if x.sum() > 1000` branches"),
    "transformer-lm": (transformer_lm, "embedding, positional encoding, 4-layer nn.TransformerEncoder, decoder"),
    "residual-mlp": (residual_mlp, "8 blocks of x = linear(x) + x"),
    "long-skip": (long_skip, "the input added to the output of 8 stacked linears"),
    "gpt-lm": (gpt_lm, "GPT-2-style LM, 4 blocks, LM head tied to the token embedding"),
}


def load_example(name: str) -> Example:
    """Build a built-in example by name."""
    try:
        factory, _ = EXAMPLES[name]
    except KeyError:
        known = ", ".join(sorted(EXAMPLES))
        raise InvalidArgumentError(f"no built-in example named {name!r}; known examples: {known}") from None
    return factory()


__all__ = [
    "EXAMPLES", "load_example", "BranchedNetwork", "GPTStyleLM", "GPTStyleLMWithLoss", "TransformerLM",
    "ResidualMLP", "LongSkip",
]
