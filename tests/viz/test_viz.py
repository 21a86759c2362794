"""Gantt charts (PNG, SVG) and Chrome traces of simulated and recorded timelines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcompile.backends.simulate import simulate
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.generators import generate
from pdcompile.schedule.ir import Kind
from pdcompile.schedule.lower import lower
from pdcompile.timeline import Event, Timeline
from pdcompile.viz.chrome_trace import to_chrome_trace, write_chrome_trace
from pdcompile.viz.gantt import draw_gantt


def simulated(name: str = "1f1b", ranks: list[list[int]] | None = None, m: int = 8) -> tuple:
    ranks = ranks or [[0, 1], [2], [3]]
    schedule = lower(generate(name, ranks, m))
    p = len(ranks)
    costs = StageCosts((2.0,) + (1.0,) * (p - 1), (4.0,) + (2.0,) * (p - 1), params=(1e6,) * p,
                       edges={(s, s + 1): 1e5 for s in range(p - 1)})
    return schedule, simulate(schedule, costs, Cluster.preset("A"))


def test_gantt_png_and_svg(tmp_path: Path) -> None:
    schedule, result = simulated()
    png, svg = tmp_path / "g.png", tmp_path / "g.svg"
    bars = draw_gantt(result.timeline, [png, svg], stage_of_rank={0: 0, 1: 0, 2: 1, 3: 2})
    drawn = (Kind.F, Kind.B, Kind.ALLREDUCE, Kind.STEP)
    for rank, actions in schedule.actions.items():
        assert bars[rank] == sum(1 for a in actions if a.kind in drawn)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_gantt_of_a_measured_timeline(tmp_path: Path) -> None:
    line = Timeline([Event(0, "0F0", 0.0, 1.0), Event(1, "1F0", 1.0, 2.0),
                     Event(1, "1B0", 2.0, 4.0), Event(0, "0RECV_B0<-1", 1.0, 4.0),
                     Event(0, "0B0", 4.0, 6.0)], "measured")
    bars = draw_gantt(line, tmp_path / "m.png")
    assert bars == {0: 2, 1: 2}


def test_gantt_rejects_bad_requests(tmp_path: Path) -> None:
    _, result = simulated()
    with pytest.raises(PdcompileError, match=r"\.png or \.svg"):
        draw_gantt(result.timeline, tmp_path / "g.pdf")
    with pytest.raises(PdcompileError, match="empty"):
        draw_gantt(Timeline([]), tmp_path / "g.png")


def test_chrome_trace_has_one_event_per_action(tmp_path: Path) -> None:
    schedule, result = simulated("gpipe", [[0], [1, 2]], 4)
    path = write_chrome_trace(result.timeline, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(a) for a in schedule.actions.values())
    assert {e["tid"] for e in complete} == {0, 1, 2}
    names = [e["name"] for e in complete if e["tid"] == 1]
    assert names == [str(a) for a in schedule.actions[1]]
    first = next(e for e in complete if e["name"] == "0F0")
    assert first["ts"] == 0.0 and first["dur"] == pytest.approx(2e6)
    assert first["cat"] == "F" and first["args"] == {"stage": 0, "microbatch": 0}
    threads = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert sorted(e["args"]["name"] for e in threads) == ["worker 0", "worker 1", "worker 2"]
    assert to_chrome_trace(result.timeline)["otherData"]["schedule"] == "gpipe"
