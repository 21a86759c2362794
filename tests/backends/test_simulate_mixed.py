"""The simulator on mixed clusters: each rank computes at its device's speed."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.backends.simulate import simulate
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.device import DEVICES
from pdcompile.machine.device_groups import DeviceGroup
from pdcompile.schedule.generators import generate
from pdcompile.schedule.lower import lower
from tests.helpers.stage_costs import SHAPES, random_costs

SCHEDULES = ["1f1b", "1f1b-flush", "gpipe"]


def as_groups(cluster: Cluster, cuts: list[int], *, speed: float | None = None) -> Cluster:
    """`cluster` with its ranks cut into device groups of its own device."""
    bounds = [0, *cuts, cluster.workers]
    return replace(cluster, groups=tuple(DeviceGroup(cluster.device, b - a, speed)
                                         for a, b in zip(bounds, bounds[1:], strict=False)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from(SHAPES),
       name=st.sampled_from(SCHEDULES), m=st.sampled_from([4, 8, 12]), data=st.data())
def test_a_homogeneous_cluster_written_as_groups_prices_the_same(
        seed: int, shape: list[list[int]], name: str, m: int, data: st.DataObject) -> None:
    rng = random.Random(seed)
    costs = random_costs(rng, len(shape))
    workers = max(r for ranks in shape for r in ranks) + 1
    plain = Cluster.parse(f"{workers}@1e9~10us:v100")
    cuts = sorted(data.draw(st.sets(st.integers(1, workers - 1), max_size=2))) \
        if workers > 1 else []
    grouped = as_groups(plain, cuts)
    assert not grouped.is_mixed
    schedule = lower(generate(name, shape, m))
    a, b = simulate(schedule, costs, plain), simulate(schedule, costs, grouped)
    assert b.makespan == a.makespan and b.time_per_minibatch == a.time_per_minibatch


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from(SHAPES),
       name=st.sampled_from(SCHEDULES), speed=st.sampled_from([0.25, 0.5, 2.0]))
def test_every_rank_k_times_slower_makes_compute_k_times_longer(
        seed: int, shape: list[list[int]], name: str, speed: float) -> None:
    rng = random.Random(seed)
    costs = random_costs(rng, len(shape), free_links=True)
    costs = replace(costs, optimizer=(0.0,) * len(shape), stash=(0.0,) * len(shape))
    workers = max(r for ranks in shape for r in ranks) + 1
    plain = Cluster.parse(f"{workers}@1e9")
    slow = as_groups(plain, [], speed=speed)
    assert slow.is_mixed
    schedule = lower(generate(name, shape, 4))
    a, b = simulate(schedule, costs, plain), simulate(schedule, costs, slow)
    assert b.makespan == pytest.approx(a.makespan / speed)


def test_a_slow_rank_runs_its_stage_at_its_speed() -> None:
    costs = StageCosts(fwd=(1.0, 1.0), bwd=(2.0, 2.0), edges={(0, 1): 0.0},
                       optimizer=(0.0, 0.0), stash=(0.0, 0.0))
    cluster = Cluster.parse("2:a100*1,v100*1")
    schedule = lower(generate("1f1b-flush", [[0], [1]], 4))
    result = simulate(schedule, costs, cluster)
    slowness = 1.0 / cluster.speed_of(1)
    assert slowness > 1.5
    spans = {e.action: e.end - e.start for e in result.timeline.events if e.rank == 1}
    assert spans["1F0"] == pytest.approx(slowness) and spans["1B0"] == pytest.approx(2 * slowness)
    spans0 = {e.action: e.end - e.start for e in result.timeline.events if e.rank == 0}
    assert spans0["0F0"] == pytest.approx(1.0)
    # the slow stage bounds the minibatch: four of its microbatches back to back, and more
    assert result.makespan >= 4 * 3.0 * slowness


def test_updates_run_at_the_ranks_memory_bandwidth() -> None:
    costs = StageCosts(fwd=(0.0,), bwd=(0.0,), params=(9e9,))
    fast = Cluster.parse("1:a100")
    slow = Cluster(levels=fast.levels, device=DEVICES["a100"],
                   groups=(DeviceGroup(DEVICES["v100"], 1),))
    schedule = lower(generate("1f1b-flush", [[0]], 1))
    a, b = simulate(schedule, costs, fast), simulate(schedule, costs, slow)
    ratio = DEVICES["a100"].mem_bandwidth / DEVICES["v100"].mem_bandwidth
    assert b.makespan == pytest.approx(a.makespan * ratio)
