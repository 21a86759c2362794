"""Sequence-first models, fed (seq, batch, ...) as torch.nn takes them without batch_first: a
small `nn.TransformerEncoder` language model and an `nn.LSTM` regressor, their minibatches and
one process's training, cut along the batch dimension 1 (the batch-dimension tests, local and on
gloo)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQ, VOCAB, WIDTH, FEATURES = 5, 11, 8, 3


class SeqFirstLM(nn.Module):
    """Tokens (seq, batch) -> logits (seq, batch, vocab) through a 2-layer encoder at its
    default batch_first=False: attention mixes the positions of a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        with warnings.catch_warnings():  # nested tensors need batch_first: not this model's
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0), 2)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (seq, batch, vocab) logits against (seq, batch) tokens."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


class SeqFirstLSTM(nn.Module):
    """Features (seq, batch, FEATURES) -> (seq, batch, FEATURES) through a 2-layer LSTM without
    batch_first: the recurrence runs along dimension 0."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, num_layers=2)
        self.out = nn.Linear(WIDTH, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(torch.tanh(self.inp(x)))
        return self.out(y)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]] = {
    "transformer": (SeqFirstLM, lm_loss),
    "lstm": (SeqFirstLSTM, F.mse_loss),
}


def fresh(name: str) -> nn.Module:
    """Model `name` with fixed initial weights, in float64."""
    torch.manual_seed(0)
    return MODELS[name][0]().double()


def minibatches(name: str, batch: int, steps: int, seed: int = 3
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` minibatches (input, target), the batch along dimension 1."""
    gen = torch.Generator().manual_seed(seed)
    if name == "transformer":
        return [(torch.randint(0, VOCAB, (SEQ, batch), generator=gen),
                 torch.randint(0, VOCAB, (SEQ, batch), generator=gen)) for _ in range(steps)]
    return [(torch.randn(SEQ, batch, FEATURES, generator=gen, dtype=torch.float64),
             torch.randn(SEQ, batch, FEATURES, generator=gen, dtype=torch.float64))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def one_process(name: str, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], parts: int
                ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's training of a fresh model `name`: per minibatch, gradients accumulated over
    `parts` pieces cut along dimension 1 (each loss over `parts`), one SGD update; each
    minibatch's loss and the final weights."""
    model = fresh(name)
    loss_fn = MODELS[name][1]
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.tensor_split(parts, dim=1), y.tensor_split(parts, dim=1),
                          strict=True):
            loss = loss_fn(model(xs), ys) / parts
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
