"""planner/rank_moves.py: the moves over the stages' rank sets, drawn over small mixed clusters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.machine.device import DEVICES
from pdcompile.machine.device_groups import DeviceGroup
from pdcompile.planner.rank_moves import RankSets, rank_set_neighbours


def _cluster(fast: int, slow: int, network: str) -> Cluster:
    return Cluster(levels=Cluster.parse(network).levels,
                   groups=(DeviceGroup(DEVICES["a100"], fast, 1.0),
                           DeviceGroup(DEVICES["a100"], slow, 0.5)))


@st.composite
def placements(draw: st.DrawFn) -> tuple[Cluster, RankSets]:
    """A 4-rank cluster (2 fast, 2 slow, on one or two servers) and 2-3 stages' rank sets over
    some of its ranks."""
    cluster = _cluster(2, 2, draw(st.sampled_from(["4@1e9~5us", "2x2@1e11,1e9~5us,20us"])))
    ranks = draw(st.permutations(range(4)))
    used = draw(st.integers(2, 4))
    count = draw(st.integers(2, min(3, used)))
    cuts = sorted(draw(st.lists(st.integers(1, used - 1), min_size=count - 1,
                                max_size=count - 1, unique=True)))
    bounds = [0, *cuts, used]
    spans = zip(bounds, bounds[1:], strict=False)
    return cluster, tuple(tuple(sorted(ranks[a:b])) for a, b in spans)


@settings(max_examples=60, deadline=None)
@given(placements())
def test_every_neighbour_places_each_rank_at_most_once_and_differs(
        placement: tuple[Cluster, RankSets]) -> None:
    cluster, sets = placement
    used = {r for s in sets for r in s}
    seen = []
    for neighbour in rank_set_neighbours(sets, cluster):
        ranks = [r for s in neighbour for r in s]
        assert len(ranks) == len(set(ranks)) and all(neighbour), neighbour
        assert used <= set(ranks) and len(neighbour) == len(sets)
        assert neighbour != sets and neighbour not in seen
        seen.append(neighbour)
    # giving two stages each other's ranks is among them unless they hold alike ranks
    kinds = [sorted((cluster.group_of(r), r // cluster.group_size(0)) for r in s) for s in sets]
    if kinds[0] != kinds[1]:
        assert (sets[1], sets[0], *sets[2:]) in seen


def test_the_ranks_a_parameter_stage_wants_are_one_move_away() -> None:
    """1-3 with the fast rank on the first stage: the swap of the two stages' rank sets gives
    the second stage (the parameters) a fast rank alone, the first the rest."""
    cluster = _cluster(2, 2, "4@1e9~5us")
    assert ((1, 2, 3), (0,)) in set(rank_set_neighbours(((0,), (1, 2, 3)), cluster))


def test_exchanges_take_ranks_of_different_groups_only() -> None:
    cluster = _cluster(2, 2, "4@1e9~5us")
    neighbours = set(rank_set_neighbours(((0, 2), (1, 3)), cluster))
    assert ((1, 2), (0, 3)) not in neighbours  # fast for fast: the same plan
    assert ((1, 3), (0, 2)) not in neighbours  # the two stages' sets are alike: the same plan
    assert ((0, 1), (2, 3)) in neighbours  # slow 2 for fast 1
