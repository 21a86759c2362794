"""A chunked schedule (interleaved, zero bubble, V) runs every stage on one worker; a plan that
replicates a stage under one is refused by `price_plan`, naming the stages and the schedules
that replicate. Before, the closed form priced such a plan anyway: data parallelism over 4
workers under zb-h1 at 0 s a minibatch (a negative path clamped by the interfaces' bound), over
2 at 15.6 ms where one microbatch of its share takes 23.4 ms, so the planner compared plans
that cannot run against ones that can."""

from __future__ import annotations

import networkx as nx
import pytest

from pdcompile.cost.costgraph import topological_order
from pdcompile.errors import PlanError
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan
from pdcompile.schedule.kinds import KINDS


def _chain() -> nx.DiGraph:
    graph = nx.DiGraph()
    for name, fwd, bwd in (("x", 0.0, 0.0), ("n0", 2**-7, 2**-6), ("n1", 2**-7, 2**-6)):
        graph.add_node(name, fwd=fwd, bwd=bwd, act=1e5, params=0.0, keep=1e5, label="",
                       members=[name])
    graph.add_edges_from([("x", "n0"), ("n0", "n1")])
    return graph


def _data_parallel(graph: nx.DiGraph, workers: int, schedule: str) -> Plan:
    ranks = tuple(range(workers))
    return Plan(stages=(Stage(tuple(topological_order(graph)), workers, ranks),),
                time_per_minibatch=0.0, dp_time=0.0, workers=workers, schedule=schedule,
                microbatches=4)


@pytest.mark.parametrize("schedule", [n for n, row in KINDS.items() if row.chunked])
def test_a_replicated_stage_under_a_chunked_schedule_is_refused(schedule: str) -> None:
    graph = _chain()
    with pytest.raises(PlanError, match=rf"stages \[0\] have several replicas; '{schedule}' "
                                        r"runs every stage on one worker"):
        price_plan(graph, _data_parallel(graph, 4, schedule), "4@1e8")


@pytest.mark.parametrize("schedule", [n for n, row in KINDS.items() if not row.chunked])
def test_replicas_are_priced_under_the_schedules_that_replicate(schedule: str) -> None:
    """Four replicas of the whole chain: each does a quarter of the work (a microbatch of
    four, or under 1f1b every fourth minibatch), and the price is not below that."""
    graph = _chain()
    priced = price_plan(graph, _data_parallel(graph, 4, schedule), "4@1e8")
    one = sum(graph.nodes[n]["fwd"] + graph.nodes[n]["bwd"] for n in graph)
    assert priced.time_per_minibatch >= one / 4 * (1 - 1e-9)
