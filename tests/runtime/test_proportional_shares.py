"""Replicas taking unequal shares of each round (a faster replica more minibatches) against
independent references: flush schedules against one process with gradient accumulation, and
asynchronous 1F1B against PipeDream's weight-stashed rule with the round's mean gradient."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import pdcompile
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace
from pdcompile.schedule.generators import shared_warmup_depths
from tests.helpers import transparency
from tests.helpers.blocks import (
    batches,
    block_of,
    make_model,
    mse,
    stage_of_block,
    update_after_round,
)

Opt = type[torch.optim.Optimizer]


def shared_plan(model: nn.Module, stages: int, replicas: list[int],
                shares: list[tuple[int, ...]]) -> pdcompile.Plan:
    """The blocks' plan (tests/helpers/blocks.py) with each stage's shares set."""
    plan = manual_plan(trace(model), lambda n: 0 if n.op == "placeholder" else stage_of_block(
        block_of(str(n.target)), stages), replicas=replicas)
    return replace(plan, stages=tuple(
        replace(s, shares=tuple(c) if len(c) > 1 else ())
        for s, c in zip(plan.stages, shares, strict=True)))


def own_order(shares: tuple[int, ...], replica: int, minibatches: int) -> list[int]:
    """The minibatches a replica takes, spread over the round as `Schedule` spreads them
    (written out here rather than imported: each next one to the replica furthest behind)."""
    total, taken, order = sum(shares), [0] * len(shares), []
    for k in range(total):
        best = max(range(len(shares)), key=lambda i: ((k + 1) * shares[i] - total * taken[i], -i))
        taken[best] += 1
        order.append(best)
    return [m for m in range(minibatches) if order[m % total] == replica]


def reference_shared_1f1b(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                          stages: int, replicas: list[int], shares: list[tuple[int, ...]],
                          make_opt: Opt) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PipeDream's 1F1B where the replicas of stage s take shares c of each round of n = sum(c)
    minibatches: a replica that runs d forwards ahead (its depth, a choice of the schedule's,
    `shared_warmup_depths`) uses for its j-th own minibatch the version after every round whose
    last own minibatch is its (j - d - 1)-th or earlier; update k applies the mean gradient of
    round k's n minibatches to the latest weights."""
    names = [n for n, _ in model.named_parameters()]
    stage_names = [[n for n in names if stage_of_block(block_of(n), stages) == s]
                   for s in range(stages)]
    live = [{n: dict(model.named_parameters())[n].detach().clone().requires_grad_()
             for n in stage_names[s]} for s in range(stages)]
    opts = [make_opt(list(live[s].values()), lr=0.01) for s in range(stages)]
    history = [[{n: t.detach().clone() for n, t in live[s].items()}] for s in range(stages)]
    rounds = [sum(c) for c in shares]
    depths = shared_warmup_depths([[0] * r for r in replicas], shares)
    version: dict[tuple[int, int], int] = {}
    for s in range(stages):
        for replica in range(replicas[s]):
            own = own_order(shares[s], replica, len(data))
            last_of_round = {m // rounds[s]: j for j, m in enumerate(own)}
            for j, m in enumerate(own):
                ahead = depths[s][replica]
                version[s, m] = sum(1 for at in last_of_round.values() if at <= j - ahead - 1)
    pending: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(stages)]
    losses = []
    for m, (x, y) in enumerate(data):
        params = {n: t.clone().requires_grad_() for s in range(stages)
                  for n, t in history[s][version[s, m]].items()}
        loss = mse(functional_call(model, params, (x,)), y)
        loss.backward()
        losses.append(loss.item())
        for s in range(stages):
            pending[s].append({n: params[n].grad for n in stage_names[s]})
            pending[s] = update_after_round(pending[s], live[s], opts[s], history[s], rounds[s])
    return losses, {n: t.detach() for s in range(stages) for n, t in live[s].items()}


@pytest.mark.parametrize(("stages", "replicas", "shares", "make_opt"), [
    (2, [2, 1], [(2, 1), (1,)], torch.optim.SGD),
    (2, [1, 2], [(1,), (1, 2)], torch.optim.Adam),
    (1, [3], [(3, 3, 2)], torch.optim.SGD),
    (3, [1, 3, 1], [(1,), (2, 1, 1), (1,)], torch.optim.Adam),
])
def test_1f1b_with_shares_matches_the_reference(stages: int, replicas: list[int],
                                                 shares: list[tuple[int, ...]],
                                                 make_opt: Opt) -> None:
    model = make_model()
    data = batches(2 * math.lcm(*(sum(c) for c in shares)))
    plan = shared_plan(model, stages, replicas, shares)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(torch.randn(4, 6),),
                             loss_fn=mse, plan=plan, schedule="1f1b",
                             optimizer=lambda p: make_opt(p, lr=0.01))
    assert pipe.schedule(len(data)).options["shares"] == [list(c) for c in shares]
    losses = pipe.train(data)
    ref_losses, ref_weights = reference_shared_1f1b(model, data, stages, replicas, shares,
                                                    make_opt)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    got = pipe.state_dict()
    for name, value in ref_weights.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")


def _skip_shared(model: nn.Module) -> pdcompile.Plan:
    plan = transparency.skip_plan(model)
    stages = list(plan.stages)
    stages[1] = replace(stages[1], shares=(2, 1))
    return replace(plan, stages=tuple(stages))


@pytest.mark.parametrize(("schedule", "micro"), [("1f1b-flush", 4), ("gpipe", 8),
                                                 ("1f1b-flush", 2)])
def test_flush_schedules_with_shares_equal_one_process(schedule: str, micro: int) -> None:
    torch.manual_seed(0)
    pipe = transparency.check(transparency.skipnet(), schedule=schedule, micro=micro,
                              plan=_skip_shared)
    counts = [sum(1 for a in pipe.schedule().actions[rank] if a.kind.value == "F")
              for rank in pipe.plan.stages[1].ranks]
    # the round (0, 1, 0): two of every three on replica 0
    assert counts == [micro - (micro + 1) // 3, (micro + 1) // 3]


def test_a_schedule_that_cannot_take_shares_says_so() -> None:
    model = make_model()
    plan = shared_plan(model, 2, [2, 1], [(2, 1), (1,)])
    with pytest.raises(pdcompile.errors.PipelineInputError, match="proportional shares"):
        pdcompile.compile(model, example_inputs=(torch.randn(4, 6),), loss_fn=mse, plan=plan,
                          schedule="2bw", microbatches=3)
    with pytest.raises(pdcompile.errors.PipelineInputError, match="vertical_sync"):
        pdcompile.compile(model, example_inputs=(torch.randn(4, 6),), loss_fn=mse, plan=plan,
                          schedule="1f1b", vertical_sync=True)
