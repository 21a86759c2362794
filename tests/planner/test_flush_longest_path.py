"""The planner prices a flush schedule's minibatch as the simulator runs it.

A flush minibatch is a finite graph of actions whose order per rank the generator fixes and
whose durations the stage costs fix, so its makespan is that graph's longest path
(cost/flush_path.py) and the planner's price is the simulator's figure exactly: on any stage
count, microbatch count, stage times, link sizes and replica counts, flat clusters and two
servers (whose shared network interfaces both bound alike, `server_interface_seconds`), their
ranks of one device or of groups of devices of different speeds. Not covered here: ranks that
outnumber their host's processors (`Level.cores`), where the planner keeps its closed form.
"""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan
from pdcompile.planner.simulation import simulate_plan
from tests.helpers.flush_pipelines import flush_pipelines


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipeline=flush_pipelines())
def test_planner_prices_a_flush_minibatch_as_the_simulator_runs_it(
        pipeline: tuple[nx.DiGraph, Plan, Cluster, str, int]) -> None:
    graph, plan, cluster, schedule, microbatches = pipeline
    priced = price_plan(graph, plan, cluster, schedule=schedule, microbatches=microbatches,
                        memory=1e30, simulate=False)
    _, simulated = simulate_plan(graph, priced, cluster, timeline=False)
    assert "simulated_time_per_minibatch" not in priced.extra  # the planner's own figure
    assert priced.time_per_minibatch == pytest.approx(simulated.time_per_minibatch, rel=1e-9)


def _two_stages(schedule: str, *, fwd: tuple[float, float],
                sent: float) -> tuple[float, float]:
    """(planner's price, simulator's time) of stage 0 on rank 0 feeding two replicas of stage
    1 (ranks 1, 2) at 4 microbatches, backwards twice the forwards, `sent` bytes per
    microbatch each way on a flat 1e9 B/s cluster without latency."""
    graph = new_cost_graph("two")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=0.0, params=0.0)
    # a minibatch's seconds and bytes (the planner's CostGraph): 4 microbatches of them
    add_block(graph, "a", fwd=4 * fwd[0], bwd=8 * fwd[0], act=4 * sent, params=0.0)
    add_block(graph, "b", fwd=4 * fwd[1], bwd=8 * fwd[1], act=0.0, params=0.0)
    graph.add_edge("x", "a")
    graph.add_edge("a", "b")
    plan = Plan(stages=(Stage(("x", "a"), 1, (0,)), Stage(("b",), 2, (1, 2))),
                time_per_minibatch=0.0, dp_time=0.0, workers=3)
    cluster = Cluster.parse("3@1e9~0s")
    priced = price_plan(graph, plan, cluster, schedule=schedule, microbatches=4,
                        memory=1e30, simulate=False)
    _, simulated = simulate_plan(graph, priced, cluster, timeline=False)
    return priced.time_per_minibatch, simulated.time_per_minibatch


def test_1f1b_flush_hides_the_replicas_round_trip_at_four_microbatches() -> None:
    """Stage 0 and the two replicas of stage 1 compute 1 ms forward, 2 ms backward per
    microbatch, links free. Stage 0 computes 4 x 3 ms and each backward it waits for comes
    back while it runs the forward before it: 12 ms, what the simulator runs (the closed form
    charged the replica's round trip again: 14 ms, +16.7%)."""
    priced, simulated = _two_stages("1f1b-flush", fwd=(1e-3, 1e-3), sent=0.0)
    assert simulated == pytest.approx(0.012, rel=1e-9)
    assert priced == pytest.approx(simulated, rel=1e-9)


def test_gpipe_counts_the_transfers_queued_on_each_link_at_four_microbatches() -> None:
    """GPipe, stage 0 at 1 ms forward and 2 ms backward per microbatch, its two replicas of
    stage 1 at 2 ms and 4 ms (half of it weight gradients, after the send), 8 ms to carry a
    microbatch's 8 MB either way. Each replica's link takes its two forwards one after the
    other (the second arrives at 17 and 18 ms), and its two gradients back the same way (at
    29 and 37 ms on one link, 30 and 38 ms on the other), so stage 0's last backwards run at
    38-40 and 40-42 ms: 42 ms, what the simulator runs (the closed form: 39 ms, -7.1%)."""
    priced, simulated = _two_stages("gpipe", fwd=(1e-3, 2e-3), sent=8e6)
    assert simulated == pytest.approx(0.042, rel=1e-9)
    assert priced == pytest.approx(simulated, rel=1e-9)
