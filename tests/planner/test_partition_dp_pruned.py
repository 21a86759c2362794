"""The pruned inner level of the pipedream-mode DP gives exactly the plain level's tables."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.planner import dp
from pdcompile.planner.antichain import antichain_states
from tests.helpers.strategies import small_dags


def _levels(graph: nx.DiGraph, workers: int, bandwidth: float,
            ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    states = antichain_states(graph)
    tables = dp.state_tables(graph, states)
    s = len(tables.compute)
    seg = tables.compute[None, :] - tables.compute[:, None]
    seg = np.where(tables.valid, seg, dp.INF)
    seg[0] = np.where(np.arange(s) > 0, tables.compute, dp.INF)
    plain = dp._pd_level(tables, seg, np.arange(s), workers, bandwidth, 1, None, False)
    pruned = dp._pd_level_all_starts(tables, seg, workers, bandwidth)
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
    from pdcompile.planner.costmodel import pipedream_view
    from pdcompile.profiles import load_pipedream

    graph = pipedream_view(load_pipedream(profiles_dir / model / "graph.txt"))[0]
    _assert_same(*_levels(graph, 4, 1e10))


# ------------------------------------------------------------------ values per cost class
def _tables(graph: nx.DiGraph) -> tuple[dp.StateTables, np.ndarray]:
    tables = dp.state_tables(graph, antichain_states(graph))
    s = len(tables.compute)
    seg = tables.compute[None, :] - tables.compute[:, None]
    seg = np.where(tables.valid, seg, dp.INF)
    seg[0] = np.where(np.arange(s) > 0, tables.compute, dp.INF)
    return tables, seg


def _assert_by_class_same(graph: nx.DiGraph, workers: int, bandwidth: float) -> int:
    """`_pd_level_by_class` and `_pd_level_split` against `_pd_level` over every start: the
    same values and, at every cell, the same recorded split. Returns the number of classes."""
    tables, seg = _tables(graph)
    s = len(tables.compute)
    val, kk, rr = dp._pd_level(tables, seg, np.arange(s), workers, bandwidth, 1, None, False)
    by_class = dp._pd_level_by_class(tables, seg, workers, bandwidth)
    assert by_class.shape == val.shape
    assert np.array_equal(val, by_class), f"values differ at {np.argwhere(val != by_class)[:5]}"
    for a in range(s):
        for j in range(s):
            for m in range(workers + 1):
                got = dp._pd_level_split(tables, seg, by_class, workers, bandwidth, a, j, m)
                assert got == (kk[a, j, m], rr[a, j, m]), (a, j, m)
    return int(dp._cost_classes(tables).max()) + 1


@st.composite
def degenerate_dags(draw: st.DrawFn) -> nx.DiGraph:
    """small_dags with a few nodes that cost nothing (no time, bytes or params), hung off and
    into the others: states that differ by them share their costs (cost classes)."""
    from pdcompile.cost.costgraph import add_block

    graph = draw(small_dags(max_nodes=5))
    real = list(graph.nodes)
    for z in range(draw(st.integers(1, 3))):
        name = f"z{z}"
        add_block(graph, name, fwd=0.0, bwd=0.0, act=0.0, params=0.0)
        graph.add_edge(draw(st.sampled_from(real)), name, bytes=0.0)
        if draw(st.booleans()):
            later = [v for v in real if not nx.has_path(graph, v, name)]
            if later:
                graph.add_edge(name, draw(st.sampled_from(later)), bytes=0.0)
    return graph


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=degenerate_dags() | small_dags(max_nodes=6), workers=st.integers(1, 5),
       bandwidth=st.sampled_from([1e8, 1e9, 1e10]))
def test_level_by_class_equals_plain_on_random_dags(graph: nx.DiGraph, workers: int,
                                                    bandwidth: float) -> None:
    _assert_by_class_same(graph, workers, bandwidth)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_level_by_class_equals_plain_on_gnmt(profiles_dir: Path, workers: int) -> None:
    """gnmt: 100 states in 33 cost classes (`hidden` and its `__getitem__`s cost nothing)."""
    from pdcompile.planner.costmodel import pipedream_view
    from pdcompile.profiles import load_pipedream

    graph = pipedream_view(load_pipedream(profiles_dir / "gnmt" / "graph.txt"))[0]
    assert _assert_by_class_same(graph, workers, 1e10) == 33


def test_level_by_class_equals_plain_on_vgg16(profiles_dir: Path) -> None:
    from pdcompile.planner.costmodel import pipedream_view
    from pdcompile.profiles import load_pipedream

    graph = pipedream_view(load_pipedream(profiles_dir / "vgg16" / "graph.txt"))[0]
    _assert_by_class_same(graph, 4, 1e9)


def test_every_split_fallback_matches_plain() -> None:
    """`_pd_cells` (cells whose best class has unequal values) is the plain minimum over splits."""
    graph = nx.DiGraph()
    from pdcompile.cost.costgraph import add_block

    for i, (f, p) in enumerate([(1e-3, 1e6), (2e-3, 0.0), (1e-3, 5e6), (3e-3, 1e5), (2e-3, 2e6)]):
        add_block(graph, f"n{i}", fwd=f, bwd=2 * f, act=1e6 * (i + 1), params=p)
    for u, v in [("n0", "n1"), ("n0", "n2"), ("n1", "n3"), ("n2", "n3"), ("n3", "n4"),
                 ("n1", "n4")]:
        graph.add_edge(u, v)
    tables, seg = _tables(graph)
    s, workers, bandwidth = len(tables.compute), 4, 1e9
    val, _, _ = dp._pd_level(tables, seg, np.arange(s), workers, bandwidth, 1, None, False)
    cls = dp._cost_classes(tables)
    n_cls = int(cls.max()) + 1
    order = np.argsort(cls, kind="stable")
    rep = order[np.searchsorted(cls[order], np.arange(n_cls))]
    stages_t = dp._class_stages(tables, rep, workers, bandwidth).transpose(0, 2, 1)
    planes = np.ascontiguousarray(val.transpose(2, 0, 1))
    cell_a, cell_j = np.nonzero(tables.valid[:, 1:])
    cell_j = cell_j + 1
    p = tables.params[None, :] - tables.params[:, None]
    for m in range(2, workers + 1):
        got = dp._pd_cells(planes, cls, stages_t, tables.valid, cell_a, cell_j, m)
        base = ((seg + 4.0 * (m - 1) * p / (bandwidth * m)) / m)[cell_a, cell_j]
        assert (got < base).any()  # some cells are split
        assert np.array_equal(np.where(got < base, got, base), val[cell_a, cell_j, m])


@pytest.mark.parametrize("model,config,objective", [
    ("gnmt_large", "1-1-1-1-1-1-1-1-1-1-1-1-3-1", 0.042061),
    ("densenet121", "6-2-1-1-1-1-1-1-1-1", 0.024614632),
    ("gnmt", "1-1-1-1-4-1-1-1-1-3-1", 0.011081),
])
def test_two_level_plans_unchanged(profiles_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                   model: str, config: str, objective: float) -> None:
    """The plans of the two-level rows (gnmt_large: 1496 states in 65 cost classes, through
    the level by class) are those of the plain recurrence."""
    import pdcompile
    from pdcompile.profiles import load_pipedream

    calls = []
    by_class = dp._pd_level_by_class

    def spy(*args: object) -> np.ndarray:
        calls.append(1)
        return by_class(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(dp, "_pd_level_by_class", spy)
    graph = load_pipedream(profiles_dir / model / "graph.txt")
    result = pdcompile.plan(graph, "4x4@1e10,1.25e9", planner="dp", cost_model="pipedream")
    assert result.config == config
    assert result.time_per_minibatch == pytest.approx(objective, rel=1e-9)
    assert len(calls) == (model == "gnmt_large")
