"""The network and memory physics of the paper's clusters (docs/cost-model.md): single-flow
caps, gradient buckets all-reduced during the backward, in-place layers that keep nothing."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.links import (
    exposed_allreduce_seconds,
    ring_allreduce_seconds,
    stage_allreduce_seconds,
    transfer_seconds,
)
from pdcompile.machine.cluster import Level
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


def test_a_flow_gets_at_most_its_cap_and_a_ring_hop_is_one_flow() -> None:
    capped = Level(2, 25e9 / 8, 0.0, flow_bandwidth=5e9 / 8)
    assert capped.flow_rate == 5e9 / 8
    assert transfer_seconds(5e9 / 8, capped) == 1.0
    assert ring_allreduce_seconds(1e9, 2, capped) == 1e9 / (5e9 / 8)
    assert Level(2, 1e9, flow_bandwidth=5e9).flow_rate == 1e9  # the link bounds the flow
    b = Cluster.preset("B")
    # inside a server NVLink; across the two servers one flow at AWS's 5 Gbps
    assert stage_allreduce_seconds(1e9, [0, 1], b) == ring_allreduce_seconds(1e9, 2, b.levels[0])
    assert b.flow_rate_between(0, 8) == 5e9 / 8
    assert stage_allreduce_seconds(1e9, [0, 8], b) == 1e9 / (5e9 / 8) + 2 * b.levels[1].latency


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
    assert "allreduce_bandwidth" not in Cluster.preset("A").to_dict()["levels"][0]
    data["levels"][0]["allreduce_bandwidth"] = 0
    with pytest.raises(ClusterError, match="allreduce_bandwidth 0.0.*> 0 bytes/s"):
        Cluster.from_dict(data)
