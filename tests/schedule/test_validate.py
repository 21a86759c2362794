"""validate() accepts every generated schedule and catches hand-made broken ones with the grid."""

from __future__ import annotations

import itertools

import pytest

from pdcompile.backends.simulate import prepare
from pdcompile.errors import ScheduleError
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Schedule, parse_action
from pdcompile.schedule.lower import lower
from pdcompile.schedule.validate import validate

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


def test_a_deadlock_left_out_of_validation_is_found_by_the_simulators_preparation() -> None:
    """The planner's search cache validates without the deadlock run (`progress=False`) and
    prepares the schedule for the simulator next, whose execution order (with the W actions
    it adds after stage 1's backward sends) deadlocks where the schedule's does."""
    schedule = lower(make("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1"))
    validate(schedule, progress=False)  # every other check passes
    with pytest.raises(ScheduleError, match="deadlocks"):
        prepare(schedule)
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(schedule)


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


def without(lowered: Schedule, drop: str, ranks: list[int] | None = None) -> Schedule:
    """`lowered` with every action whose text contains `drop` removed (on `ranks`, default all)."""
    actions = {rank: tuple(a for a in row if drop not in str(a)
                           or (ranks is not None and rank not in ranks))
               for rank, row in lowered.actions.items()}
    return Schedule(lowered.name, lowered.microbatches, lowered.stage_ranks, actions,
                    lowered.options)


def with_row(lowered: Schedule, rank: int, row: list[str]) -> Schedule:
    return Schedule(lowered.name, lowered.microbatches, lowered.stage_ranks,
                    {**lowered.actions, rank: tuple(parse_action(a) for a in row)},
                    lowered.options)


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe", "2bw"])
def test_missing_steps(name: str) -> None:
    mpm = 2 if name == "2bw" else None
    lowered = lower(generate(name, [[0], [1]], 4, microbatches_per_minibatch=mpm))
    flush = name in ("1f1b-flush", "gpipe")
    broken = without(lowered, "STEP")
    # flush: the rank's last action; otherwise the backward the update follows
    after = str(broken.actions[0][-1]) if flush else "0B1" if name == "2bw" else "0B0"
    message = assert_rejected(broken, f"weight update 0STEP0 is missing after {after}", after)
    assert "rank 0: weight update" in message
    broken = without(lowered, "STEP", ranks=[1])
    after = str(broken.actions[1][-1]) if flush else "1B1" if name == "2bw" else "1B0"
    assert_rejected(broken, f"weight update 1STEP0 is missing after {after}", after)


def test_missing_last_step_of_1f1b_marks_where_it_belongs() -> None:
    lowered = lower(generate("1f1b", [[0], [1]], 3))
    row = [str(a) for a in lowered.actions[1]]
    assert row[-2:] == ["1SEND_B2->0", "1STEP2"]
    message = assert_rejected(with_row(lowered, 1, row[:-1]),
                              "1STEP2 is missing after 1B2 .* the rank has 2 of 3", "1B2")
    assert "STEP m // 1 after each backward" in message


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe"])
def test_missing_allreduce_on_every_replica(name: str) -> None:
    lowered = lower(generate(name, [[0, 1], [2]], 4))
    validate(lowered)
    assert_rejected(without(lowered, "ALLREDUCE"), r"0STEP0 on a replicated stage \(ranks "
                    r"\[0, 1\]\) needs 0ALLREDUCE0 right before it", "0STEP0")


def test_allreduce_on_a_stage_without_replicas() -> None:
    lowered = lower(generate("gpipe", [[0], [1]], 2))
    row = [str(a) for a in lowered.actions[1]]
    broken = with_row(lowered, 1, row[:-1] + ["1ALLREDUCE0", "1STEP0"])
    assert_rejected(broken, "1ALLREDUCE0 on a stage without replicas", "1ALLREDUCE0")


def test_allreduce_without_its_step() -> None:
    lowered = lower(generate("1f1b-flush", [[0, 1], [2]], 2))
    for rank in (0, 1):
        row = [str(a) for a in lowered.actions[rank]]
        assert row[-2:] == ["0ALLREDUCE0", "0STEP0"]
        lowered = with_row(lowered, rank, row[:-2] + ["0ALLREDUCE1", "0ALLREDUCE0", "0STEP0"])
    assert_rejected(lowered, "0ALLREDUCE1 is not followed by its STEP 1", "0ALLREDUCE1")


