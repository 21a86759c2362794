"""The V-shaped schedules (ZB-V, DualPipeV) read like their figures, on the V placement.

Rank r holds stage r (chunk 0, on the way down) and stage 2p - 1 - r (chunk 1, on the way
back); "0F3" is the forward of microbatch 3 through stage 0, "3B1 3W1" a backward whose weight
gradients follow at once, a B whose W comes later a split one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.errors import ScheduleError
from pdcompile.schedule.build import build
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Kind, Schedule
from pdcompile.schedule.lower import lower
from pdcompile.schedule.placement import chunk_shape, v_chunks, v_position
from pdcompile.schedule.validate import validate


def v(ranks: int) -> list[list[int]]:
    return [[v_position(c, ranks)] for c in range(2 * ranks)]


def order(schedule: Schedule, rank: int) -> str:
    return " ".join(str(a) for a in schedule.actions[rank])


def test_the_v_placement() -> None:
    assert v(4) == [[0], [1], [2], [3], [3], [2], [1], [0]]
    assert [v_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert chunk_shape(v(3), v_shape=True) == (3, 2)
    with pytest.raises(ScheduleError, match=r"not a V .* e\.g\. \[\[0\], \[1\], \[1\], \[0\]\]"):
        chunk_shape([[0], [1], [0], [1]], v_shape=True)
    with pytest.raises(ScheduleError, match="not a V"):
        generate("zb-v", [[0], [1], [2], [2], [1], [0], [0], [1]], 4)


def test_zb_v_two_ranks_four_microbatches() -> None:
    # warm-up 2(p - r) - 1 chunk-0 forwards, r pairs F1 F0, p - r triples F1 B1 W1, then
    # F0 B0 W0 F1 B1 W1 steadily; the drain runs B's first and the deferred W's last
    schedule = generate("zb-v", v(2), 4)
    assert order(schedule, 0) == ("0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 "
                                  "3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3")
    assert order(schedule, 1) == ("1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 "
                                  "1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3")


def test_zb_v_three_ranks_six_microbatches() -> None:
    schedule = generate("zb-v", v(3), 6)
    assert order(schedule, 2) == (
        "2F0 3F0 2F1 3F1 2F2 3F2 3B0 3W0 2F3 2B0 2W0 3F3 3B1 3W1 2F4 2B1 2W1 3F4 3B2 3W2 "
        "2F5 2B2 2W2 3F5 3B3 3W3 2B3 3B4 2B4 3B5 2B5 2W3 3W4 3W5 2W4 2W5")
    assert order(schedule, 0).startswith("0F0 0F1 0F2 0F3 0F4 5F0 5B0 5W0 5F1 5B1 5W1 5F2 5B2 "
                                         "5W2 0F5 0B0 0W0 5F3")


def test_dualpipev_two_ranks_four_microbatches() -> None:
    # rank 1: one pair F0 F1 ... then the overlapped pairs (F0, B1 W1) and (F1, B0 W0)
    schedule = generate("dualpipev", v(2), 4)
    assert order(schedule, 0) == ("0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 "
                                  "3W2 3F3 0B1 0W1 3B3 3W3 0B2 0W2 0B3 0W3")
    assert order(schedule, 1) == ("1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 "
                                  "1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3")


def test_dualpipev_four_ranks_eight_microbatches_main_phase() -> None:
    schedule = generate("dualpipev", v(4), 8)
    # the last rank: 4 pairs F0 F1, then 4 times the two overlapped pairs (F0 with the full
    # backward of chunk 1, F1 with the full backward of chunk 0)
    assert order(schedule, 3).startswith(
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4W0 4F4 3B0 3W0 3F5 4B1 4W1 4F5 3B1 3W1")
    # rank 0: 6 chunk-0 forwards, one pair, then 3 times (B1, its W, F1) before the main phase
    assert order(schedule, 0).startswith(
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 7F3 0F7 7B3 7W3")


def test_dualpipev_needs_two_microbatches_per_rank() -> None:
    with pytest.raises(ScheduleError, match=r"at least 2p = 6 microbatches on 3 ranks"):
        generate("dualpipev", v(3), 5)


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(2, 6), extra=st.integers(0, 12), name=st.sampled_from(["zb-v",
                                                                               "dualpipev"]))
def test_every_v_order_is_sound_and_holds_what_1f1b_holds(ranks: int, extra: int,
                                                          name: str) -> None:
    m = (1 if name == "zb-v" else 2 * ranks) + extra
    schedule = build(name, v(ranks), m)  # generated, lowered and validated
    assert schedule.stage_ranks == tuple(tuple(r) for r in v(ranks))
    for rank in range(ranks):
        # activations held (forwards whose W has not run) per rank: 2p chunks under ZB-V (the
        # peak of rank 0 under 1F1B, p whole stages), one more under DualPipeV
        held = peak = 0
        for action in schedule.actions[rank]:
            held += (action.kind == Kind.F) - (action.kind == Kind.W)
            peak = max(peak, held)
        assert peak <= 2 * ranks + (name == "dualpipev")
        # the tip of the V hands over inside rank p - 1, and nowhere else
        inside = [a for a in schedule.actions[rank] if a.kind in (Kind.SEND_F, Kind.SEND_B)
                  and schedule.rank_of(a.peer or 0, a.microbatch) == rank]
        assert len(inside) == (2 * m if rank == ranks - 1 else 0)


def test_lowered_v_orders_validate() -> None:
    for name, m in (("zb-v", 4), ("dualpipev", 6)):
        compute = generate(name, v(3), m)
        validate(compute)
        validate(lower(compute))
