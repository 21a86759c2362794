"""Predicted against measured timelines: the figures, the table, and clock alignment."""

from __future__ import annotations

import math

import pytest
import torch

import pdcompile
from pdcompile.backends.simulate import simulate
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.generators import generate
from pdcompile.schedule.lower import lower
from pdcompile.timeline import Event, Recorder, Timeline, TimelineError, stage_figures
from pdcompile.viz.compare import compare

FREE = Cluster.flat(8, 1e30)


def simulated(fwd: tuple[float, ...], bwd: tuple[float, ...], m: int = 16) -> Timeline:
    schedule = lower(generate("1f1b", [[s] for s in range(len(fwd))], m))
    return simulate(schedule, StageCosts(fwd, bwd), FREE).timeline


def test_identical_timelines_have_no_error() -> None:
    line = simulated((1.0, 1.0), (2.0, 2.0))
    result = compare(line, line)
    assert result.error == 0.0
    assert result.time_per_minibatch.predicted == pytest.approx(3.0)
    for stage in (0, 1):
        assert result.figure(f"stage {stage} forward").measured == pytest.approx(1.0)
        assert result.figure(f"stage {stage} backward").measured == pytest.approx(2.0)
        assert result.figure(f"stage {stage} busy").difference == 0.0
    text = result.table()
    assert "time per minibatch" in text and "stage 1 receive wait" in text
    assert result.markdown().count("\n") == len(result.figures) + 1


def test_a_slower_measured_stage_shows_where_the_error_comes_from() -> None:
    predicted = simulated((1.0, 1.0), (2.0, 2.0))
    measured = simulated((1.0, 1.5), (2.0, 3.0))  # stage 1 half again as slow
    result = compare(predicted, measured)
    assert result.error == pytest.approx(3.0 / 4.5 - 1.0)
    assert result.figure("stage 0 forward").error == pytest.approx(0.0)
    assert result.figure("stage 1 forward").error == pytest.approx(1.0 / 1.5 - 1.0)
    # stage 0 waits for the slow stage: its busy share drops, the prediction says 100%
    assert result.figure("stage 0 busy").measured == pytest.approx(3.0 / 4.5, rel=1e-6)
    assert result.figure("stage 0 busy").predicted == pytest.approx(1.0)
    assert result.to_dict()["time per minibatch"]["error"] == pytest.approx(result.error)


def test_stage_figures_count_receive_waits() -> None:
    line = Timeline([Event(0, "0F0", 0.0, 1.0), Event(1, "1RECV_F0<-0", 0.0, 1.0),
                     Event(1, "1F0", 1.0, 2.0), Event(1, "1B0", 2.0, 4.0),
                     Event(0, "0RECV_B0<-1", 1.0, 4.0), Event(0, "0B0", 4.0, 6.0)],
                    "measured", {"schedule": "1f1b"})
    figures = stage_figures(line)
    assert figures[0]["wait"] == pytest.approx(3.0)
    assert figures[1]["wait"] == pytest.approx(1.0)
    assert figures[1]["fwd"] == 1.0 and figures[1]["bwd"] == 2.0


def test_compare_rejects_mismatched_or_empty_timelines() -> None:
    two, three = simulated((1.0, 1.0), (1.0, 1.0)), simulated((1.0,) * 3, (1.0,) * 3)
    with pytest.raises(TimelineError, match="different stages"):
        compare(two, three)
    with pytest.raises(TimelineError, match="measured timeline is empty"):
        compare(two, Timeline([]))


def test_measured_timeline_takes_the_schedule_from_the_prediction() -> None:
    predicted = simulated((1.0, 1.0), (2.0, 2.0))
    bare = Timeline(predicted.events, "measured")  # a recording without meta
    assert compare(predicted, bare).error == pytest.approx(0.0)


def test_merge_aligns_ranks_on_their_clock_references() -> None:
    # two processes whose clocks disagree by 100 s; each took its reference after a barrier
    a, b = Recorder(0, clock=lambda: 0.0), Recorder(1, clock=lambda: 0.0)
    a.set_reference(10.0)
    b.set_reference(110.0)
    a.add("0F0", 11.0, 12.0)
    b.add("1F0", 112.0, 113.0)
    merged = Timeline.merge([a.timeline(), b.timeline()])
    assert merged.meta["clock"] == "barrier"
    assert "clock_reference" not in merged.meta
    starts = {e.action: e.start for e in merged.events}
    assert starts == {"0F0": 0.0, "1F0": 1.0}
    # without references, one shared clock is assumed
    c = Recorder(1)
    c.add("1F0", 112.0, 113.0)
    plain = Timeline.merge([Timeline([Event(0, "0F0", 11.0, 12.0)]), c.timeline()])
    assert plain.meta["clock"] == "shared"
    assert {e.action: e.start for e in plain.events} == {"0F0": 0.0, "1F0": 101.0}
    # a reference that survives a JSON round trip
    again = Timeline.from_json(a.timeline().to_json())
    assert again.clock_references() == {0: 10.0}


def test_local_run_against_its_simulation() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    pipe = pdcompile.compile(model, example_inputs=(x,), stages=2,
                             loss_fn=torch.nn.functional.mse_loss).timed()
    pipe.train([((x,), y)] * 8)
    measured = pipe.last_timeline
    assert measured is not None
    schedule = pipe.schedule(8)
    measured.check_schedule(schedule)
    costs = StageCosts.uniform(2, fwd=1e-4, bwd=2e-4)
    predicted = simulate(schedule, costs, FREE).timeline
    result = compare(predicted, measured)
    assert math.isfinite(result.error)
    assert result.figure("stage 1 forward").measured > 0


def test_stage_figures_fall_back_to_every_action_when_none_starts_in_the_window() -> None:
    # stage 0 sets the steady window (its backwards end each microbatch); stage 1's backwards
    # all start before it, as happens in short runs: their mean, not 0, is the figure
    events = []
    for m in range(8):
        events += [Event(0, f"0F{m}", 10.0 * m, 10.0 * m + 1.0),
                   Event(0, f"0B{m}", 10.0 * m + 5.0, 10.0 * m + 6.0),
                   Event(1, f"1F{m}", 10.0 * m + 1.0, 10.0 * m + 2.0),
                   Event(1, f"1B{m}", 0.1 * m, 0.1 * m + 0.05)]
    line = Timeline(events, "measured", {"schedule": "1f1b"})
    t0, t1, _ = line.steady_window()
    assert not any(t0 <= e.start < t1 for e in events if e.action.startswith("1B"))
    figures = stage_figures(line)
    assert figures[1]["bwd"] == pytest.approx(0.05)
    assert figures[1]["fwd"] == pytest.approx(1.0) and figures[0]["bwd"] == pytest.approx(1.0)
