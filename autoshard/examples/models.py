"""Small models that show what autoshard handles: control flow, transformers, skips."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BranchedBlock(nn.Module):
    """Two linears; which one runs depends on the input's values (data-dependent control flow)."""

    def __init__(self, width: int = 10) -> None:
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) if x.sum() > 1000 else self.right(x)


class BranchedNetwork(nn.Module):
    """Ten branched blocks looped over: untraceable as a whole, splittable block by block."""

    def __init__(self, num_blocks: int = 10, width: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BranchedBlock(width) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class PositionalEncoding(nn.Module):
    """Sinusoidal positions held in a buffer, added to the input, then dropout."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 512) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(0)])


class TransformerLM(nn.Module):
    """The PyTorch word-language-model transformer: embedding, encoder stack, decoder."""

    def __init__(
        self, ntoken: int = 100, ninp: int = 32, nhead: int = 2, nhid: int = 64,
        nlayers: int = 4, dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.ninp = ninp
        self.encoder = nn.Embedding(ntoken, ninp)
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.decoder = nn.Linear(ninp, ntoken)

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        src = self.encoder(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, src_mask)
        return self.decoder(output)


class ResidualMLP(nn.Module):
    """``x = linear(x) + x`` repeated: every block's input skips over it."""

    def __init__(self, num_blocks: int = 8, width: int = 16) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = linear(x) + x
        return x


class LongSkip(nn.Module):
    """The input is added to the output of a deep stack: one value crosses every cut."""

    def __init__(self, depth: int = 8, width: int = 16) -> None:
        super().__init__()
        self.stack = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack(x) + x


class GPTBlock(nn.Module):
    """A GPT-2 block: causal self-attention and an MLP, each after a LayerNorm, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPTStyleLM(nn.Module):
    """A GPT-2-style causal LM of any size, the LM head tied to the token embedding by default.

    Without data-dependent control flow, so it can be planned on the ``meta`` device at full size.
    The embeddings start small, as GPT-2's do, so the tied head's first logits are near zero and
    the first loss near ``log(vocab)``.
    """

    def __init__(self, vocab: int = 100, width: int = 32, layers: int = 2, heads: int = 2,
                 max_seq: int = 64, tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(max_seq, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        for embedding in (self.wte, self.wpe):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTStyleLMWithLoss(GPTStyleLM):
    """The same LM (same parameters, same checkpoint keys) whose forward also takes ``targets``,
    the token to predict at each position, and returns the mean cross-entropy, as Hugging Face
    models do given ``labels``. The loss is then part of the plan: every cost model sees the last
    stage's whole work, and a pipeline's last stage returns the loss itself.
    """

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(idx).flatten(0, 1), targets.flatten())


def causal_mask(size: int) -> torch.Tensor:
    """The square subsequent mask the word-language-model example feeds its encoder."""
    return torch.triu(torch.full((size, size), float("-inf")), diagonal=1)
