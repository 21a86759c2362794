"""A replicated stage leaves a parameter that no microbatch gave a gradient (frozen, or used only
under no_grad) without one, as one process does: the replicas all-reduce a flag per parameter
with the gradients. Once they zero-filled such gradients, so weight decay moved frozen weights
and no_grad gates on replicated stages only (SGD and AdamW alike), silently."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import pdcompile
from tests.helpers.gradless import OPTIMIZERS, GatedFrozen, plan_of

MICRO, STEPS = 2, 3


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: str
               ) -> list[float]:
    opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
            loss = nn.functional.mse_loss(model(xs), ys)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("replicas", [[2, 1], [1, 2]])
@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_replicas_leave_gradless_parameters_alone(optimizer: str, replicas: list[int],
                                                  schedule: str) -> None:
    torch.manual_seed(0)
    model = GatedFrozen()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                             loss_fn=nn.functional.mse_loss, optimizer=OPTIMIZERS[optimizer],
                             schedule=schedule, microbatches=MICRO,
                             plan=plan_of(model, replicas))
    losses = [pipe.step(x, target=y) for _ in range(STEPS)]
    want = _reference(model, x, y, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    state = pipe.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")
    params = pipe.named_parameters()
    assert params["g.weight"].grad is None and params["frozen.weight"].grad is None
    assert params["a.weight"].grad is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_replicas_leave_gradless_parameters_alone(tmp_path: object) -> None:
    """The same over gloo (`pdcompile run`, 3 processes): the flags travel in the gradients'
    flat all-reduce buffer."""
    from pathlib import Path

    from tests.helpers.processes import run_export_losses

    torch.manual_seed(0)
    model = GatedFrozen()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, optimizer=OPTIMIZERS["sgd_decay"],
                             schedule="1f1b-flush", microbatches=MICRO,
                             plan=plan_of(model, [2, 1]))
    folder = Path(str(tmp_path)) / "pipe"
    pipe.export(str(folder))
    want = _reference(model, x, y, "sgd_decay")
    assert run_export_losses(folder, nproc=3, steps=STEPS) == pytest.approx(want, rel=1e-5)
