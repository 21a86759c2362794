"""Asynchronous schedules against independent step-by-step references of their semantics.

1f1b (PipeDream): minibatch m's forward and backward at stage s use the version stage s had at
m's forward, v_s(m) = max(0, m // r_s - w_s) with w_s = ceil(W_s / r_s) - 1 (W_s: workers in
stages s..end, r_s: replicas); stage s's k-th update applies the mean gradient of minibatches
k*r_s .. k*r_s + r_s - 1 to its latest weights. Vertical sync: every stage uses v_0(m).
2bw: W(t+1) = W(t) - lr * grad_t(W(t-1)), W(-1) = W(0).
"""

from __future__ import annotations

import copy
import gc
import math
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import pdcompile
from tests.helpers.blocks import (
    batches,
    block_of,
    build,
    make_model,
    mse,
    stage_of_block,
    update_after_round,
)
from tests.helpers.schedule_cuts import delayed_reference

OptFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
SchedFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def reference_1f1b(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                   stages: int, replicas: list[int], make_opt: OptFactory, *,
                   vertical_sync: bool = False, calls: list[int] | None = None,
                   make_sched: SchedFactory | None = None
                   ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PipeDream's weight-stashed 1F1B, minibatch by minibatch, one weight history per stage.

    `calls`: the minibatches of each `train()` call (default: one call over all `data`); every
    call fills and drains the pipeline, so weight versions count from that call's start. After
    each call every stage's `make_sched` scheduler steps once (`Pipeline.lr_scheduler`)."""
    names = [n for n, _ in model.named_parameters()]
    stage_names = [[n for n in names if stage_of_block(block_of(n), stages) == s]
                   for s in range(stages)]
    live = [{n: dict(model.named_parameters())[n].detach().clone().requires_grad_()
             for n in stage_names[s]} for s in range(stages)]
    opts = [make_opt(list(live[s].values())) for s in range(stages)]
    scheds = [make_sched(opt) for opt in opts] if make_sched else []
    pending: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(stages)]
    workers = [sum(replicas[s:]) for s in range(stages)]
    depth = [math.ceil(workers[s] / replicas[s]) - 1 for s in range(stages)]

    def version(s: int, m: int) -> int:
        return max(0, m // replicas[s] - depth[s])

    losses = []
    start = 0
    for size in calls or [len(data)]:
        history = [[{n: t.detach().clone() for n, t in live[s].items()}] for s in range(stages)]
        for m, (x, y) in enumerate(data[start:start + size]):
            used = [version(0 if vertical_sync else s, m) for s in range(stages)]
            params = {}
            for s in range(stages):
                for n, t in history[s][used[s]].items():
                    params[n] = t.clone().requires_grad_()
            loss = mse(functional_call(model, params, (x,)), y)
            loss.backward()
            losses.append(loss.item())
            for s in range(stages):
                pending[s].append({n: params[n].grad for n in stage_names[s]})
                pending[s] = update_after_round(pending[s], live[s], opts[s], history[s],
                                                replicas[s])
        start += size
        for sched in scheds:
            sched.step()
    assert start == len(data) and all(p == [] for p in pending)
    final = {n: t.detach() for s in range(stages) for n, t in live[s].items()}
    return losses, final


def reference_2bw(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                  micro: int, make_opt: OptFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """W(t+1) = W(t) - lr * grad_t(W(t-1)), gradients accumulated over the microbatches
    (tests/helpers/schedule_cuts.delayed_reference on one-input minibatches)."""
    return delayed_reference(model, [((x,), y) for x, y in data], mse, micro, make_opt)


def sgd_momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def assert_weights(pipe: pdcompile.pipeline.Pipeline, expected: dict[str, torch.Tensor]) -> None:
    got = pipe.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value)


@pytest.mark.parametrize(("stages", "replicas", "make_opt"), [
    (4, [1, 1, 1, 1], sgd_momentum),
    (3, [1, 1, 1], adam),
    (2, [2, 1], sgd_momentum),
    (2, [1, 2], adam),
])
def test_1f1b_matches_pipedream_reference(stages: int, replicas: list[int],
                                          make_opt: OptFactory) -> None:
    model = make_model()
    data = batches(8)
    pipe = build(copy.deepcopy(model), stages, replicas, schedule="1f1b", optimizer=make_opt)
    losses = pipe.train(data)
    ref_losses, ref_weights = reference_1f1b(model, data, stages, replicas, make_opt)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_weights(pipe, ref_weights)


def test_1f1b_without_stashing_differs_from_reference() -> None:
    model = make_model()
    data = batches(8)
    pipe = build(copy.deepcopy(model), 4, None, schedule="1f1b", optimizer=sgd_momentum,
                 stash=False)
    pipe.train(data)
    _, ref_weights = reference_1f1b(model, data, 4, [1] * 4, sgd_momentum)
    got = pipe.state_dict()
    gap = max((got[n] - v).abs().max().item() for n, v in ref_weights.items())
    assert gap > 1e-4, "without stashing the backward must see newer weights"


@pytest.mark.parametrize(("stages", "replicas"), [(4, [1, 1, 1, 1]), (2, [2, 2])])
def test_1f1b_vertical_sync_matches_reference(stages: int, replicas: list[int]) -> None:
    model = make_model()
    data = batches(8)
    pipe = build(copy.deepcopy(model), stages, replicas, schedule="1f1b",
                 optimizer=sgd_momentum, vertical_sync=True)
    losses = pipe.train(data)
    ref_losses, ref_weights = reference_1f1b(model, data, stages, replicas, sgd_momentum,
                                             vertical_sync=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_weights(pipe, ref_weights)
    plain, _ = reference_1f1b(model, data, stages, replicas, sgd_momentum)
    assert not torch.allclose(torch.tensor(plain), torch.tensor(ref_losses))
    assert all(rt.versions.held == [] for rt in pipe.last_runtimes.values())


@pytest.mark.parametrize(("stages", "replicas", "micro"), [
    (4, None, 4),
    (3, [2, 1, 1], 4),
])
def test_2bw_matches_delayed_update_rule(stages: int, replicas: list[int] | None,
                                         micro: int) -> None:
    model = make_model()
    data = batches(4, size=8)
    pipe = build(copy.deepcopy(model), stages, replicas, schedule="2bw", microbatches=micro,
                 optimizer=sgd_momentum)
    losses = pipe.train(data)
    ref_losses, ref_weights = reference_2bw(model, data, micro, sgd_momentum)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_weights(pipe, ref_weights)
    held = [len(rt.versions.held) for rt in pipe.last_runtimes.values()]
    assert held == [0] * len(held)
    assert max(rt.versions.peak for rt in pipe.last_runtimes.values()) <= 2


def test_2bw_refuses_too_few_microbatches_for_a_replica_before_any_rank_runs() -> None:
    """Found by random cuts under every schedule: 4 stages on replicas [2, 1, 2, 2] with 4
    microbatches per minibatch (as many as stages, which the old message asked for) stopped
    mid-run ("stage 0 needs weight version 1 for microbatch 8 but has only reached version 0;
    use at least as many microbatches per minibatch as stages"): a replica of stage 0 runs 3
    forwards ahead but takes only 2 microbatches of each minibatch, so its forward of minibatch
    2 came before the update of minibatch 0 it needs. The schedule is refused when it is made,
    naming the fewest that suffice (2 replicas x 3 ahead = 6), and 6 trains by the rule."""
    from pdcompile.errors import ScheduleError
    from pdcompile.schedule.generators import generate

    shape = [[0, 1], [2], [3, 4], [5, 6]]
    with pytest.raises(ScheduleError, match=r"stage 0 \(rank 0.*3 forwards ahead.*>= 6"):
        generate("2bw", shape, 12, microbatches_per_minibatch=4)
    generate("2bw", shape, 18, microbatches_per_minibatch=6)
    model = make_model()
    data = batches(3, size=12)
    pipe = build(copy.deepcopy(model), 4, [2, 1, 2, 2], schedule="2bw", microbatches=4,
                 optimizer=sgd_momentum)
    with pytest.raises(ScheduleError, match=">= 6"):
        pipe.train(data)
    assert_weights(pipe, dict(model.named_parameters()))  # no rank ran: nothing moved
    pipe = build(copy.deepcopy(model), 4, [2, 1, 2, 2], schedule="2bw", microbatches=6,
                 optimizer=sgd_momentum)
    losses = pipe.train(data)
    ref_losses, ref_weights = reference_2bw(model, data, 6, sgd_momentum)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_weights(pipe, ref_weights)


def test_stash_versions_equal_in_flight_and_are_released() -> None:
    model = make_model()
    pipe = build(copy.deepcopy(model), 4, None, schedule="1f1b")
    alive: list[weakref.ref[torch.Tensor]] = []
    for module in pipe.stage_modules:
        module.register_forward_hook(
            lambda _m, _i, out: alive.extend(weakref.ref(t) for t in out))
    pipe.train(batches(12))
    for rank, rt in pipe.last_runtimes.items():
        limit = 4 - rt.stage  # NOAM of a straight 4-stage pipeline
        assert rt.stash.peak == limit, f"rank {rank} in flight"
        assert rt.versions.peak == limit, f"rank {rank} weight versions"
        assert rt.stash.entries == {} and rt.versions.held == []
    del rt
    pipe.last_runtimes = {}
    gc.collect()
    assert alive and all(ref() is None for ref in alive), "stashed activations not released"


def test_flush_keeps_one_version() -> None:
    pipe = build(make_model(), 4, None, schedule="1f1b-flush", microbatches=8)
    x, y = batches(1, size=16)[0]
    pipe.step(x, target=y)
    for rt in pipe.last_runtimes.values():
        assert rt.versions.peak == 1
        assert rt.stash.peak == min(8, 4 - rt.stage)


def halve(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.mark.parametrize(("stages", "replicas", "calls"), [
    (3, [1, 1, 1], [1, 1, 1, 1]),  # pipe.step per minibatch: the LR changes every minibatch
    (3, [1, 2, 1], [4, 2, 4]),     # pipe.train over several: the LR changes between calls
])
def test_1f1b_lr_scheduler_steps_between_calls(stages: int, replicas: list[int],
                                               calls: list[int]) -> None:
    """`Pipeline.lr_scheduler(f).step()` steps every rank's scheduler once. Under asynchronous
    1f1b each `train()` call fills and drains the pipeline, so every update of one call uses
    the LR in force when the call began; the reference does the same, with Adam."""
    model = make_model()
    data = batches(sum(calls))
    pipe = build(copy.deepcopy(model), stages, replicas, schedule="1f1b", optimizer=adam)
    schedulers = pipe.lr_scheduler(halve)
    losses: list[float] = []
    start = 0
    for size in calls:
        chunk = data[start:start + size]
        if size == 1:
            (x, y), = chunk
            losses.append(pipe.step(x, target=y))
        else:
            losses.extend(pipe.train(chunk))
        start += size
        schedulers.step()
    assert len(pipe.optimizers) == sum(replicas)
    lr = 0.01 * 0.5 ** len(calls)
    assert all(o.param_groups[0]["lr"] == pytest.approx(lr) for o in pipe.optimizers)
    ref_losses, ref_weights = reference_1f1b(model, data, stages, replicas, adam, calls=calls,
                                             make_sched=halve)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_weights(pipe, ref_weights)
    # one call over everything (no scheduler steps in between) trains differently
    other, _ = reference_1f1b(model, data, stages, replicas, adam, make_sched=halve)
    assert not torch.allclose(torch.tensor(other), torch.tensor(ref_losses))
