"""The mixed planner's homogeneous sub-plans (each group alone, the cluster as its slowest and at
its mean speed) are planned without CP-SAT under planner="auto" where the homogeneous DP is
exact (planner/mixed.py `seeding`): they are seeds that the mixed planner prices again on the
mixed cluster and descends from, and CP-SAT's runs on them (four on VGG-16 over 8 A100 and 8
V100, 8.9 s of a 21 s planning call) returned the DP's plan each time. Where the DP is not
exact (GNMT's prefixes of one order) CP-SAT still runs: its cut was the seed of GNMT's plan on
mixed-A (12.9 ms; 15.2 without it). planner="ilp" runs CP-SAT on every sub-plan. Held to it:
on small mixed chains the plan without those runs is as fast as the plan with them.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
import pdcompile.planner.ilp as ilp
from pdcompile import Cluster
from pdcompile.plan import Plan, Stage
from pdcompile.planner.mixed import seeding
from tests.helpers.mixed_plans import Block, block_chain, block_lists, fast_and_slow

NETWORKS = ["2x2@1e11,1e9~5us,20us", "4@1e9~5us", "4@1e10~5us"]


def _counting_solves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CP-SAT solves from here on, one entry each."""
    runs: list[int] = []
    solve = ilp.solve

    def counted(*args: object, **kwargs: object) -> object:
        runs.append(1)
        return solve(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ilp, "solve", counted)
    return runs


CHAIN = (1e6, [(6e-3, 2e-3, 3e7, 2e7), (2e-3, 1e-2, 9e7, 3e7), (3e-3, 7e-3, 1e5, 0.0)])


def test_auto_plans_the_sub_plans_without_cp_sat(monkeypatch: pytest.MonkeyPatch) -> None:
    graph, cluster = block_chain(*CHAIN), fast_and_slow("4@1e9~5us", 0.4)
    runs = _counting_solves(monkeypatch)
    auto = pdcompile.plan(graph, cluster, schedule="1f1b")
    assert auto.planner == "mixed"
    assert runs == []  # before: one run per sub-plan (four here)
    exact = pdcompile.plan(graph, cluster, schedule="1f1b", planner="ilp")
    assert len(runs) >= 3  # asked for by name: each group alone and the whole cluster
    assert auto.time_per_minibatch <= exact.time_per_minibatch * (1 + 1e-9)


def _fake(status: str, asked: list[str]) -> Callable[..., Plan]:
    """A stand-in for the homogeneous planner: notes the planner it is asked for, returns a plan
    of that `status`."""
    def planner(graph: nx.DiGraph, cluster: Cluster, **options: object) -> Plan:
        asked.append(str(options.get("planner", "auto")))
        return Plan(stages=(Stage(("x",), 1, (0,)),), time_per_minibatch=1.0, dp_time=1.0,
                    workers=1, status=status)

    return planner


@pytest.mark.parametrize(("status", "planner", "calls"), [
    ("OPTIMAL", "auto", ["dp"]),  # the DP is exact: no CP-SAT run
    ("HEURISTIC", "auto", ["dp", "auto"]),  # it is not: "auto" with its CP-SAT run
    ("OPTIMAL", "ilp", ["ilp"]),  # asked for by name
    ("HEURISTIC", "dp", ["dp"])])
def test_cp_sat_runs_on_a_sub_plan_only_where_the_dp_is_not_exact(
        status: str, planner: str, calls: list[str]) -> None:
    asked: list[str] = []
    seeding(_fake(status, asked))(nx.DiGraph(), Cluster.parse("4@1e9"), planner=planner)
    assert asked == calls


blocks = block_lists(4)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=st.floats(1e5, 1e7), blocks=blocks, slow=st.sampled_from([0.4, 0.6]),
       network=st.sampled_from(NETWORKS))
def test_leaving_cp_sat_out_of_the_sub_plans_loses_nothing(
        source: float, blocks: list[Block], slow: float, network: str) -> None:
    """CP-SAT solves these sub-plans to optimality (planner="ilp"); the mixed plan built from
    the DP's sub-plans is never slower."""
    graph, cluster = block_chain(source, blocks), fast_and_slow(network, slow)
    auto = pdcompile.plan(graph, cluster, schedule="1f1b")
    exact = pdcompile.plan(graph, cluster, schedule="1f1b", planner="ilp")
    assert auto.time_per_minibatch <= exact.time_per_minibatch * (1 + 1e-9), (
        f"{auto.config} on {[s.ranks for s in auto.stages]} at "
        f"{auto.time_per_minibatch * 1e3:.3f} ms against {exact.config} on "
        f"{[s.ranks for s in exact.stages]} at {exact.time_per_minibatch * 1e3:.3f} ms")
