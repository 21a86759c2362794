"""A timeline recorded by a real 2-process run of the distributed backend: one event per
executed action, drawn and compared by the same code as a simulated one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pdcompile
from pdcompile.backends.simulate import simulate
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.ir import Kind
from pdcompile.viz.chrome_trace import to_chrome_trace
from pdcompile.viz.compare import compare
from pdcompile.viz.gantt import draw_gantt
from pdcompile.worker import train_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
STEPS = 6


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same minibatches in every process (module level: picklable)."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(STEPS)]


def test_two_process_run_records_one_event_per_action(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y = batches()[0]
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y, stages=2,
                             loss_fn=torch.nn.functional.cross_entropy)
    pipe.export(str(tmp_path / "pipe"))
    run = train_processes(tmp_path / "pipe", 2, batches, steps=STEPS, record=True, timeout=180,
                          fault_timeout=10)
    measured = run.timeline
    assert measured is not None and measured.source == "measured"
    schedule = pipe.schedule(STEPS)
    # every executed action is one event, in the order of the lowered schedule, on its rank
    measured.check_schedule(schedule)
    assert len(measured.events) == sum(len(a) for a in schedule.actions.values())
    assert measured.ranks == [0, 1]
    assert all(e.end >= e.start >= 0.0 for e in measured.events)
    assert measured.meta["schedule"] == "1f1b" and measured.meta["backend"] == "distributed"
    assert measured.meta["clock"] == "barrier"  # ranks aligned on their common barrier
    # the same drawing code as for a simulation
    bars = draw_gantt(measured, tmp_path / "measured.png")
    drawn = (Kind.F, Kind.B, Kind.ALLREDUCE, Kind.STEP)
    for rank, actions in schedule.actions.items():
        assert bars[rank] == sum(1 for a in actions if a.kind in drawn)
    trace = json.loads(json.dumps(to_chrome_trace(measured)))
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(measured.events)
    # and the same figures: predicted against measured
    predicted = simulate(schedule, StageCosts.uniform(2, fwd=1e-3, bwd=2e-3),
                         Cluster.flat(2, 1e9)).timeline
    result = compare(predicted, measured)
    assert result.time_per_minibatch.measured > 0
    assert result.figure("stage 1 backward").measured > 0
    assert "stage 0 receive wait" in result.table()
