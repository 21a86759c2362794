"""Each stage's weight-gradient part of its backward (`StageCosts.wgrad`, what its runtime
defers: the fused Linear layers' dW) prices its W, in the simulator and in the planner's closed
form alike; `wgrad_share` given to the simulator overrides it; unknown (None), every stage takes
`WGRAD_SHARE`."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.backends.simulate import simulate
from pdcompile.cost.pipeline_time import pipeline_time, stage_terms
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.generators import generate, warmup_depth
from pdcompile.schedule.ir import Kind
from pdcompile.schedule.kinds import WGRAD_SHARE
from pdcompile.schedule.lower import lower

FREE = Cluster.flat(8, 1e30)  # transfers take no time
SCHEDULES = ["1f1b", "1f1b-flush", "gpipe", "zb-h1"]


def straight(p: int) -> list[list[int]]:
    return [[s] for s in range(p)]


def closed_form(name: str, costs: StageCosts, m: int) -> float:
    p = costs.stages
    ranks = straight(p)
    flight = [m if name == "gpipe" else min(m, warmup_depth(ranks, s) + 1) for s in range(p)]
    terms = stage_terms(fwd=costs.fwd, bwd=costs.bwd, params=costs.params,
                        edges=dict(costs.edges), stage_ranks=ranks, cluster=FREE,
                        schedule=name, in_flight=flight, copying=[False] * p,
                        step=[0.0] * p, wgrad=costs.wgrad)
    return pipeline_time(terms, dict(costs.edges), ranks, FREE, schedule=name,
                         microbatches=m).time_per_minibatch


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b-flush"]), p=st.integers(1, 5), m=st.integers(1, 9),
       f=st.floats(0.1, 3.0), b=st.floats(0.1, 3.0), share=st.floats(0.0, 1.0))
def test_every_stages_own_share_gives_back_its_weight_gradients_on_the_drain(
        name: str, p: int, m: int, f: float, b: float, share: float) -> None:
    # (m + p - 1)(f + b) less w = share x b for each of the p - 1 stages that send gradients
    # back; the closed form says the same for any share the costs carry
    costs = replace(StageCosts.uniform(p, fwd=f, bwd=b, optimizer=0.0),
                    wgrad=(share * b,) * p)
    expected = (m + p - 1) * (f + b) - (p - 1) * share * b
    assert simulate(lower(generate(name, straight(p), m)), costs, FREE).makespan == \
        pytest.approx(expected, rel=1e-9)
    assert closed_form(name, costs, m) == pytest.approx(expected, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(SCHEDULES), p=st.integers(2, 4), m=st.integers(2, 8),
       times=st.lists(st.tuples(st.floats(0.1, 3.0), st.floats(0.1, 3.0)), min_size=4,
                      max_size=4),
       share=st.floats(0.0, 1.0))
def test_one_share_on_every_stage_is_the_global_share(name: str, p: int, m: int,
                                                      times: list[tuple[float, float]],
                                                      share: float) -> None:
    fwd, bwd = tuple(t[0] for t in times[:p]), tuple(t[1] for t in times[:p])
    plain = StageCosts(fwd, bwd, optimizer=(0.0,) * p)
    own = replace(plain, wgrad=tuple(share * b for b in bwd))
    schedule = lower(generate(name, straight(p), m))
    by_stage = simulate(schedule, own, FREE, timeline=False).makespan
    assert by_stage == pytest.approx(
        simulate(schedule, plain, FREE, timeline=False, wgrad_share=share).makespan, rel=1e-12)
    # given explicitly, `wgrad_share` wins over what the costs say
    assert simulate(schedule, own, FREE, timeline=False, wgrad_share=WGRAD_SHARE).makespan == \
        pytest.approx(simulate(schedule, plain, FREE, timeline=False).makespan, rel=1e-12)


@pytest.mark.parametrize("name", ["zb-h1", "1f1b-flush"])
def test_a_stage_without_deferrable_weights_runs_its_backward_as_one_block(name: str) -> None:
    # stage 1 has no fused Linear (wgrad 0): its W takes nothing and its B the whole backward;
    # stage 2 defers 0.8 of its 2.0
    costs = StageCosts((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), optimizer=(0.0,) * 3,
                       wgrad=(1.0, 0.0, 0.8))
    result = simulate(lower(generate(name, straight(3), 3)), costs, FREE)
    durations: dict[tuple[int, Kind], set[float]] = {}
    for event in result.timeline.events:
        action = event.parsed()
        durations.setdefault((action.stage, action.kind), set()).add(round(event.duration, 9))
    if name == "zb-h1":  # split backward: B and W events apart
        assert durations[1, Kind.B] == {2.0} and durations[1, Kind.W] == {0.0}
        assert durations[2, Kind.B] == {1.2} and durations[2, Kind.W] == {0.8}
        assert durations[0, Kind.B] == {1.0} and durations[0, Kind.W] == {1.0}
    # stage 1 defers nothing: the stage before it waits for its whole backward, so the run is
    # longer than with the global share (which would let 1.0 of it wait)
    default = simulate(lower(generate(name, straight(3), 3)), replace(costs, wgrad=None), FREE)
    assert result.makespan > default.makespan
