"""`pdcompile run`'s last line after a failed run, from the files the torchrun agent and the
workers leave (report: a list of failed workers or {"error": ...}; cause.json: {"rank", "reason"}).
They are read back from disk, so any JSON may be there: a list of numbers, entries without a
rank, a time given as text raised AttributeError / KeyError / TypeError instead of a line."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.cli.run_cmd import _failure_line

GENERIC = ("the distributed run failed (torchrun exit code 1); the workers' errors are above")

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["rank", "exitcode", "signal", "time", "error",
                                       "reason", "pid"]) | st.text(max_size=4), inner,
                      max_size=5),
    max_leaves=12)

# what the agent writes for each failed worker (backends/torchrun_agent.py)
_worker = st.fixed_dictionaries({
    "rank": st.integers(0, 64), "exitcode": st.integers(-15, 255),
    "pid": st.integers(1, 2**22),
    "signal": st.none() | st.sampled_from(["SIGTERM", "SIGKILL", "SIGSEGV"]),
    "time": st.integers(0, 2**31)})


def _line(report: Any, cause: Any = None, *, raw: str | None = None) -> str:
    """`_failure_line` of a report holding `report` as JSON (or the text `raw`), with a
    cause.json holding `cause` beside it where `cause` is not None."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "failures.json"
        path.write_text(raw if raw is not None else json.dumps(report))
        if cause is not None:
            (Path(tmp) / "cause.json").write_text(json.dumps(cause))
        return _failure_line(path, 1)


@settings(max_examples=300, deadline=None)
@given(report=_json, cause=st.none() | _json | st.fixed_dictionaries(
    {"rank": st.integers(0, 8), "reason": st.text(max_size=8)}))
def test_any_json_in_the_files_gives_one_line(report: Any, cause: Any) -> None:
    line = _line(report, cause)
    assert isinstance(line, str) and line.strip()


@settings(max_examples=100, deadline=None)
@given(st.lists(_worker, min_size=1, max_size=6))
def test_the_agents_failures_name_the_first_rank_that_failed(failures: list[dict[str, Any]]
                                                              ) -> None:
    causes = [f for f in failures if f["signal"] != "SIGTERM"] or failures
    first = min(causes, key=lambda f: (f["time"], f["rank"]))
    how = (f"rank {first['rank']} was killed by {first['signal']}" if first["signal"]
           else f"rank {first['rank']} exited with code {first['exitcode']}")
    line = _line(failures)
    assert line.startswith(f"the distributed run failed: {how} first"), line
    stopped = len(failures) - len(causes)
    assert (f"({stopped} other" in line) == (stopped > 0), line


def test_the_well_formed_files_give_their_own_lines() -> None:
    killed = [{"rank": 1, "exitcode": -9, "pid": 5, "signal": "SIGKILL", "time": 20},
              {"rank": 0, "exitcode": -15, "pid": 4, "signal": "SIGTERM", "time": 21}]
    assert _line(killed) == ("the distributed run failed: rank 1 was killed by SIGKILL first "
                             "(1 other stopped); the workers' messages are above")
    assert _line({"error": "port 29500 is taken; pass --master-port"}) == \
        "port 29500 is taken; pass --master-port"
    assert _line(killed, {"rank": 1, "reason": "stopped responding for 8.0 s"}) == (
        "the distributed run failed: rank 1 stopped responding for 8.0 s; the workers' "
        "messages are above")


def test_files_of_another_shape_give_the_generic_line() -> None:
    for report in ([1, 2], [], {}, {"error": None}, {"error": ""}, [{"rank": 0}],
                   [{"exitcode": 1}], [{"rank": 0, "exitcode": 1, "time": "soon"}],
                   [{"rank": 0, "exitcode": 1}, {"rank": "1", "exitcode": 1}],
                   [{"rank": 0, "signal": 9}], "failed", None, 3.5):
        assert _line(report) == GENERIC, report
    assert _line(None, raw="[" * 100_000) == GENERIC  # deeper than json's parser goes
    assert _line(None, raw="not json") == GENERIC
    assert _line([{"rank": 0, "exitcode": 1}], {"rank": float("inf"), "reason": "x"}) == (
        "the distributed run failed: rank 0 exited with code 1 first; the workers' messages "
        "are above")


def _line_within(seconds: float, build: Any) -> str | None:
    """`_failure_line` of the report `build(folder)` leaves, or None where it did not return
    within `seconds` (the reader is then released by opening the FIFO's other end)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "failures.json"
        build(report)
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(_failure_line(report, 1)),
                                  daemon=True)
        reader.start()
        reader.join(seconds)
        if reader.is_alive():  # blocked opening a FIFO: give it a writer that closes at once
            for fifo in (report, report.with_name("cause.json")):
                if fifo.is_fifo():
                    with contextlib.suppress(OSError):
                        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(seconds)
            return None
        return found[0]


def test_a_fifo_in_place_of_either_file_gives_the_generic_line_without_waiting() -> None:
    assert _line_within(10, lambda report: os.mkfifo(report)) == GENERIC

    def fifo_cause(report: Path) -> None:
        report.write_text(json.dumps([{"rank": 0, "exitcode": 1, "pid": 3, "signal": None,
                                       "time": 1}]))
        os.mkfifo(report.with_name("cause.json"))
    assert _line_within(10, fifo_cause) == (
        "the distributed run failed: rank 0 exited with code 1 first; the workers' messages "
        "are above")

