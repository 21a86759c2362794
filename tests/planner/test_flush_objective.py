"""The 1F1B-flush planning objective charges the links and servers' interfaces it crosses.

A flush of m microbatches puts all of them on a stage's links and on the interface of every
server its replicas send from or receive on; the simulator and the closed form take the larger
of the flush's makespan and the busiest interface's load (`pipeline_time.
server_interface_seconds`). Where each stage holds whole servers, the DP's objective sees that
load exactly, so it never prices a plan below it. Before, the flush objective had no link term:
on cluster A it proposed ResNet-18 12-3-1, 82.2 ms per minibatch on one server's interface
against 12-4 at 41.1 ms.
"""

from __future__ import annotations

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import topological_order
from pdcompile.cost.pipeline_time import server_interface_seconds
from pdcompile.planner.costmodel import ModelOptions, plan_terms, planning_objective, priced_time
from tests.helpers.strategies import drawn_chains

CLUSTER = "2x2@1e10,1e8~5us,20us"  # two servers of two, a slow shared interface between


def chains() -> st.SearchStrategy[nx.DiGraph]:
    return drawn_chains(min_blocks=2)


def _whole_server_plans(graph: nx.DiGraph) -> list[list[tuple[list[str], tuple[int, ...]]]]:
    """Data parallelism over both servers, and every cut with one stage per server."""
    order = topological_order(graph)
    plans = [[(order, (0, 1, 2, 3))]]
    plans += [[(order[:cut], (0, 1)), (order[cut:], (2, 3))] for cut in range(2, len(order))]
    return plans


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(graph=chains(), microbatches=st.sampled_from([4, 8, 16]))
def test_flush_objective_sees_the_interfaces_of_whole_server_stages(
        graph: nx.DiGraph, microbatches: int) -> None:
    cluster = Cluster.parse(CLUSTER)
    options = ModelOptions(schedule="1f1b-flush", microbatches=microbatches)
    for stages in _whole_server_plans(graph):
        built = plan_terms(graph, stages, cluster, options=options)
        shared = server_interface_seconds(dict(built.costs.edges), built.ranks,
                                          built.costs.params, cluster, schedule="1f1b-flush",
                                          microbatches=microbatches) * microbatches
        objective = planning_objective(graph, stages, cluster, options=options)
        assert objective >= shared * (1 - 1e-9)
        # ... and the closed form that ranks the plans takes the same bound
        closed = priced_time(graph, stages, cluster, options=options)
        assert closed.time_per_minibatch >= shared * (1 - 1e-9)



def test_a_stage_that_holds_no_microbatch_is_refused_without_a_numpy_warning() -> None:
    """A flush stage whose memory holds no microbatch (in flight 0) running one microbatch per
    replica priced 0 * inf, NaN, which numpy reported to the user as 'invalid value encountered
    in multiply' while searching how much memory the model needs (the value is refused anyway).
    Found by a random run of tests/planner/test_mixed_planner.py."""
    import warnings

    import pdcompile
    from pdcompile.errors import PlanError
    from pdcompile.machine.device import Device
    from pdcompile.machine.device_groups import DeviceGroup

    graph = nx.DiGraph()
    sizes = [(8.1e-3, 1e-2, 34.9e6, 14.1e6), (6.5e-3, 1.58e-2, 15.6e6, 34.9e6),
             (8.8e-3, 1.68e-2, 24.7e6, 0.2e6), (9.8e-3, 1.87e-2, 24.5e6, 16.2e6)]
    for i, (fwd, bwd, act, params) in enumerate(sizes):
        graph.add_node(f"n{i}", fwd=fwd, bwd=bwd, act=act, params=params, keep=act, label="",
                       members=[f"n{i}"])
    graph.add_edges_from([("n0", "n1"), ("n1", "n2"), ("n2", "n3")])
    graph.add_edge("n0", "n2", bytes=26208.0)
    graph.add_edge("n1", "n3", bytes=1639840.0)
    small, large = Device("d0", 2e8, 1e13, 1e12), Device("d1", 1.9e9, 1e13, 1e12)
    cluster = Cluster(levels=Cluster.parse("4@1e10~5us").levels,
                      groups=(DeviceGroup(small, 2, 1.0), DeviceGroup(large, 2, 1.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            plan = pdcompile.plan(graph, cluster, schedule="1f1b-flush", microbatches=4)
        except PlanError as err:
            assert "memory" in str(err)
        else:
            assert all(s.memory <= cluster.device_of(r).memory * (1 + 1e-9)
                       for s in plan.stages for r in s.ranks)