@pytest.mark.parametrize("name", ["1f1b-flush", "gpipe"])
def test_extra_step_in_a_flush_schedule(name: str) -> None:
    lowered = lower(generate(name, [[0], [1]], 2))
    row = [str(a) for a in lowered.actions[0]]
    assert_rejected(with_row(lowered, 0, row + ["0STEP1"]), "extra weight update 0STEP1 .*"
                    "one STEP 0 at the end, 1 on this rank", "0STEP1")


def test_extra_step_in_1f1b() -> None:
    lowered = lower(generate("1f1b", [[0], [1]], 2))
    row = [str(a) for a in lowered.actions[1]]
    assert_rejected(with_row(lowered, 1, row + ["1STEP2"]), "extra weight update 1STEP2",
                    "1STEP2")


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "2bw"])
def test_duplicate_step(name: str) -> None:
    mpm = 2 if name == "2bw" else None
    lowered = lower(generate(name, [[0], [1]], 4, microbatches_per_minibatch=mpm))
    row = [str(a) for a in lowered.actions[0]]
    at = row.index("0STEP0")
    broken = with_row(lowered, 0, row[:at + 1] + ["0STEP0"] + row[at + 1:])
    message = assert_rejected(broken, "rank 0: weight update 0STEP0 runs twice", "0STEP0")
    marked = [line for line in message.splitlines() if ">0STEP0<" in line]
    assert marked[0].index(" 0STEP0 ") < marked[0].index(">0STEP0<")  # the second is marked


def test_step_in_the_wrong_place() -> None:
    flush = lower(generate("1f1b-flush", [[0], [1]], 2))
    row = [str(a) for a in flush.actions[0]]
    moved = ["0STEP0"] + row[:-1]
    assert_rejected(with_row(flush, 0, moved), "0STEP0 must be the rank's last action", "0STEP0")
    async_ = lower(generate("1f1b", [[0], [1]], 3))
    row = [str(a) for a in async_.actions[0]]
    at = row.index("0STEP0")
    late = row[:at] + row[at + 1:at + 4] + ["0STEP0"] + row[at + 4:]
    assert any(a[1] == "F" or a[1] == "B" for a in row[at + 1:at + 4])
    assert_rejected(with_row(async_, 0, late), "0STEP0 must follow 0B0 before any other compute",
                    "0STEP0")


def test_1f1b_vertical_sync_and_long_2bw_still_valid() -> None:
    for replicas in SHAPES:
        ranks = ranks_of(replicas)
        validate(lower(generate("1f1b", ranks, 12, vertical_sync=True)))
        validate(lower(generate("2bw", ranks, 24, microbatches_per_minibatch=12)))


# ------------------------------------------------------------------ split backward, chunks
def test_weight_gradient_before_its_backward() -> None:
    text = "rank 0: 0F0 0W0 0B0\nrank 1: 1F0 1B0 1W0"
    assert_rejected(make(text, "zb-h1", 1), "0W0 comes before 0B0", "0W0")


def test_weight_gradient_missing_or_out_of_place() -> None:
    assert_rejected(make("rank 0: 0F0 0B0\nrank 1: 1F0 1B0 1W0", "zb-h1", 1), "0W0 is missing",
                    "~")
    assert_rejected(make("rank 0: 0F0 0B0 0W0\nrank 1: 1F0 1B0"), "does not split the backward",
                    "0W0")


def test_chunk_on_the_wrong_rank() -> None:
    text = "rank 0: 0F0 2F0 2B0 0B0 1B0\nrank 1: 1F0 3F0 3B0"
    message = assert_rejected(make(text, "interleaved-1f1b", 1, "0;1;0;1"),
                              "rank 0 runs stages 0, 2 but step 4 is 1B0", "1B0")
    assert "rank 1 |" in message


def test_each_chunk_of_a_rank_updates_once() -> None:
    lowered = lower(generate("interleaved-1f1b", [[0], [1], [0], [1]], 2))
    text = lowered.to_text().replace(" 0STEP0 2STEP0", " 0STEP0")
    assert_rejected(Schedule.from_text(text), "weight update 2STEP0 is missing", "0STEP0")
