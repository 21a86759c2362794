"""The planner never returns a plan the simulator refused: where every candidate it chose to
simulate fails (depths that cannot run), it simulates the next ones by the closed form until one
runs (planner/search.py, `_choose`). It returned the closed form's best, the refused one."""

from __future__ import annotations

from typing import Any

import pytest

import pdcompile
import pdcompile.planner.search as search
from pdcompile.errors import ScheduleError
from pdcompile.planner.simulation import simulate_steady
from pdcompile.profiles import load_pipedream


def test_a_refused_choice_is_replaced_by_the_next_plan_that_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    graph = load_pipedream("alexnet")
    simulated: list[str] = []
    monkeypatch.setattr(search, "simulate_steady",
                        lambda g, p, c, **options: simulated.append(p.config)
                        or simulate_steady(g, p, c, **options))
    pdcompile.plan(graph, "4x4", planner="dp")
    refused = set(simulated)  # every plan the planner simulates by choice
    assert refused

    def refusing(g: Any, p: Any, c: Any, **options: Any) -> Any:
        if p.config in refused:
            raise ScheduleError(f"plan {p.config}: its depths cannot run")
        return simulate_steady(g, p, c, **options)

    monkeypatch.setattr(search, "simulate_steady", refusing)
    chosen = pdcompile.plan(graph, "4x4", planner="dp")
    assert chosen.config not in refused
    _, result = simulate_steady(graph, chosen, pdcompile.Cluster.parse("4x4"))
    assert chosen.time_per_minibatch == pytest.approx(result.time_per_minibatch)
