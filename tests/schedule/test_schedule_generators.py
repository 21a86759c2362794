"""Schedule generators read like the figures of the PipeDream, PipeDream-Flush/2BW and GPipe papers.

Golden files (compute order and lowered schedule) live in tests/schedule/golden; regenerate them
with PDCOMPILE_REGEN_GOLDEN=1 after a deliberate change and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdcompile.errors import ScheduleError
from pdcompile.schedule.generators import generate, in_flight_limit, warmup_depth
from pdcompile.schedule.ir import Kind, Schedule
from pdcompile.schedule.lower import lower
from pdcompile.schedule.validate import validate

GOLDEN = Path(__file__).parent / "golden"


def order(schedule: Schedule, rank: int) -> str:
    return " ".join(str(a) for a in schedule.actions[rank])


def straight(stages: int) -> list[list[int]]:
    return [[s] for s in range(stages)]


# ------------------------------------------------------------------ the figures, written out
def test_1f1b_flush_4_stages_8_microbatches() -> None:
    schedule = generate("1f1b-flush", straight(4), 8)
    assert order(schedule, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert order(schedule, 1) == "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7"
    assert order(schedule, 2) == "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7"
    assert order(schedule, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"


def test_1f1b_flush_fewer_microbatches_than_stages() -> None:
    schedule = generate("1f1b-flush", straight(4), 2)
    assert order(schedule, 0) == "0F0 0F1 0B0 0B1"
    assert order(schedule, 2) == "2F0 2F1 2B0 2B1"
    assert order(schedule, 3) == "3F0 3B0 3F1 3B1"


def test_gpipe_all_forwards_then_backwards_in_reverse() -> None:
    schedule = generate("gpipe", straight(3), 4)
    for stage in range(3):
        s = str(stage)
        assert order(schedule, stage) == " ".join(
            [f"{s}F{m}" for m in range(4)] + [f"{s}B{m}" for m in (3, 2, 1, 0)])


def test_1f1b_async_stream_like_pipedream_figure_8() -> None:
    # PipeDream figure 8: 4 workers, straight pipeline; stage 0 admits 4 minibatches (NOAM = 4)
    schedule = generate("1f1b", straight(4), 6)
    assert order(schedule, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert order(schedule, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"
    assert schedule.options == {"microbatches_per_minibatch": 1, "vertical_sync": False}


def test_1f1b_rr_like_pipedream_figure_9() -> None:
    # PipeDream figure 9: config 2-1, stage 0 replicated on workers 0 and 1 (round robin)
    schedule = generate("1f1b", [[0, 1], [2]], 6)
    assert in_flight_limit(schedule.stage_ranks, 0) == 2  # ceil(3 workers / 2 replicas)
    assert order(schedule, 0) == "0F0 0F2 0B0 0F4 0B2 0B4"
    assert order(schedule, 1) == "0F1 0F3 0B1 0F5 0B3 0B5"
    assert order(schedule, 2) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1F4 1B4 1F5 1B5"


def test_2bw_is_1f1b_over_the_global_microbatch_stream() -> None:
    schedule = generate("2bw", straight(2), 6, microbatches_per_minibatch=3)
    assert order(schedule, 0) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0F5 0B4 0B5"
    lowered = lower(schedule)
    assert order(lowered, 1) == (
        "1RECV_F0<-0 1F0 1B0 1SEND_B0->0 1RECV_F1<-0 1F1 1B1 1SEND_B1->0 1RECV_F2<-0 1F2 1B2 "
        "1SEND_B2->0 1STEP0 1RECV_F3<-0 1F3 1B3 1SEND_B3->0 1RECV_F4<-0 1F4 1B4 1SEND_B4->0 "
        "1RECV_F5<-0 1F5 1B5 1SEND_B5->0 1STEP1")


# ------------------------------------------------------------------ golden files
CASES = [
    ("1f1b", straight(2), 4, None),
    ("1f1b", straight(4), 8, None),
    ("1f1b", [[0, 1], [2]], 6, None),
    ("1f1b", [[0], [1, 2], [3]], 4, None),
    ("1f1b-flush", straight(2), 1, None),
    ("1f1b-flush", straight(3), 5, None),
    ("1f1b-flush", straight(4), 8, None),
    ("1f1b-flush", [[0, 1], [2]], 4, None),
    ("gpipe", straight(2), 3, None),
    ("gpipe", straight(4), 4, None),
    ("gpipe", [[0], [1, 2]], 4, None),
    ("2bw", straight(3), 8, 4),
    ("2bw", [[0], [1, 2]], 8, 2),
    ("interleaved-1f1b", [[0], [1], [0], [1]], 4, None),
    ("interleaved-1f1b", [[0], [1], [2], [0], [1], [2]], 6, None),
    ("zb-h1", straight(3), 6, None),
    ("interleaved-zb", [[0], [1], [0], [1]], 4, None),
    ("zb-v", [[0], [1], [1], [0]], 4, None),
    ("zb-v", [[0], [1], [2], [2], [1], [0]], 6, None),
    ("dualpipev", [[0], [1], [2], [2], [1], [0]], 6, None),
]


def case_name(name: str, ranks: list[list[int]], m: int, mpm: int | None) -> str:
    shape = "-".join(str(len(r)) for r in ranks)
    return f"{name}_{shape}_m{m}" + (f"_k{mpm}" if mpm else "") + ".txt"


@pytest.mark.parametrize("case", CASES, ids=lambda c: case_name(*c)[:-4])
def test_golden(case: tuple[str, list[list[int]], int, int | None]) -> None:
    name, ranks, m, mpm = case
    compute = generate(name, ranks, m, microbatches_per_minibatch=mpm)
    lowered = lower(compute)
    validate(compute)
    validate(lowered)
    text = compute.to_text() + "\n" + lowered.to_text()
    path = GOLDEN / case_name(*case)
    if os.environ.get("PDCOMPILE_REGEN_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with PDCOMPILE_REGEN_GOLDEN=1"
    assert text == path.read_text()


# ------------------------------------------------------------------ in-flight bound
@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "2bw"])
@pytest.mark.parametrize("ranks", [straight(1), straight(2), straight(4), [[0, 1], [2]],
                                   [[0, 1, 2], [3, 4], [5]], [[0], [1, 2, 3]]])
@pytest.mark.parametrize("m", [1, 2, 6, 12])
def test_in_flight_never_exceeds_warmup_plus_one(name: str, ranks: list[list[int]], m: int) -> None:
    replicas = [len(r) for r in ranks]
    if name in ("1f1b", "2bw") and any(m % r for r in replicas):
        with pytest.raises(ScheduleError, match="multiple"):
            generate(name, ranks, m, microbatches_per_minibatch=m if name == "2bw" else None)
        return
    schedule = generate(name, ranks, m, microbatches_per_minibatch=m if name == "2bw" else None)
    for stage, stage_ranks in enumerate(ranks):
        depth = warmup_depth(ranks, stage)
        for rank in stage_ranks:
            own = len(range(stage_ranks.index(rank), m, len(stage_ranks)))
            live = peak = 0
            for action in schedule.actions[rank]:
                live += 1 if action.kind == Kind.F else -1
                peak = max(peak, live)
            assert peak <= depth + 1
            assert peak == min(depth + 1, own)


def test_gpipe_keeps_every_microbatch_in_flight() -> None:
    schedule = generate("gpipe", straight(3), 5)
    for rank in range(3):
        kinds = [a.kind for a in schedule.actions[rank]]
        assert kinds == [Kind.F] * 5 + [Kind.B] * 5


# ------------------------------------------------------------------ bad requests
def test_1f1b_with_replicas_needs_a_multiple() -> None:
    with pytest.raises(ScheduleError, match=r"multiple of every replica count \(6\); got 4, use 6"):
        generate("1f1b", [[0, 1], [2, 3, 4]], 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "pipedream"}, "unknown schedule"),
    ({"microbatches": 0}, "positive integer"),
    ({"stage_ranks": []}, "at least one stage"),
    ({"stage_ranks": [[0], []]}, "stage 1 has no ranks"),
    ({"stage_ranks": [[0], [0]]}, "rank 0 appears in two stages"),
    ({"name": "2bw"}, "microbatches_per_minibatch"),
    ({"name": "2bw", "microbatches_per_minibatch": 3}, "whole number"),
    ({"name": "gpipe", "vertical_sync": True}, "vertical_sync"),
])
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"name": "1f1b", "stage_ranks": [[0], [1]], "microbatches": 4}
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=match):
        generate(args.pop("name"), args.pop("stage_ranks"), args.pop("microbatches"),  # type: ignore[arg-type]
                 **args)  # type: ignore[arg-type]


# ------------------------------------------------------------------ interleaved and zero bubble
def interleaved(ranks: int, chunks: int) -> list[list[int]]:
    return [[c % ranks] for c in range(ranks * chunks)]


def test_interleaved_1f1b_like_megatron_figure_4() -> None:
    # 2 ranks, 2 chunks each (rank 0: stages 0 and 2): forwards in rounds of p microbatches per
    # chunk, warm-up (v-1) p + 2 (p-1-r), backwards from the last chunk down
    schedule = generate("interleaved-1f1b", interleaved(2, 2), 4)
    assert order(schedule, 0) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert order(schedule, 1) == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    assert schedule.options == {"microbatches_per_minibatch": 4}


def test_zb_h1_delays_the_weight_gradients_of_later_stages() -> None:
    # ZB-H1 (Qi et al., figure 3): 1F1B's warm-up, B in place of the backward, rank r delays
    # its first r W's into the drain
    schedule = generate("zb-h1", straight(3), 4)
    assert order(schedule, 0) == "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3"
    assert order(schedule, 1) == "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3"
    assert order(schedule, 2) == "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3"


def test_interleaved_zb_warms_up_by_one_forward_per_hop() -> None:
    schedule = generate("interleaved-zb", interleaved(2, 2), 4)
    assert order(schedule, 0) == ("0F0 0F1 2F0 2F1 2B0 2W0 0F2 2B1 2W1 0F3 0B0 0W0 2F2 0B1 "
                                  "0W1 2F3 2B2 2W2 2B3 2W3 0B2 0W2 0B3 0W3")
    assert order(schedule, 1) == ("1F0 1F1 3F0 3B0 3F1 3B1 3W0 1F2 1B0 3W1 1F3 1B1 1W0 3F2 "
                                  "3B2 1W1 3F3 3B3 3W2 1B2 3W3 1B3 1W2 1W3")


@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_h1_keeps_1f1b_in_flight_bound(p: int, m: int) -> None:
    # activations live from F to W: at most p microbatches on every rank, as 1F1B
    schedule = generate("zb-h1", straight(p), m)
    for rank in range(p):
        live = peak = 0
        for action in schedule.actions[rank]:
            live += {Kind.F: 1, Kind.W: -1}.get(action.kind, 0)
            peak = max(peak, live)
        assert peak == min(p, m)


@pytest.mark.parametrize(("name", "p", "v", "m"), [
    ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 3, 2, 6), ("interleaved-1f1b", 4, 3, 8),
    ("interleaved-1f1b", 4, 2, 2), ("interleaved-1f1b", 2, 3, 1), ("interleaved-zb", 2, 2, 8),
    ("interleaved-zb", 3, 3, 3), ("interleaved-zb", 4, 2, 3), ("zb-h1", 5, 1, 3),
    ("zb-h1", 2, 1, 7)])
def test_new_schedules_are_valid_when_lowered(name: str, p: int, v: int, m: int) -> None:
    compute = generate(name, interleaved(p, v), m)
    validate(compute)
    validate(lower(compute))


@pytest.mark.parametrize(("name", "ranks", "m", "match"), [
    ("interleaved-1f1b", [[0], [1], [1], [0]], 4, r"chunk c goes to the rank of chunk c mod p"),
    ("interleaved-1f1b", [[0], [1]], 4, "at least 2 chunks per rank"),
    ("interleaved-1f1b", [[0], [0]], 4, "at least 2 ranks"),
    ("interleaved-1f1b", [[0, 1], [2], [0, 1], [2]], 4, "run every stage on one worker"),
    ("interleaved-1f1b", [[0], [1], [2], [0], [1], [2]], 7, "use a multiple of 3"),
    ("zb-h1", [[0], [1], [0], [1]], 4, "use 'interleaved-zb'"),
    ("zb-h1", [[0, 1], [2]], 4, "one worker"),
    ("1f1b-flush", [[0], [1], [0], [1]], 4, "a worker runs one stage"),
])
def test_placements_that_do_not_fit_the_schedule(name: str, ranks: list[list[int]], m: int,
                                                 match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        generate(name, ranks, m)


def test_recompute_travels_in_the_options() -> None:
    schedule = lower(generate("zb-h1", straight(3), 4, recompute=[2, 0]))
    assert schedule.options["recompute"] == [0, 2]
    with pytest.raises(ScheduleError, match=r"stages 0..2"):
        generate("1f1b-flush", straight(3), 4, recompute=[3])
