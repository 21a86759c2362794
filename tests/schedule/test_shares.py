"""Replicas taking unequal shares of each round (`Schedule.shares`): generated, lowered and
validated for drawn pipelines; each replica runs its share; equal shares are round robin."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.errors import ScheduleError
from pdcompile.schedule.build import build
from pdcompile.schedule.ir import Kind, Schedule, replica_pattern


@st.composite
def shared_pipelines(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]]]:
    """1-3 stages of 1-3 replicas, each replica a share of 1-4 per round."""
    stage_ranks: list[list[int]] = []
    shares: list[list[int]] = []
    for _ in range(draw(st.integers(1, 3))):
        replicas = draw(st.integers(1, 3))
        first = sum(len(r) for r in stage_ranks)
        stage_ranks.append(list(range(first, first + replicas)))
        shares.append([draw(st.integers(1, 4)) for _ in range(replicas)] if replicas > 1
                      else [1])
    return stage_ranks, shares


def forwards(schedule: Schedule, rank: int) -> list[int]:
    return [a.microbatch for a in schedule.actions[rank] if a.kind == Kind.F]


@settings(max_examples=60, deadline=None)
@given(shape=shared_pipelines(), schedule=st.sampled_from(["1f1b", "1f1b-flush", "gpipe"]),
       rounds=st.integers(1, 3))
def test_shared_schedules_validate_and_give_each_replica_its_share(
        shape: tuple[list[list[int]], list[list[int]]], schedule: str, rounds: int) -> None:
    stage_ranks, shares = shape
    length = rounds * math.lcm(*(sum(c) for c in shares))
    built = build(schedule, stage_ranks, length, shares=shares)  # validates (no deadlock)
    for stage, ranks in enumerate(stage_ranks):
        n = sum(shares[stage])
        for replica, rank in enumerate(ranks):
            taken = forwards(built, rank)
            assert len(taken) == length * shares[stage][replica] // n
            assert all(built.rank_of(stage, m) == rank for m in taken)
            if schedule == "1f1b":  # one update per round, after the replica's share of it
                steps = [a.microbatch for a in built.actions[rank] if a.kind == Kind.STEP]
                assert steps == list(range(length // n))


@settings(max_examples=30, deadline=None)
@given(shares=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_a_round_spreads_each_replica_over_it(shares: list[int]) -> None:
    pattern = replica_pattern(tuple(shares))
    total = sum(shares)
    assert [pattern.count(i) for i in range(len(shares))] == shares
    for k in range(1, total + 1):  # after k of the round, every replica within one of its due
        for i, share in enumerate(shares):
            assert abs(pattern[:k].count(i) - k * share / total) < 1 + 1e-9


def test_equal_shares_are_round_robin() -> None:
    for schedule, length in (("1f1b", 12), ("1f1b-flush", 8)):
        plain = build(schedule, [[0, 1], [2]], length)
        ones = build(schedule, [[0, 1], [2]], length, shares=[[1, 1], [1]])
        assert ones == plain and "shares" not in ones.options


def test_shares_are_refused_where_they_do_not_apply() -> None:
    with pytest.raises(ScheduleError, match="positive count"):
        build("1f1b", [[0, 1], [2]], 6, shares=[[2], [1]])
    with pytest.raises(ScheduleError, match="does not take proportional shares"):
        build("2bw", [[0, 1], [2]], 6, per_minibatch=3, shares=[[2, 1], [1]])
    with pytest.raises(ScheduleError, match="multiple"):
        build("1f1b", [[0, 1], [2]], 4, shares=[[2, 1], [1]])


def test_shares_survive_the_text_form() -> None:
    built = build("1f1b", [[0, 1], [2]], 6, shares=[[2, 1], [1]])
    again = Schedule.from_text(built.to_text())
    assert again.shares == ((2, 1), (1,))
    assert [again.rank_of(0, m) for m in range(6)] == [0, 1, 0, 0, 1, 0]


def test_a_plan_keeps_its_shares_through_json_and_shows_them() -> None:
    from pdcompile.errors import PlanError
    from pdcompile.plan import Plan, Stage

    plan = Plan(stages=(Stage(("a",), 3, (0, 1, 2), shares=(2, 2, 1)), Stage(("b",), 1, (3,))),
                time_per_minibatch=0.1, dp_time=0.1, workers=4)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.shares() == [[2, 2, 1], [1]]
    assert [again.stages[0].rank_of(m) for m in range(5)] == [0, 1, 2, 0, 1]
    assert "stage 0 2/2/1" in plan.summary()
    plain = Plan(stages=(Stage(("a",), 2, (0, 1)),), time_per_minibatch=0.1, dp_time=0.1,
                 workers=2)
    assert '"shares"' not in plain.to_json() and plain.shares() is None
    with pytest.raises(PlanError, match="shares"):
        Stage(("a",), 2, (0, 1), shares=(1, 0))
