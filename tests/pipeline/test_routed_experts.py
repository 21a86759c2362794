"""A mixture of experts routed by top-k, its rows gathered with `nonzero` and summed back with
`index_add`: data-dependent shapes, but no data-dependent Python, so it traces and pipelines.

`w[rows, k]` reads the router's weights `w` at indices computed later; the split pass put every
indexing `getitem` on the stage of the value indexed, so a cut with `w` on stage 0 and `rows`
on stage 1 was refused as out of order ("node 'getitem_4' (stage 0) uses 'getitem_2' from the
later stage 1") though the cut was valid. Any valid cut now trains as one process does."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.passes.split import manual_plan
from tests.helpers.schedule_cuts import cut_graph, flush_reference, placed_cut
from tests.helpers.transparency import momentum

BATCH = 8


class RoutedExperts(nn.Module):
    """Each row goes to its router's top-2 experts, weighted by the router's softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        mixed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            mixed = mixed.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return self.out(mixed)


def _example(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = RoutedExperts().double()
    return model, torch.randn(BATCH, 4, dtype=torch.float64), \
        torch.randn(BATCH, 2, dtype=torch.float64)


def _trains_like_one_process(model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                             plan: pdcompile.Plan, schedule: str, micro: int) -> None:
    loss = nn.functional.mse_loss
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), loss_fn=loss,
                             optimizer=momentum, plan=plan, schedule=schedule,
                             microbatches=micro)
    losses = [pipe.step(x, target=target) for _ in range(2)]
    want, state = flush_reference(model, (x,), target, loss, micro, 2, momentum)
    assert losses == pytest.approx(want, rel=1e-9)
    got = pipe.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, msg=name)


def test_router_weights_read_at_rows_of_the_next_stage() -> None:
    model, x, target = _example(0)
    graph = cut_graph(model, (x,))
    first = {"x", "router", "softmax", "topk", "getitem", "getitem_1", "zeros_like"}
    plan = manual_plan(graph, lambda n: 0 if n.name in first else 1)
    _trains_like_one_process(model, x, target, plan, "1f1b-flush", 2)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), schedule=st.sampled_from(["1f1b-flush", "zb-h1"]),
       micro=st.sampled_from([1, 2]))
def test_any_cut_of_routed_experts_trains_like_one_process(seed: int, schedule: str,
                                                           micro: int) -> None:
    model, x, target = _example(seed % 7)
    plan = placed_cut(cut_graph(model, (x,)), random.Random(seed), schedule)
    _trains_like_one_process(model, x, target, plan, schedule, micro)
