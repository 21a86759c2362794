"""The one-process training loop the pipeline tests compare with: gradient accumulation over a
minibatch's microbatches, then (optionally) clipping and the optimizer step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from tests.helpers.transparency import momentum


def train_one_process(model: nn.Module, optimizer: torch.optim.Optimizer,
                      inputs: Sequence[torch.Tensor], target: torch.Tensor,
                      loss_fn: Callable[..., torch.Tensor], *, micro: int, steps: int,
                      autocast: torch.dtype | None = None, clip: float | None = None
                      ) -> tuple[list[float], list[float]]:
    """`steps` minibatches of `micro` microbatches each: the losses (mean over microbatches)
    and, with `clip`, the gradient norms `clip_grad_norm_` saw before clipping. `autocast`:
    forward and loss under torch.autocast of that dtype."""
    losses, norms = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for part in zip(*(t.chunk(micro) for t in inputs), target.chunk(micro), strict=True):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                enabled=autocast is not None):
                loss = loss_fn(model(*part[:-1]), part[-1])
            (loss / micro).backward()
            total += loss.item() / micro
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        losses.append(total)
    return losses, norms


def assert_two_stages_train_like_one_process(model: nn.Module, *, steps: int = 2,
                                             micro: int = 2, **options: Any) -> None:
    """`model` (8 features in, 3 classes out, float64) compiled into two stages under
    1F1B-flush with `options` trains `steps` minibatches of 8 samples as one process does:
    the same losses and, after them, the same weights and buffers."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=momentum, stages=2, schedule="1f1b-flush",
                             microbatches=micro, cost="analytic", **options)
    losses = [pipe.step(x, target=y) for _ in range(steps)]
    want, _ = train_one_process(model, momentum(list(model.parameters())), (x,), y,
                                F.cross_entropy, micro=micro, steps=steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def param_groups_of(model: nn.Module, options: Callable[[str, nn.Parameter], dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """torch's param groups of `model` by `options(name, param)`, in order of first appearance
    (as `compile(param_groups=...)` makes them per stage)."""
    groups: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        chosen = options(name, param)
        groups.setdefault(repr(sorted(chosen.items())), {**chosen, "params": []})[
            "params"].append(param)
    return list(groups.values())
