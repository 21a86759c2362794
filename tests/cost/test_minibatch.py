"""A profile measured at one minibatch, priced at the minibatch a run used
(cost/minibatch.py): compute and tensors scale with the samples, parameters do not."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.minibatch import at_minibatch
from pdcompile.errors import CostGraphError
from pdcompile.plan import Plan, Stage
from pdcompile.planner.search import price_plan

costs = st.floats(min_value=1e-4, max_value=1.0, allow_nan=False)
sizes = st.floats(min_value=1.0, max_value=1e9, allow_nan=False)


def _chain(layers: list[tuple[float, float, float, float]]) -> nx.DiGraph:
    graph = new_cost_graph(name="chain")
    for i, (fwd, bwd, act, params) in enumerate(layers):
        add_block(graph, f"n{i}", fwd=fwd, bwd=bwd, act=act, params=params, wgrad=bwd / 2)
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}", bytes=act / 2)
    graph.graph["input_bytes"] = 1e6
    return graph


@given(layers=st.lists(st.tuples(costs, costs, sizes, sizes), min_size=1, max_size=6),
       measured=st.integers(1, 512), run=st.integers(1, 512))
def test_per_sample_terms_scale_and_parameters_stay(
        layers: list[tuple[float, float, float, float]], measured: int, run: int) -> None:
    graph = _chain(layers)
    scaled = at_minibatch(graph, measured, run)
    factor = run / measured
    for node, data in graph.nodes(data=True):
        new = scaled.nodes[node]
        for key in ("fwd", "bwd", "act", "keep", "wgrad"):
            assert math.isclose(new[key], data[key] * factor)
        assert new["params"] == data["params"]
    for u, v, data in graph.edges(data=True):
        assert math.isclose(scaled.edges[u, v]["bytes"], data["bytes"] * factor)
    assert math.isclose(scaled.graph["input_bytes"], 1e6 * factor)
    assert graph.nodes["n0"]["fwd"] == layers[0][0]  # the original is untouched


def test_a_smaller_minibatch_all_reduces_more_per_sample() -> None:
    """Data parallelism on 16 V100 of cluster A: the all-reduce is once per minibatch, so half
    the minibatch spends more time per sample; a profile at 128 priced at 64 runs DP slower per
    sample, as PipeDream's VGG-16 runs (64 per worker) did against its profile (128)."""
    graph = _chain([(0.05, 0.1, 4e7, 4e8), (0.01, 0.02, 1e6, 5e7)])
    cluster = Cluster.preset("A")
    everyone = Plan(stages=(Stage(("n0", "n1"), 16, tuple(range(16))),), time_per_minibatch=0.0,
                    dp_time=0.0, workers=16, planner="test")
    whole = price_plan(graph, everyone, cluster, schedule="1f1b", simulate=False)
    half = price_plan(at_minibatch(graph, 128, 64), everyone, cluster, schedule="1f1b",
                      simulate=False)
    assert 2 * half.time_per_minibatch > whole.time_per_minibatch * 1.2


def test_minibatch_sizes_must_be_positive() -> None:
    with pytest.raises(CostGraphError, match="measured 0, run 64"):
        at_minibatch(_chain([(0.1, 0.1, 1.0, 1.0)]), 0, 64)
