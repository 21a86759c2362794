"""Proportional shares (cost/shares.py): whole counts that make a round as short as any counts
of its size can, and the speed they buy."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.cost.shares import ROUND_MOST, proportional_shares, round_shares, shared_speed

speeds_st = st.lists(st.sampled_from([0.3, 0.5, 0.6, 1.0, 1.7, 2.0]), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(speeds=speeds_st, extra=st.integers(0, 6))
def test_proportional_shares_make_the_shortest_round_of_their_size(speeds: list[float],
                                                                    extra: int) -> None:
    total = len(speeds) + extra
    counts = proportional_shares(speeds, total)
    assert sum(counts) == total and min(counts) >= 1
    longest = max(c / s for c, s in zip(counts, speeds, strict=True))
    every = (c for c in itertools.product(range(1, total + 1), repeat=len(speeds))
             if sum(c) == total)
    best = min(max(c / s for c, s in zip(other, speeds, strict=True)) for other in every)
    assert longest == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(speeds=speeds_st)
def test_round_shares_run_between_the_slowest_and_the_mean(speeds: list[float]) -> None:
    counts = round_shares(speeds)
    speed = shared_speed(speeds, counts)
    mean = sum(speeds) / len(speeds)
    assert min(speeds) * (1 - 1e-9) <= speed <= mean * (1 + 1e-9)
    assert len(speeds) <= sum(counts) <= ROUND_MOST * len(speeds)
    if len(set(speeds)) == 1:
        assert counts == (1,) * len(speeds)
    assert shared_speed(speeds, (1,) * len(speeds)) == pytest.approx(min(speeds))


def test_two_a100_and_a_v100_share_a_round_of_five() -> None:
    speeds = [1.0, 1.0, 0.6]
    assert round_shares(speeds) == (2, 2, 1)
    assert shared_speed(speeds, (2, 2, 1)) == pytest.approx(5 / 6)  # round robin: 0.6
    with pytest.raises(ValueError, match="one"):
        proportional_shares(speeds, 2)
