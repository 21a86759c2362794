"""The network and memory physics of the paper's clusters (docs/cost-model.md): single-flow
caps, a server's network interface shared by its workers' flows, gradient buckets all-reduced
during the backward, in-place layers that keep nothing."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.links import (
    exposed_allreduce_seconds,
    nic_busy_seconds,
    ring_allreduce_seconds,
    stage_allreduce_seconds,
    transfer_seconds,
)
from pdcompile.machine.cluster import Level
from pdcompile.plan import Plan, Stage
from pdcompile.planner.search import price_plan
from pdcompile.profiles import in_place, load_pipedream

seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
sizes = st.floats(min_value=1.0, max_value=1e10, allow_nan=False)


@given(allreduce=seconds, backward=seconds, params=sizes, bucket=sizes)
def test_exposed_allreduce_is_between_the_last_bucket_and_all_of_it(
        allreduce: float, backward: float, params: float, bucket: float) -> None:
    left = exposed_allreduce_seconds(allreduce, backward=backward, params=params, bucket=bucket)
    assert left <= allreduce * (1 + 1e-12)
    assert left >= allreduce * min(1.0, bucket / params) * (1 - 1e-12)
    # a longer backward hides more, never less
    longer = exposed_allreduce_seconds(allreduce, backward=backward + 1.0, params=params,
                                       bucket=bucket)
    assert longer <= left * (1 + 1e-12)


@given(allreduce=seconds, backward=seconds, params=sizes)
def test_without_buckets_the_whole_allreduce_follows_the_backward(
        allreduce: float, backward: float, params: float) -> None:
    assert exposed_allreduce_seconds(allreduce, backward=backward, params=params,
                                     bucket=None) == allreduce


def test_buckets_finish_one_after_another_on_one_stream() -> None:
    # 4 buckets of 1 s each, produced at 0.5, 1, 1.5, 2 s of a 2 s backward: the stream ends at
    # max(0.5 + 4, 1 + 3, 1.5 + 2, 2 + 1) = 4.5 s, 2.5 s after the backward
    assert math.isclose(exposed_allreduce_seconds(4.0, backward=2.0, params=100.0,
                                                  bucket=25.0), 2.5)
    # a backward long enough leaves only the last bucket
    assert exposed_allreduce_seconds(4.0, backward=100.0, params=100.0, bucket=25.0) == 1.0


def test_a_flow_gets_at_most_its_cap_and_a_ring_hop_its_connections() -> None:
    capped = Level(2, 25e9 / 8, 0.0, flow_bandwidth=5e9 / 8)
    assert capped.flow_rate == 5e9 / 8
    assert transfer_seconds(5e9 / 8, capped) == 1.0
    assert ring_allreduce_seconds(1e9, 2, capped) == 1e9 / (5e9 / 8)
    assert Level(2, 1e9, flow_bandwidth=5e9).flow_rate == 1e9  # the link bounds the flow
    b = Cluster.preset("B")
    # inside a server NVLink; across the two servers a send is one flow at AWS's 5 Gbps, a
    # ring hop NCCL 2.4's two rings (two sockets) at 5 Gbps each
    assert stage_allreduce_seconds(1e9, [0, 1], b) == ring_allreduce_seconds(1e9, 2, b.levels[0])
    assert b.flow_rate_between(0, 8) == 5e9 / 8
    assert stage_allreduce_seconds(1e9, [0, 8], b) == 1e9 / (10e9 / 8) + 2 * b.levels[1].latency


def test_flow_caps_and_buckets_survive_a_cluster_file() -> None:
    b = Cluster.preset("B")
    assert b.allreduce_bucket == 25 * 2**20
    again = Cluster.from_dict(b.to_dict())
    assert again.levels == b.levels and again.allreduce_bucket == b.allreduce_bucket
    assert Cluster.parse("4@1e9").allreduce_bucket is None  # pdcompile's runtime: no buckets


def test_in_place_layers_keep_nothing_of_their_own() -> None:
    assert in_place("ReLU(inplace)") and in_place("Add(inplace)")
    assert not in_place("ReLU()") and not in_place("Conv2d(3, 64, kernel_size=(3, 3))")
    graph = load_pipedream("vgg16")
    relus = [d for _, d in graph.nodes(data=True) if d["label"] == "ReLU(inplace)"]
    assert relus and all(d["keep"] == 0.0 and d["act"] > 0 for d in relus)
    others = [d for _, d in graph.nodes(data=True) if d["label"].startswith("Conv2d")]
    assert all(d["keep"] == d["act"] for d in others)


def _two_stage_graph(activation: float, params: float) -> Any:
    """Two light layers: the second reads the first's `activation` bytes."""
    graph = new_cost_graph("two")
    add_block(graph, "a", fwd=1e-4, bwd=2e-4, act=activation, params=params)
    add_block(graph, "b", fwd=1e-4, bwd=2e-4, act=1e3, params=params)
    graph.add_edge("a", "b")
    return graph


