"""Clusters too large to plan are refused at once, in one line (planner/search.py,
`MOST_WORKERS`): a cluster of 10^12 workers raised MemoryError, 1000x1000 planned for minutes.
At the limit the planner still plans."""

from __future__ import annotations

import pytest

import pdcompile
from pdcompile.errors import PlanError
from pdcompile.planner import MOST_WORKERS, price_plan
from pdcompile.profiles import load_pipedream


@pytest.mark.parametrize("cluster", ["1000000x1000000", "1000001", "1001x1000"])
def test_a_cluster_beyond_the_limit_is_refused_in_one_line(cluster: str) -> None:
    graph = load_pipedream("alexnet")
    with pytest.raises(PlanError, match=f"plans and prices at most {MOST_WORKERS:,}") as err:
        pdcompile.plan(graph, cluster)
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="at most"):
        price_plan(graph, pdcompile.plan(graph, "2"), pdcompile.Cluster.parse(cluster))


def test_the_cli_refuses_it_with_exit_status_and_no_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    status = main(["plan", "--profile", "alexnet", "--cluster", "1000000x1000000"])
    err = capsys.readouterr().err
    assert status != 0 and "Traceback" not in err and "at most 1,000,000" in err


def test_a_cluster_at_the_limit_is_planned() -> None:
    assert pdcompile.Cluster.parse("1000x1000").workers == MOST_WORKERS  # at the limit
    plan = pdcompile.plan(load_pipedream("alexnet"), "1000x1000", planner="dp")
    assert plan.workers <= MOST_WORKERS and plan.time_per_minibatch > 0
