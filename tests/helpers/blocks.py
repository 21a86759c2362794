"""A chain of small Linear+Tanh blocks compiled with one stage per group of blocks: the pipeline
the asynchronous-schedule tests train, and the minibatches they train it on."""

from __future__ import annotations

import torch
import torch.nn as nn

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace

BLOCKS = 4
mse = nn.functional.mse_loss


def make_model() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers.append(nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
    layers.append(nn.Linear(6, 3))
    return nn.Sequential(*layers)


def block_of(name: str) -> int:
    """Block index of a parameter or module name ("2.0.weight", "2.0")."""
    return min(int(name.split(".")[0]), BLOCKS - 1)


def stage_of_block(block: int, stages: int) -> int:
    return block * stages // BLOCKS


def build(model: nn.Module, stages: int, replicas: list[int] | None, **options: object
          ) -> pdcompile.pipeline.Pipeline:
    gm = trace(model)

    def assign(node: torch.fx.Node) -> int:
        if node.op == "placeholder":
            return 0
        return stage_of_block(block_of(str(node.target)), stages)

    plan = manual_plan(gm, assign, replicas=replicas)
    return pdcompile.compile(model, example_inputs=(torch.randn(4, 6),), loss_fn=mse,
                             plan=plan, **options)  # type: ignore[arg-type]


def batches(n: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g))
            for _ in range(n)]


def update_after_round(pending: list[dict[str, torch.Tensor]], live: dict[str, torch.Tensor],
                       opt: torch.optim.Optimizer, history: list[dict[str, torch.Tensor]],
                       size: int) -> list[dict[str, torch.Tensor]]:
    """One stage of a PipeDream reference: once `size` minibatches' gradients are `pending`,
    their mean is the gradient of one optimizer step, whose weights become the next version in
    `history`; the gradients still pending after it."""
    if len(pending) < size:
        return pending
    for n, t in live.items():
        t.grad = sum(g[n] for g in pending) / size  # type: ignore[assignment]
    opt.step()
    history.append({n: t.detach().clone() for n, t in live.items()})
    return []
