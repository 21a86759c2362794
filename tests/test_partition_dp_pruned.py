"""The pruned inner level of the pipedream-mode DP gives exactly the plain level's tables."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.passes.partition import dp
from pdcompile.passes.partition.antichain import antichain_states
from tests.test_partition_dp import small_dags


def _levels(graph: nx.DiGraph, workers: int, bandwidth: float,
            ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    states = antichain_states(graph)
    tables = dp.state_tables(graph, states)
    s = len(tables.compute)
    seg = tables.compute[None, :] - tables.compute[:, None]
    seg = np.where(tables.valid, seg, dp.INF)
    seg[0] = np.where(np.arange(s) > 0, tables.compute, dp.INF)
    plain = dp._pd_level(tables, seg, np.arange(s), workers, bandwidth, 1, None, False)
    pruned = dp._pd_level_all_starts(tables, seg, workers, bandwidth, None, False)
    return plain, pruned


def _assert_same(plain: tuple[np.ndarray, ...], pruned: tuple[np.ndarray, ...]) -> None:
    for name, a, b in zip(("time", "split", "replicas"), plain, pruned, strict=True):
        assert np.array_equal(a, b), f"{name} tables differ at {np.argwhere(a != b)[:5]}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_dags(max_nodes=6), workers=st.integers(1, 5),
       bandwidth=st.sampled_from([1e8, 1e9, 1e10]))
def test_pruned_level_equals_plain_on_random_dags(graph: nx.DiGraph, workers: int,
                                                  bandwidth: float) -> None:
    _assert_same(*_levels(graph, workers, bandwidth))


@pytest.mark.parametrize("model", ["vgg16", "alexnet", "resnet50"])
def test_pruned_level_equals_plain_on_shipped_profiles(profiles_dir: Path, model: str) -> None:
    from pdcompile.passes.partition.costmodel import pipedream_view
    from pdcompile.profiles import load_pipedream

    graph = pipedream_view(load_pipedream(profiles_dir / model / "graph.txt"))[0]
    _assert_same(*_levels(graph, 4, 1e10))
