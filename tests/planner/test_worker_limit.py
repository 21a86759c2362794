"""Clusters too large to plan are refused at once, in one line (planner/search.py,
`MOST_WORKERS`): a cluster of 10^12 workers raised MemoryError, 1000x1000 planned for minutes.
At the limit the planner still plans."""

from __future__ import annotations

import pytest

import pdcompile
from pdcompile.errors import PlanError
from pdcompile.planner import MOST_MIXED_WORKERS, MOST_WORKERS, price_plan
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


def test_a_mixed_cluster_beyond_its_limit_is_refused_in_one_line() -> None:
    """A mixed cluster plans for far longer per worker (VGG-16 on 64 mixed workers took 476 s
    before its descents were bounded); beyond MOST_MIXED_WORKERS it is refused at once, and a
    plan made by hand is still priced on it."""
    half = (MOST_MIXED_WORKERS + 2) // 2
    cluster = pdcompile.Cluster.parse(f"{2 * half}@1e10:a100*{half},v100*{half}")
    assert cluster.workers > MOST_MIXED_WORKERS and cluster.is_mixed
    graph = load_pipedream("alexnet")
    with pytest.raises(PlanError, match=f"mixed clusters of at most {MOST_MIXED_WORKERS} "
                                        "workers") as err:
        pdcompile.plan(graph, cluster)
    assert "\n" not in str(err.value) and f"{2 * half} workers" in str(err.value)
    priced = price_plan(graph, pdcompile.plan(graph, "2"), cluster)
    assert priced.time_per_minibatch > 0


def test_the_cli_refuses_a_mixed_cluster_beyond_its_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.cli import main

    half = (MOST_MIXED_WORKERS + 2) // 2
    status = main(["plan", "--profile", "alexnet", "--cluster",
                   f"{2 * half}@1e10:a100*{half},v100*{half}"])
    err = capsys.readouterr().err
    assert status != 0 and "Traceback" not in err
    assert f"mixed clusters of at most {MOST_MIXED_WORKERS} workers" in err
