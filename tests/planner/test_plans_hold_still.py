"""Plans that hold still: CP-SAT is bounded by deterministic time on one worker with a fixed
seed, so the same inputs give the same plan whatever the load; and a plan's reported time is
the simulator's steady state, the figure `pdcompile simulate` reports for it too."""

from __future__ import annotations

from typing import Any

import pytest

import pdcompile
from pdcompile import Cluster
from pdcompile.planner import ilp
from pdcompile.planner.simulation import simulate_plan, simulate_steady
from pdcompile.profiles import load_pipedream


def test_cp_sat_is_bounded_by_deterministic_time_on_one_seeded_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ortools.sat.python import cp_model

    seen: list[Any] = []
    original = cp_model.CpSolver

    class Recording(original):  # type: ignore[misc, valid-type]
        def solve(self, model: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(self.parameters)
            return super().solve(model, *args, **kwargs)

    monkeypatch.setattr(cp_model, "CpSolver", Recording)
    graph = load_pipedream("alexnet")
    first = pdcompile.plan(graph, "4@1e9", planner="ilp", time_limit=0.5, simulate=False)
    again = pdcompile.plan(graph, "4@1e9", planner="ilp", time_limit=0.5, simulate=False)
    assert seen, "CP-SAT did not run"
    for params in seen:
        assert params.max_deterministic_time == pytest.approx(0.5)
        assert params.num_workers == ilp.ILP_WORKERS == 1
        assert params.random_seed == ilp.ILP_SEED
        # the wall clock is only a guard, far beyond the deterministic bound
        assert params.max_time_in_seconds >= ilp.WALL_GUARD * 0.5
    assert [s.nodes for s in first.stages] == [s.nodes for s in again.stages]
    assert [s.ranks for s in first.stages] == [s.ranks for s in again.stages]


def test_simulate_reports_the_steady_state_the_planner_reports() -> None:
    graph = load_pipedream("alexnet")
    cluster = Cluster.preset("A")
    chosen = pdcompile.plan(graph, cluster, planner="dp", schedule="1f1b")
    _, steady = simulate_steady(graph, chosen, cluster)
    _, shown = simulate_plan(graph, chosen, cluster, timeline=False)  # what the CLI runs
    assert shown.time_per_minibatch == pytest.approx(steady.time_per_minibatch)
    assert chosen.time_per_minibatch == pytest.approx(steady.time_per_minibatch)
