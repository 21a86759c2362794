"""`compile(..., autocast=torch.bfloat16)`: every stage's forward and the loss under
torch.autocast, as a one-process loop with `with torch.autocast(...)` around `model(x)` and the
loss trains; the messages between stages carry what autocast made; kept in exports and over
gloo (`pdcompile run` had no way to train in mixed precision)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from tests.helpers.before_tracing import assert_refused_before_tracing
from tests.helpers.one_process import train_one_process
from tests.helpers.transparency import momentum

STEPS, MICRO = 3, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(8, 8), torch.randint(0, 3, (8,))


def _reference(model: nn.Module, dtype: torch.dtype | None) -> list[float]:
    x, y = _data()
    return train_one_process(model, momentum(list(model.parameters())), (x,), y,
                             F.cross_entropy, micro=MICRO, steps=STEPS, autocast=dtype)[0]


def _pipeline(replicas: list[int], schedule: str = "1f1b-flush", **options: Any
              ) -> pdcompile.Pipeline:
    x, y = _data()
    return pdcompile.compile(_model(), example_inputs=(x,), loss_fn=F.cross_entropy,
                             optimizer=momentum, stages=replicas, schedule=schedule,
                             microbatches=MICRO, example_target=y, **options)


@pytest.mark.parametrize(("replicas", "schedule"), [
    ([1, 1, 1], "1f1b-flush"), ([1, 2, 1], "1f1b-flush"), ([1, 1], "gpipe"), ([1, 1], "zb-h1")])
def test_autocast_trains_as_one_process_under_autocast(replicas: list[int],
                                                       schedule: str) -> None:
    pipe = _pipeline(replicas, schedule, autocast=torch.bfloat16)
    x, y = _data()
    losses = [pipe.step(x, target=y) for _ in range(STEPS)]
    model = _model()
    want = _reference(model, torch.bfloat16)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    assert losses != _reference(_model(), None)  # bfloat16 really ran
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value,
                                   msg=lambda m, n=name: f"{n}: {m}")
        assert pipe.state_dict()[name].dtype == torch.float32
    sent = {spec.dtype for specs in pipe.edge_specs((x,)).values() for spec in specs}
    assert torch.bfloat16 in sent


def test_an_export_keeps_autocast(tmp_path: Path) -> None:
    pipe = _pipeline([1, 1], autocast="bfloat16")
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    assert loaded.autocast == "bfloat16"
    x, y = _data()
    losses = [loaded.step(x, target=y) for _ in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(_model(),
                                                                             torch.bfloat16)))


@pytest.mark.parametrize("value", [torch.float32, "half", 16, True])
def test_another_autocast_value_is_refused_before_tracing(value: Any) -> None:
    assert_refused_before_tracing("autocast must be one of torch.bfloat16", autocast=value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_autocast_matches_one_process(tmp_path: Path) -> None:
    """`pdcompile run` on 3 processes: bfloat16 activations and gradients travel over gloo."""
    from tests.helpers.processes import run_export_losses

    pipe = _pipeline([1, 1, 1], autocast=torch.bfloat16)
    folder = tmp_path / "pipe"
    pipe.export(str(folder))
    want = _reference(_model(), torch.bfloat16)
    assert run_export_losses(folder, nproc=3, steps=STEPS) == pytest.approx(want, rel=1e-5)


def test_the_planner_sees_the_messages_autocast_makes() -> None:
    """Costed under autocast, a Linear's output (what a stage would send) is bfloat16: half the
    bytes of float32, so the planner prices the messages the run will send."""
    from pdcompile.cost.costed_graph import costed

    x, _ = _data()
    plain = costed(_model(), (x,), cost="analytic").graph
    mixed = costed(_model(), (x,), cost="analytic", autocast="bfloat16").graph
    linears = ["_0", "_2", "_5", "_7"]  # nn.Sequential's Linear layers, as traced
    assert all(mixed.nodes[n]["act"] * 2 == plain.nodes[n]["act"] > 0 for n in linears)