def test_a_servers_interface_carries_all_of_its_workers_flows() -> None:
    nic = 10e9 / 8
    cluster = Cluster.parse("2x2@1e11,10Gbps")
    # stage 0 on server 0, stage 1 on server 1: rank pairs (0, 2) and (1, 3) each carry every
    # other microbatch; server 0 sends every activation and receives every gradient back
    assert math.isclose(nic_busy_seconds([(0, 1), (2, 3)], {(0, 1): 1e8}, [0.0, 0.0], cluster),
                        1e8 / nic)
    # a ring over both servers enters and leaves each once per all-reduce, 2 (r-1)/r of the bytes
    assert math.isclose(nic_busy_seconds([(0, 1, 2, 3)], {}, [4e8], cluster, allreduces=[1.0]),
                        2 * 3 / 4 * 4e8 / nic)
    # ... inside one server, nothing crosses an interface; one level has none
    assert nic_busy_seconds([(0, 1), (2, 3)], {}, [4e8, 4e8], cluster) == 0.0
    assert nic_busy_seconds([(0,), (1,)], {(0, 1): 1e8}, [0.0, 0.0],
                            Cluster.parse("2@1e9")) == 0.0


@pytest.mark.parametrize("flow_cap", [None, 5e9 / 8])
def test_closed_form_and_simulator_both_bound_by_the_shared_interface(
        flow_cap: float | None) -> None:
    # 4 replicas per server send 50 MB activations across: each rank pair has a lane of its
    # own at the flow rate, but the 4 flows share the server's 10 Gbps interface
    cluster = Cluster.parse("4x2@1e11,10Gbps")
    if flow_cap is not None:
        outer = replace(cluster.levels[1], flow_bandwidth=flow_cap)
        cluster = replace(cluster, levels=(cluster.levels[0], outer))
    graph = _two_stage_graph(5e7, 1e3)
    given = Plan(stages=(Stage(("a",), 4, (0, 1, 2, 3)), Stage(("b",), 4, (4, 5, 6, 7))),
                 time_per_minibatch=0.0, dp_time=0.0, workers=8, planner="test")
    closed = price_plan(graph, given, cluster, schedule="1f1b", simulate=False)
    simulated = price_plan(graph, given, cluster, schedule="1f1b", simulate=True)
    bound = 5e7 / (10e9 / 8)  # every activation out of server 0, every gradient into it
    assert closed.time_per_minibatch == pytest.approx(bound, rel=1e-9)
    assert closed.extra["bound"] == "server interface"
    assert simulated.time_per_minibatch == pytest.approx(bound, rel=1e-6)
    # without the interface, four lanes would carry four times as much
    lanes = 5e7 / cluster.levels[1].flow_rate / 4
    assert lanes < bound


@given(bandwidth=st.floats(1e6, 1e12), ring=st.floats(1e6, 1e12), replicas=st.integers(2, 64),
       nbytes=sizes)
def test_an_allreduce_runs_at_its_bus_bandwidth_and_a_send_at_the_flow_rate(
        bandwidth: float, ring: float, replicas: int, nbytes: float) -> None:
    """gloo's CPU all-reduce achieves a fraction of a send's bandwidth (machine/loopback.py):
    the ring runs at the slower of the two, a point-to-point send is untouched."""
    level = Level(replicas, bandwidth, 1e-5, allreduce_bandwidth=ring)
    plain = Level(replicas, bandwidth, 1e-5)
    assert level.allreduce_rate == min(bandwidth, ring)
    assert transfer_seconds(nbytes, level) == transfer_seconds(nbytes, plain)
    expected = 2 * (replicas - 1) / replicas * nbytes / min(bandwidth, ring) + 2 * (
        replicas - 1) * 1e-5
    assert math.isclose(ring_allreduce_seconds(nbytes, replicas, level), expected)
    assert ring_allreduce_seconds(nbytes, replicas, level) >= ring_allreduce_seconds(
        nbytes, replicas, plain) * (1 - 1e-12)


