"""A candidate's stage costs are summed once per pricing (planner/search.py `_priced`).

The stages' costs (`costmodel.plan_costs`: a pass over every node and edge) are the same for
every in-flight count and recomputation tried on one cut, and for its price. The planner's
walks price thousands of cuts, and summed each two to three times: choosing recomputation,
pricing, and the walk's lower bound before (densenet121 on cluster A, auto: 18,481 sums for
6,972 prices, a quarter of planning). The price must not change for it.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdcompile import Cluster
from pdcompile.cost.costgraph import topological_order
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.planner.costmodel import ModelOptions, plan_costs
from pdcompile.planner.search import _priced
from pdcompile.profiles import load_pipedream


def _sums(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each `StageCosts.from_assignment`."""
    made: list[int] = []
    original = StageCosts.from_assignment.__func__  # type: ignore[attr-defined]

    def counted(cls: type[StageCosts], *args: Any, **kwargs: Any) -> StageCosts:
        made.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(StageCosts, "from_assignment", classmethod(counted))
    return made


@pytest.mark.parametrize("schedule, limit", [("1f1b", 16 * 2**30), ("1f1b-flush", None),
                                             ("gpipe", 16 * 2**30)])
def test_pricing_a_cut_sums_its_stages_once(monkeypatch: pytest.MonkeyPatch, schedule: str,
                                            limit: float | None) -> None:
    graph = load_pipedream("vgg16")
    nodes = topological_order(graph)
    cut = len(nodes) * 2 // 3
    stages = [(nodes[:cut], tuple(range(12))), (nodes[cut:], (12, 13, 14, 15))]
    options = ModelOptions(schedule=schedule, microbatches=16)
    cluster = Cluster.parse("A")
    given = _priced(graph, cluster, stages, options, limit,
                    costs=plan_costs(graph, stages, options=options))
    made = _sums(monkeypatch)
    found = _priced(graph, cluster, stages, options, limit)
    assert found is not None and given is not None
    assert len(made) == 1  # was 2: choosing recomputation, then the price
    assert (found.closed, found.bound) == (given.closed, given.bound)
    assert [(s.in_flight, s.recompute, s.memory) for s in found.priced] == \
        [(s.in_flight, s.recompute, s.memory) for s in given.priced]
