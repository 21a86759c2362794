"""The schedule IR: actions print and parse, schedules round-trip through text, the grid."""

from __future__ import annotations

import pytest

from pdcompile.errors import ScheduleError
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Action, Kind, Schedule, parse_action
from pdcompile.schedule.lower import lower


@pytest.mark.parametrize("text", ["1F3", "0B12", "0SEND_F3->1", "1RECV_F3<-0", "1SEND_B3->0",
                                  "0RECV_B3<-1", "2ALLREDUCE3", "2STEP3", "4W0"])
def test_action_round_trip(text: str) -> None:
    assert str(parse_action(text)) == text


def test_action_fields() -> None:
    assert parse_action("0SEND_F3->2") == Action(0, Kind.SEND_F, 3, 2)
    assert str(Action(1, Kind.RECV_B, 3, 2)) == "1RECV_B3<-2"


@pytest.mark.parametrize("bad", ["F3", "1X3", "0SEND_F3<-1", "1RECV_F3->0", ""])
def test_bad_action_is_reported(bad: str) -> None:
    with pytest.raises(ScheduleError):
        parse_action(bad)


def test_schedule_text_round_trip_keeps_options() -> None:
    schedule = lower(generate("1f1b", [[0, 1], [2]], 4, vertical_sync=True))
    text = schedule.to_text()
    assert text.startswith("# schedule 1f1b microbatches=4 stages=0,1;2 options=")
    back = Schedule.from_text(text)
    assert back == schedule
    assert back.options["vertical_sync"] is True


def test_rank_of_is_round_robin() -> None:
    schedule = generate("1f1b", [[0, 1, 2], [3]], 6)
    assert [schedule.rank_of(0, m) for m in range(6)] == [0, 1, 2, 0, 1, 2]
    assert schedule.stage_of_rank(3) == 1
    with pytest.raises(ScheduleError, match="rank 9"):
        schedule.stage_of_rank(9)


def test_grid_marks_the_step() -> None:
    schedule = generate("gpipe", [[0], [1]], 2)
    grid = schedule.grid(mark={1: 2})
    lines = grid.splitlines()
    assert lines[0].split("|")[1].split() == ["0", "1", "2", "3"]
    assert ">1B1<" in lines[2] and ">" not in lines[1]
    assert lines[1].split("|")[1].split() == ["0F0", "0F1", "0B1", "0B0"]


def test_grid_window_for_long_schedules() -> None:
    schedule = lower(generate("1f1b", [[0], [1]], 50))
    grid = schedule.grid(mark={0: 100}, window=3)
    assert "..." in grid
    assert len(grid.splitlines()[1].split("|")[1].split()) <= 9
