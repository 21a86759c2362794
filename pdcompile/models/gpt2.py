"""A GPT-2-style decoder-only transformer (Radford et al., 2019): pre-norm blocks of causal
self-attention and a GELU MLP, learned position embeddings, output head tied to the token
embedding (one parameter used by two nodes).

Small by default; `factory(size="xl", device="meta")` builds GPT-2 XL (48 layers, d=1600,
25 heads, vocab 50257, context 1024) without allocating its 1.5 billion weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# size -> (layers, embedding width, heads, vocabulary, context)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 64, 4, 1000, 64),
    "small": (4, 128, 4, 4096, 128),
    "gpt2": (12, 768, 12, 50257, 1024),
    "medium": (24, 1024, 16, 50257, 1024),
    "large": (36, 1280, 20, 50257, 1024),
    "xl": (48, 1600, 25, 50257, 1024),
}


class CausalSelfAttention(nn.Module):
    """Multi-head attention written out (so its matmuls are visible operations) with a causal
    mask built from the sequence length."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"embedding width {d} is not divisible by {heads} heads")
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size()
        q, k, v = self.c_attn(x).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones_like(scores[0, 0], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = self.dropout(torch.softmax(scores, dim=-1)) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU(approximate="tanh")
        self.mlp_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x)))))


class GPT2(nn.Module):
    """forward(idx: (batch, length) token ids) -> logits (batch, length, vocab)."""

    def __init__(self, *, layers: int, d: int, heads: int, vocab_size: int, context: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two users

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def factory(*, size: str = "tiny", layers: int | None = None, d: int | None = None,
            heads: int | None = None, vocab_size: int | None = None, seq_len: int | None = None,
            batch_size: int = 4, dropout: float = 0.1, device: str | torch.device = "cpu"
            ) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (token ids,)); `size` picks a row of SIZES, the other options override it.
    On device="meta" nothing is allocated (shape and analytic cost passes work on it)."""
    if size not in SIZES:
        raise ValueError(f"unknown GPT-2 size {size!r}; sizes are {', '.join(SIZES)}")
    n_layer, n_embd, n_head, n_vocab, n_ctx = SIZES[size]
    default_seq = min(n_ctx, 32) if size in ("tiny", "small") else n_ctx
    seq = seq_len or default_seq
    context = max(n_ctx, seq)
    with torch.device(device):
        model = GPT2(layers=layers or n_layer, d=d or n_embd, heads=heads or n_head,
                     vocab_size=vocab_size or n_vocab, context=context, dropout=dropout)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab_size or n_vocab, (batch_size, seq), generator=generator)
    return model, (idx.to(device),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def make_target(example_inputs: tuple[Any, ...], *, vocab_size: int = 1000) -> torch.Tensor:
    """The input shifted left by one (the next token), last position wrapping to the first."""
    idx = example_inputs[0]
    return torch.roll(idx, shifts=-1, dims=1) % vocab_size
