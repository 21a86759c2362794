"""A model that returns one of its parameters or buffers as it is trains as one process does.

Multi-task models weight their losses by learnable log variances that the loss function reads
from the output (`return {"first": ..., "second": ..., "log_var": self.log_var}`); others return
a temperature or a prior. Before, every cut failed: split's torch.fx split_module could not
return an attribute read that no stage ran ("could not be passed between the stages of this
plan ... please report ... as a pdcompile bug"), and the planner (and `stages=K`), seeing the
read as a node of its own, gave it a stage alone, which split refused ("stages [1] of the plan
have no operation to run"). Now the last stage returns it (passes/output_constants.py) and the
cost graph has no node for it (cost/node_costs.py)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from tests.helpers.processes import run_export_losses
from tests.helpers.random_models import random_cut
from tests.helpers.schedule_cuts import cut_graph, flush_reference
from tests.helpers.transparency import momentum

BATCH, MICRO, STEPS = 8, 2, 2


class WeightedHeads(nn.Module):
    """Two heads whose losses learnable log variances weight (Kendall et al.); the output
    holds the log variances and a fixed prior buffer as they are. `inside`: the forward also
    reads the log variances (a parameter that the last stage and an earlier one share)."""

    def __init__(self, inside: bool, as_tuple: bool) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.log_var = nn.Parameter(torch.tensor([0.1, -0.2]))
        self.register_buffer("prior", torch.tensor([1.0, 2.0]))
        self.inside, self.as_tuple = inside, as_tuple

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if self.inside:
            h = h * torch.exp(self.log_var[0])
        if self.as_tuple:
            return self.c(h), self.d(h), self.log_var, self.prior
        return {"first": self.c(h), "second": self.d(h), "log_var": self.log_var,
                "prior": self.prior}


def weighted_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    first, second, log_var, prior = output.values() if isinstance(output, dict) else output
    return (torch.exp(-log_var[0]) * ((first - target) ** 2).mean()
            + torch.exp(-log_var[1]) * ((second + target) ** 2).mean()
            + log_var.sum() + 0.01 * prior.sum())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inside=st.booleans(), as_tuple=st.booleans(), seed=st.integers(0, 2**32 - 1),
       how=st.sampled_from(["cut", "stages", "even", "cluster"]))
def test_a_returned_parameter_trains_like_one_process(inside: bool, as_tuple: bool, seed: int,
                                                      how: str) -> None:
    torch.manual_seed(seed % 1000)
    model = WeightedHeads(inside, as_tuple).double()
    x, target = (torch.randn(BATCH, 4, dtype=torch.float64) for _ in range(2))
    rng = random.Random(seed)
    options: dict[str, Any] = {}
    if how == "cut":
        options["plan"] = random_cut(cut_graph(model, (x,)), rng, stages=rng.choice([1, 2, 3, 4]),
                                     replicas=[rng.choice([1, 2]) for _ in range(4)])
    elif how == "stages":
        options["stages"] = rng.choice([2, 3])
    elif how == "even":
        options["stages"] = [rng.choice([1, 2]), 1]
    cluster = "3" if how == "cluster" else None
    pipe = pdcompile.compile(copy.deepcopy(model), cluster, example_inputs=(x,),
                             loss_fn=weighted_loss, optimizer=momentum, schedule="1f1b-flush",
                             microbatches=MICRO, cost="analytic", **options)
    losses = [pipe.step(x, target=target) for _ in range(STEPS)]
    want, state = flush_reference(model, (x,), target, weighted_loss, MICRO, STEPS, momentum)
    assert losses == pytest.approx(want, rel=1e-12)
    got = pipe.state_dict()
    assert set(got) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(got["log_var"], model.log_var.detach())  # the loss trained it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_exported_returned_parameter_trains_on_two_processes_like_one(tmp_path: Path) -> None:
    """The log variances read in stage 0 and returned by stage 1: a tie across processes,
    all-reduced as any other (the loss's gradient reaches stage 1's copy only)."""
    torch.manual_seed(0)
    model = WeightedHeads(inside=True, as_tuple=False).double()
    x, target = (torch.randn(BATCH, 4, dtype=torch.float64) for _ in range(2))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), example_target=target,
                             loss_fn=weighted_loss, optimizer=momentum, schedule="1f1b-flush",
                             microbatches=MICRO, stages=[1, 1], cost="analytic")
    want, _ = flush_reference(model, (x,), target, weighted_loss, MICRO, STEPS, momentum)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"), loss_fn=weighted_loss)
    torch.testing.assert_close(loaded.evaluate(x)["log_var"], model.log_var.detach())
    assert run_export_losses(tmp_path / "pipe", nproc=2, steps=STEPS) == pytest.approx(want,
                                                                                      rel=1e-9)
