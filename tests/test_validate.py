"""validate() accepts every generated schedule and catches hand-made broken ones with the grid."""

from __future__ import annotations

import itertools

import pytest

from pdcompile.errors import ScheduleError
from pdcompile.ir import Schedule, parse_action
from pdcompile.passes.lower import lower
from pdcompile.passes.schedule import generate
from pdcompile.validate import validate

SHAPES = [[1], [1, 1], [2, 1], [1, 2], [1, 1, 1], [3, 1, 2], [1, 1, 1, 1], [2, 2, 2, 1]]


def ranks_of(replicas: list[int]) -> list[list[int]]:
    out, next_rank = [], 0
    for r in replicas:
        out.append(list(range(next_rank, next_rank + r)))
        next_rank += r
    return out


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe", "2bw"])
@pytest.mark.parametrize("replicas", SHAPES, ids=lambda r: "-".join(map(str, r)))
def test_every_generated_schedule_is_valid(name: str, replicas: list[int]) -> None:
    ranks = ranks_of(replicas)
    for m in (1, 2, 3, 4, 6, 8, 12):
        mpm = None
        if name == "2bw":
            mpm = m
            if any(m % r for r in replicas):
                continue
            m = 2 * m  # two minibatches of mpm
        elif name == "1f1b" and any(m % r for r in replicas):
            continue
        compute = generate(name, ranks, m, microbatches_per_minibatch=mpm)
        validate(compute)
        validate(lower(compute))


def make(text: str, name: str = "1f1b-flush", m: int = 2, stages: str = "0;1") -> Schedule:
    return Schedule.from_text(f"# schedule {name} microbatches={m} stages={stages}\n{text}")


def assert_rejected(schedule: Schedule, match: str, marked: str) -> str:
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    message = str(info.value)
    assert f">{marked}<" in message, message  # the grid marks the failing step
    assert "rank 0 |" in message
    return message


def test_missing_backward() -> None:
    assert_rejected(make("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1"), "1B1 is missing", "~")


def test_duplicated_forward() -> None:
    assert_rejected(make("rank 0: 0F0 0F1 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1"),
                    "0F1 runs 2 times", "0F1")


def test_wrong_replica() -> None:
    bad = make("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0\nrank 2: 1F1 1B1", stages="0;1,2")
    validate(bad)
    swapped = make("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F1 1B1\nrank 2: 1F0 1B0", stages="0;1,2")
    assert_rejected(swapped, "1F0 runs on rank 2, but .* belongs to rank 1", "1F0")


def test_backward_before_forward() -> None:
    assert_rejected(make("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B1 1B0 1F1"),
                    "1B1 comes before 1F1", "1B1")


def test_action_of_another_stage() -> None:
    assert_rejected(make("rank 0: 0F0 0F1 0B0 1B1\nrank 1: 1F0 1B0 1F1 1B1"),
                    "rank 0 runs stage 0 but step 3 is 1B1", "1B1")


def test_compute_only_deadlock_names_who_waits_for_whom() -> None:
    message = assert_rejected(make("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1"),
                              "deadlocks", "0B0")
    assert "rank 0 step 1 0B0 waits for 1B0 (rank 1 step 2)" in message
    assert "rank 1 step 1 1F1 waits for 0F1 (rank 0 step 2)" in message
    assert ">1F1<" in message


def test_lowered_deadlock() -> None:
    compute = make("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1")
    lowered = lower(compute)
    assert_rejected(lowered, "deadlocks", "0RECV_B0<-1")


def test_send_without_receive() -> None:
    lowered = lower(generate("gpipe", [[0], [1]], 2))
    actions = dict(lowered.actions)
    actions[1] = tuple(a for a in actions[1] if str(a) != "1RECV_F1<-0")
    broken = Schedule(lowered.name, 2, lowered.stage_ranks, actions, lowered.options)
    assert_rejected(broken, "1 send\\(s\\) but 0 receive", "0SEND_F1->1")


def test_receive_without_send() -> None:
    lowered = lower(generate("gpipe", [[0], [1]], 2))
    actions = dict(lowered.actions)
    actions[0] = tuple(a for a in actions[0] if str(a) != "0SEND_F1->1")
    broken = Schedule(lowered.name, 2, lowered.stage_ranks, actions, lowered.options)
    assert_rejected(broken, r"0 send\(s\) but 1 receive", "1RECV_F1<-0")


def test_transfer_on_the_wrong_side_of_compute() -> None:
    lowered = lower(generate("gpipe", [[0], [1]], 1))
    row = list(lowered.actions[1])
    assert [str(a) for a in row[:2]] == ["1RECV_F0<-0", "1F0"]
    row[0], row[1] = row[1], row[0]
    broken = Schedule(lowered.name, 1, lowered.stage_ranks, {0: lowered.actions[0], 1: tuple(row)},
                      lowered.options)
    assert_rejected(broken, "1RECV_F0<-0 must come before 1F0", "1RECV_F0<-0")


def test_allreduce_order_mismatch_deadlocks() -> None:
    lowered = lower(generate("1f1b", [[0, 1], [2]], 4))
    row = list(lowered.actions[1])
    first = [i for i, a in enumerate(row) if str(a) == "0ALLREDUCE0"][0]
    second = [i for i, a in enumerate(row) if str(a) == "0ALLREDUCE1"][0]
    row[first], row[second] = row[second], row[first]
    row[first + 1], row[second + 1] = parse_action("0STEP0"), parse_action("0STEP1")
    broken = Schedule(lowered.name, 4, lowered.stage_ranks, {**lowered.actions, 1: tuple(row)},
                      lowered.options)
    assert_rejected(broken, "deadlocks", "0ALLREDUCE1")


def test_step_numbers_count_up() -> None:
    lowered = lower(generate("1f1b", [[0], [1]], 2))
    row = [parse_action("0STEP5") if str(a) == "0STEP1" else a for a in lowered.actions[0]]
    broken = Schedule(lowered.name, 2, lowered.stage_ranks, {**lowered.actions, 0: tuple(row)},
                      lowered.options)
    assert_rejected(broken, "should be number 1", "0STEP5")


def test_grid_of_a_big_schedule_is_windowed() -> None:
    lowered = lower(generate("1f1b", [[0], [1], [2]], 40))
    row = list(lowered.actions[2])
    del row[100]
    broken = Schedule(lowered.name, 40, lowered.stage_ranks, {**lowered.actions, 2: tuple(row)},
                      lowered.options)
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    assert max(len(line) for line in str(info.value).splitlines()) < 600


def test_all_pairs_of_small_straight_pipelines() -> None:
    for stages, m in itertools.product(range(1, 5), range(1, 9)):
        for name in ("1f1b", "1f1b-flush", "gpipe"):
            validate(lower(generate(name, [[s] for s in range(stages)], m)))