def test_an_allreduce_bandwidth_survives_a_cluster_file_and_is_checked() -> None:
    import pytest

    from pdcompile.errors import ClusterError

    data = {"levels": [{"workers": 2, "bandwidth": "3GB/s", "allreduce_bandwidth": "1GB/s",
                        "cpu_copies": True}]}
    cluster = Cluster.from_dict(data)
    assert cluster.levels[0].allreduce_rate == 1e9
    assert Cluster.from_dict(cluster.to_dict()).levels == cluster.levels
    assert "1 GB/s all-reduce" in cluster.describe()
    assert "allreduce_bandwidth" not in Cluster.preset("C").to_dict()["levels"][0]
    data["levels"][0]["allreduce_bandwidth"] = 0
    with pytest.raises(ClusterError, match="allreduce_bandwidth 0.0.*> 0 bytes/s"):
        Cluster.from_dict(data)


@given(bandwidth=st.floats(1e6, 1e12), flow=st.floats(1e6, 1e12), flows=st.integers(1, 64),
       replicas=st.integers(2, 64), nbytes=sizes)
def test_a_ring_spread_over_several_connections_runs_at_their_sum_up_to_the_link(
        bandwidth: float, flow: float, flows: int, replicas: int, nbytes: float) -> None:
    """NCCL 2.4 doubles its rings between servers of NVLink GPUs, each ring its own socket:
    a ring hop runs at `allreduce_flows` flows' rate, at most the link; a send stays one flow."""
    level = Level(replicas, bandwidth, 1e-5, flow_bandwidth=flow, allreduce_flows=flows)
    single = Level(replicas, bandwidth, 1e-5, flow_bandwidth=flow)
    assert level.allreduce_rate == min(bandwidth, flows * min(bandwidth, flow))
    assert transfer_seconds(nbytes, level) == transfer_seconds(nbytes, single)
    assert ring_allreduce_seconds(nbytes, replicas, level) <= ring_allreduce_seconds(
        nbytes, replicas, single) * (1 + 1e-12)
    assert replace(level, allreduce_bandwidth=flow / 2).allreduce_rate <= flow / 2


def test_allreduce_flows_survive_a_cluster_file_and_are_checked() -> None:
    from pdcompile.errors import ClusterError

    data = {"levels": [{"workers": 8, "bandwidth": "150GB/s"},
                       {"workers": 2, "bandwidth": "25Gbps", "flow_bandwidth": "5Gbps",
                        "allreduce_flows": 2}]}
    cluster = Cluster.from_dict(data)
    assert cluster.levels[1].allreduce_rate == pytest.approx(10e9 / 8)
    assert Cluster.from_dict(cluster.to_dict()).levels == cluster.levels
    assert "allreduce_flows" not in cluster.to_dict()["levels"][0]
    assert "1.25 GB/s all-reduce" in cluster.describe()
    for bad in (0, 65, 1.5, True):
        data["levels"][1]["allreduce_flows"] = bad
        with pytest.raises(ClusterError, match="allreduce_flows"):
            Cluster.from_dict(data)


def test_the_papers_clusters_run_ncclS_rings_as_nccl_2_4_built_them() -> None:
    """Cluster A: one ring per network interface, and on PCIe NCCL's measured 4.9 GB/s of bus
    bandwidth (nccl#445); cluster B: two rings between NVLink servers, 5 Gbps per socket."""
    inner, outer = Cluster.preset("A").levels
    assert inner.allreduce_rate == 4.9e9 and inner.flow_rate == 1e10
    assert outer.allreduce_rate == outer.bandwidth == 10e9 / 8
    outer = Cluster.preset("B").levels[1]
    assert outer.flow_rate == 5e9 / 8 and outer.allreduce_rate == 10e9 / 8
