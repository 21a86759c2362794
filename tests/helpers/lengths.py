"""A small causal language model that only the torch.export front end captures, its token
minibatches of any batch size and length, and plain single-process training to compare with.

`TinyLM` reads the batch size and the length from its input as GPT-2 does (positions sliced to
the length, heads by `view(batch, length, ...)`, a causal mask built in forward): fx cannot
trace the slice, and an export at one length alone would run at no other.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

import pdcompile
from pdcompile.passes.export_frontend import export_graph
from pdcompile.passes.split import manual_plan

VOCAB = 20
POSITIONS = 32  # the longest sequence TinyLM takes
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class TinyLM(nn.Module):
    """Embedding plus learned positions, one causal self-attention block, a vocabulary head."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, width)
        self.register_buffer("positions", torch.randn(POSITIONS, width) * 0.1)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        h = self.embed(ids) + self.positions[:length]
        q, k, v = self.qkv(h).view(batch, length, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        future = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, length, -1))
        return self.head(h + self.mlp(h))  # type: ignore[no-any-return]


def next_token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of (batch, length, vocabulary) logits."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def tokens(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A minibatch of token ids and its next-token target."""
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.roll(ids, -1, dims=1)


def stream(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One minibatch per (batch size, length), each drawn from its own seed."""
    return [tokens(batch, length, seed) for seed, (batch, length) in enumerate(shapes)]


def tiny_pipeline(*, schedule: str = "1f1b-flush", micro: int | None = 2,
                  stages: list[int] | None = None, sizes_cross: bool = False
                  ) -> pdcompile.pipeline.Pipeline:
    """TinyLM (seed 0) compiled at batch 4 and length 8: an even cut into `stages`, or
    (`sizes_cross`) two stages cut after the first Linear, so that the batch size and the
    length read from the input travel from stage 0 to stage 1 as numbers."""
    torch.manual_seed(0)
    ids, target = tokens(4, 8, 100)
    model = TinyLM()
    plan = None
    if sizes_cross:
        graph = export_graph(model, (ids,))
        nodes = [n for n in graph.graph.nodes if n.op not in ("output", "get_attr")]
        cut = next(i for i, n in enumerate(nodes) if "linear" in str(n.target))
        plan = manual_plan(graph, {n.name: int(i > cut) for i, n in enumerate(nodes)})
    return pdcompile.compile(model, example_inputs=(ids,), example_target=target,
                             loss_fn=next_token_loss, optimizer=SGD, schedule=schedule,
                             microbatches=micro, plan=plan,
                             stages=None if plan else stages or [1, 1], cost="analytic")


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: dict[str, Any],
               target: torch.Tensor, loss_fn: Any, micro: int) -> float:
    """One flush-schedule update in one process: the minibatch cut into `micro` microbatches
    (sizes differ by at most one), each loss counting equally; grads left on the parameters."""
    optimizer.zero_grad()
    parts = [{k: v.tensor_split(micro)[i] for k, v in inputs.items()} for i in range(micro)]
    losses = [loss_fn(model(**part), t) for part, t in zip(parts, target.tensor_split(micro),
                                                              strict=True)]
    loss = torch.stack(losses).mean()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


__all__ = ["POSITIONS", "SGD", "TinyLM", "VOCAB", "next_token_loss", "plain_step", "stream",
           "tiny_pipeline", "tokens"]
