"""A GNMT-like LSTM encoder-decoder (Wu et al., 2016): a bidirectional first encoder layer,
stacked LSTMs with residual connections from the third layer on, and dot-product attention
from the first decoder layer's output over the encoder states, fed to every later layer.

The LSTMs stay whole (fx leaves), as in PipeDream's GNMT profile. Inputs: source and target
token ids (teacher forcing), both (batch, length).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Encoder(nn.Module):
    """Embedding, bidirectional LSTM, then `layers - 1` unidirectional LSTMs."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.bidir = nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True)
        self.rnns = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True)
                                  for _ in range(layers - 1))
        self.dropout = nn.Dropout(dropout)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        x, _ = self.bidir(self.dropout(self.embedding(src)))
        for i, rnn in enumerate(self.rnns):
            y, _ = rnn(self.dropout(x))
            x = y + x if i >= 1 else y  # residual from the third layer on
        return x


class Attention(nn.Module):
    """Scaled dot-product attention of queries over keys (the encoder states)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.scale = hidden ** -0.5

    def forward(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        scores = torch.bmm(self.query(q), keys.transpose(1, 2)) * self.scale
        return torch.bmm(torch.softmax(scores, dim=-1), keys)


class Decoder(nn.Module):
    """Embedding, first LSTM, attention, then LSTMs over [state; context], classifier."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.first = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = Attention(hidden)
        self.rnns = nn.ModuleList(nn.LSTM(2 * hidden, hidden, batch_first=True)
                                  for _ in range(layers - 1))
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, vocab_size)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x, _ = self.first(self.dropout(self.embedding(tgt)))
        context = self.attention(x, memory)
        for i, rnn in enumerate(self.rnns):
            y, _ = rnn(self.dropout(torch.cat([x, context], dim=-1)))
            x = y + x if i >= 1 else y
        return self.classifier(x)


class GNMT(nn.Module):
    """Encoder-decoder; forward(src, tgt) -> logits (batch, tgt length, vocab)."""

    def __init__(self, *, vocab_size: int = 1000, hidden: int = 128, layers: int = 4,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.encoder = Encoder(vocab_size, hidden, layers, dropout)
        self.decoder = Decoder(vocab_size, hidden, layers, dropout)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.decoder(tgt, self.encoder(src))


def factory(*, batch_size: int = 8, src_len: int = 16, tgt_len: int = 16, vocab_size: int = 1000,
            hidden: int = 128, layers: int = 4, device: str | torch.device = "cpu"
            ) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """(model, (src, tgt)); hidden=1024, layers=4 (8 for GNMT-16), vocab 32000 is the paper's."""
    with torch.device(device):
        model = GNMT(vocab_size=vocab_size, hidden=hidden, layers=layers)
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(0, vocab_size, (batch_size, src_len), generator=generator)
    tgt = torch.randint(0, vocab_size, (batch_size, tgt_len), generator=generator)
    return model, (src.to(device), tgt.to(device))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def make_target(example_inputs: tuple[Any, ...], *, vocab_size: int = 1000) -> torch.Tensor:
    """Random next tokens shaped like the target input."""
    tgt = example_inputs[1]
    return torch.randint(0, vocab_size, tuple(tgt.shape), device=tgt.device)
