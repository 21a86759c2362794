"""The simulator times a non-split backward as the runtime runs it: a stage that sends input
gradients upstream sends them after B (the input-gradient part) and computes W (its weight
gradients) after the send (backends/weights_after_send.py, runtime/stage_runtime.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.backends.simulate import simulate
from pdcompile.backends.weights_after_send import deferring_stages, with_weights_after_send
from pdcompile.cost.pipeline_time import pipeline_time, stage_terms
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.deps import execution_order
from pdcompile.schedule.generators import generate, warmup_depth
from pdcompile.schedule.ir import Action, Kind
from pdcompile.schedule.lower import lower

FREE = Cluster.flat(8, 1e30)  # transfers take no time


def straight(p: int) -> list[list[int]]:
    return [[s] for s in range(p)]


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe", "2bw", "interleaved-1f1b"])
def test_a_w_follows_the_last_gradient_send_of_every_stage_but_the_first(name: str) -> None:
    ranks = [[c % 2] for c in range(4)] if name == "interleaved-1f1b" else straight(3)
    schedule = lower(generate(name, ranks, 4, microbatches_per_minibatch=2 if name == "2bw"
                              else None))
    timed = with_weights_after_send(schedule)
    execution_order(timed)  # runs without a deadlock (a copy for timing: not a valid schedule)
    assert deferring_stages(schedule) == frozenset(range(1, len(ranks)))
    for rank, actions in timed.actions.items():
        for index, action in enumerate(actions):
            if action.kind == Kind.SEND_B:
                # the last send of the backward is followed by its W; nothing else is added
                assert actions[index + 1] == Action(action.stage, Kind.W, action.microbatch)
        added = [a for a in actions if a.kind == Kind.W]
        backwards = [a for a in actions if a.kind == Kind.B and a.stage != 0]
        assert [(a.stage, a.microbatch) for a in added] == \
            [(a.stage, a.microbatch) for a in backwards]
        assert [a for a in actions if a.kind != Kind.W] == list(schedule.actions[rank])


@pytest.mark.parametrize("name", ["zb-h1", "interleaved-zb"])
def test_a_split_schedule_is_timed_as_it_is(name: str) -> None:
    ranks = [[c % 2] for c in range(4)] if name == "interleaved-zb" else straight(2)
    schedule = lower(generate(name, ranks, 4))
    assert deferring_stages(schedule) == frozenset()
    assert with_weights_after_send(schedule) is schedule


def test_the_send_leaves_before_the_weight_gradients_by_hand() -> None:
    # 1F1B-flush, 2 stages, 2 microbatches, f = 1, b = 2 (B 1 + W 1), free transfers:
    # rank 1: F0 [1, 2], B0 [2, 3] then its send, W0 [3, 4]; F1 arrives at 2 but waits: [4, 5],
    # B1 [5, 6], send at 6, W1 [6, 7]; rank 0: F0 [0, 1], F1 [1, 2], B0 [3, 5], B1 [6, 8]
    schedule = lower(generate("1f1b-flush", straight(2), 2))
    costs = StageCosts.uniform(2, fwd=1.0, bwd=2.0, optimizer=0.0)
    result = simulate(schedule, costs, FREE)
    result.timeline.check_schedule(schedule)  # one event per action of the schedule, in order
    events = {(e.rank, e.action): (e.start, e.end) for e in result.timeline.events}
    assert events[1, "1B0"] == pytest.approx((2.0, 4.0))  # spans the send and W, as recorded
    assert events[1, "1SEND_B0->0"][0] == pytest.approx(3.0)
    assert events[1, "1B1"] == pytest.approx((5.0, 7.0))
    assert events[1, "1SEND_B1->0"][0] == pytest.approx(6.0)
    assert events[0, "0B0"] == pytest.approx((3.0, 5.0))
    assert events[0, "0B1"] == pytest.approx((6.0, 8.0))
    assert result.makespan == pytest.approx(8.0)
    # the backward as one block before its send: every gradient 1 s later, the run 1 s longer
    whole = simulate(schedule, costs, FREE, wgrad_share=0.0)
    assert whole.makespan == pytest.approx(9.0)
    assert {(e.rank, e.action): e.start for e in whole.timeline.events}[1, "1SEND_B1->0"] == \
        pytest.approx(7.0)


def test_a_slower_rank_stretches_b_before_the_send_and_w_after_it() -> None:
    # GPipe, 2 stages, 1 microbatch, rank 1 three times slower: F1 3, B 3 x 1 then the send,
    # W 3 x 1 after it; rank 0's backward (2) starts when the gradient arrives
    schedule = lower(generate("gpipe", straight(2), 1))
    costs = StageCosts.uniform(2, fwd=1.0, bwd=2.0, optimizer=0.0)
    result = simulate(schedule, costs, FREE.with_slowdowns((1.0, 3.0) + (1.0,) * 6))
    events = {(e.rank, e.action): (e.start, e.end) for e in result.timeline.events}
    assert events[1, "1SEND_B0->0"][0] == pytest.approx(1.0 + 3.0 + 3.0)
    assert events[1, "1B0"] == pytest.approx((4.0, 10.0))
    assert events[0, "0B0"] == pytest.approx((7.0, 9.0))
    assert result.makespan == pytest.approx(10.0)  # rank 1's W ends last


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b-flush"]), p=st.integers(1, 5), m=st.integers(1, 9),
       f=st.floats(0.1, 3.0), b=st.floats(0.1, 3.0),
       share=st.one_of(st.just(0.5), st.floats(0.0, 1.0)))
def test_each_hop_of_the_drain_gives_back_its_weight_gradients(
        name: str, p: int, m: int, f: float, b: float, share: float) -> None:
    # uniform stages: (m + p - 1)(f + b) less w = share x b for each of the p - 1 stages that
    # send gradients back, and the closed form of the planner says the same
    schedule = lower(generate(name, straight(p), m))
    costs = StageCosts.uniform(p, fwd=f, bwd=b, optimizer=0.0)
    result = simulate(schedule, costs, FREE, wgrad_share=share)
    expected = (m + p - 1) * (f + b) - (p - 1) * share * b
    assert result.makespan == pytest.approx(expected, rel=1e-9)
    if share == 0.5:  # the share the closed form and the planner assume (WGRAD_SHARE)
        ranks = straight(p)
        flight = [m if name == "gpipe" else min(m, warmup_depth(ranks, s) + 1)
                  for s in range(p)]
        terms = stage_terms(fwd=costs.fwd, bwd=costs.bwd, params=costs.params,
                            edges=dict(costs.edges), stage_ranks=ranks, cluster=FREE,
                            schedule=name, in_flight=flight, copying=[False] * p,
                            step=[0.0] * p)
        closed = pipeline_time(terms, dict(costs.edges), ranks, FREE, schedule=name,
                               microbatches=m)
        assert closed.time_per_minibatch == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush", "interleaved-1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_planners_closed_form_equals_the_simulator_on_uniform_stages(name: str,
                                                                         p: int) -> None:
    v = 2 if name == "interleaved-1f1b" else 1
    ranks = [[c % p] for c in range(p * v)]
    for m in (p, 2 * p, 4 * p):
        for f, b in ((1.0, 2.0), (0.3, 0.3), (2.0, 0.5)):
            costs = StageCosts.uniform(p * v, fwd=f, bwd=b, optimizer=0.0)
            simulated = simulate(lower(generate(name, ranks, m)), costs, FREE)
            flight = [m if name == "gpipe" else min(m, warmup_depth(ranks, s) + 1)
                      for s in range(p * v)]
            terms = stage_terms(fwd=costs.fwd, bwd=costs.bwd, params=costs.params,
                                edges=dict(costs.edges), stage_ranks=ranks, cluster=FREE,
                                schedule=name, in_flight=flight, copying=[False] * p * v,
                                step=[0.0] * p * v)
            assert all(t.deferred == (0.0 if s == 0 else b / 2) for s, t in enumerate(terms))
            closed = pipeline_time(terms, dict(costs.edges), ranks, FREE, schedule=name,
                                   microbatches=m)
            assert closed.time_per_minibatch == pytest.approx(simulated.makespan, rel=1e-12)
