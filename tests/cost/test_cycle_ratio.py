"""Howard's policy iteration (`cost.cycle_ratio`) finds the largest weight / tokens over every
cycle of a graph, as enumerating the cycles does, also where edges carry zero or negative
tokens (a warm-up's backward of an earlier microbatch after a forward of a later one)."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.cost import cycle_ratio
from pdcompile.cost.cycle_ratio import largest_cycle_ratio

# numpy's warnings reach users planning a model: none may come from the prices
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@st.composite
def graphs(draw: st.DrawFn) -> list[list[tuple[int, float, int]]]:
    """2-7 nodes, each with 1-3 edges out (weight 0-10); an edge u -> v carries
    p(v) - p(u) + 1..3 tokens for drawn integers p: negative ones too, yet every cycle a
    positive number (the p cancel around it), as in a schedule that runs."""
    count = draw(st.integers(2, 7))
    potential = draw(st.lists(st.integers(-3, 3), min_size=count, max_size=count))
    edges = []
    for u in range(count):
        out = []
        for _ in range(draw(st.integers(1, 3))):
            v = draw(st.integers(0, count - 1))
            out.append((v, draw(st.floats(0.0, 10.0)),
                        potential[v] - potential[u] + draw(st.integers(1, 3))))
        edges.append(out)
    return edges


def _by_enumeration(edges: list[list[tuple[int, float, int]]]) -> float:
    """The largest ratio over the simple cycles (a cycle that repeats one is no larger)."""
    graph = nx.MultiDiGraph()
    for u, out in enumerate(edges):
        for v, w, t in out:
            graph.add_edge(u, v, weight=w, tokens=t)
    best = -math.inf
    for cycle in nx.simple_cycles(nx.DiGraph(graph)):
        # every choice among parallel edges along the cycle
        choices: list[tuple[float, int]] = [(0.0, 0)]
        for u, v in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            choices = [(w + d["weight"], t + d["tokens"]) for w, t in choices
                       for d in graph.get_edge_data(u, v).values()]
        for w, t in choices:
            assert t > 0
            best = max(best, w / t)
    return best


@pytest.mark.parametrize("walked_below", [cycle_ratio.WALKED_BELOW, 0],
                         ids=["walked", "doubled"])
def test_the_largest_cycle_ratio_is_the_enumerated_one(walked_below: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Small graphs walk each policy, large ones evaluate it on arrays: both, on small
    graphs."""
    monkeypatch.setattr(cycle_ratio, "WALKED_BELOW", walked_below)
    _the_enumerated_one()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(edges=graphs())
def _the_enumerated_one(edges: list[list[tuple[int, float, int]]]) -> None:
    expected = _by_enumeration(edges)
    ratio, cycle = largest_cycle_ratio(edges)
    assert ratio == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the cycle returned is a cycle of the graph with that ratio
    weight = tokens = 0.0
    for u, v in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        w, t = max(((w, t) for target, w, t in edges[u] if target == v),
                   key=lambda e: e[0] - ratio * e[1])
        weight, tokens = weight + w, tokens + t
    assert weight / tokens == pytest.approx(ratio, rel=1e-9, abs=1e-12)


def test_a_warm_up_edge_of_negative_tokens() -> None:
    """F(m) -> B(m - 2) (3 s, -2 tokens), B(m) -> F(m + 3) (5 s, 3 tokens): 8 s per token."""
    ratio, cycle = largest_cycle_ratio([[(1, 3.0, -2)], [(0, 5.0, 3)]])
    assert ratio == pytest.approx(8.0)
    assert sorted(cycle) == [0, 1]


def test_a_cycles_weights_add_up_in_order_one_at_a_time() -> None:
    """Both evaluations add a cycle's weights one at a time from its root: on Python 3.12 the
    walk's sum() compensated its rounding (1/3 + 0 + 0.1 + 2/3 gave 1.0999999999999999 there,
    the arrays' cumsum 1.1), so the two disagreed in the last bit on that interpreter only."""
    step = np.array([1, 2, 3, 0], dtype=np.intp)
    weight = np.array([1 / 3, 0.0, 0.1, 2 / 3])
    tokens = np.array([0.0, 0.0, 0.0, 1.0])
    in_order = 0.0
    for w in weight.tolist():
        in_order += w
    assert cycle_ratio._walked(step, weight, tokens)[0][0] == in_order
    assert cycle_ratio._doubled(step, weight, tokens)[0][0] == in_order


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), count=st.integers(1, 80))
def test_doubling_gives_the_walks_figures_to_the_last_bit(data: st.DataObject,
                                                          count: int) -> None:
    """A policy's evaluation on arrays (`_doubled`, large graphs) and by walking it (`_walked`)
    agree exactly, ties included: the improvement steps pick among edges of equal gain by
    their values, so a value off in its last bit (a sum in another order) picks another edge
    and may end on another cycle of the same ratio (GPT-2 XL on 24 H100: 4 of 300 prices)."""
    step = np.array(data.draw(st.lists(st.integers(0, count - 1), min_size=count,
                                       max_size=count)), dtype=np.intp)
    # few distinct weights, so that sums tie; thirds, so that their order shows in the bits
    weight = np.array(data.draw(st.lists(st.sampled_from([0.0, 1 / 3, 0.1, 2 / 3, 7.0]),
                                         min_size=count, max_size=count)))
    tokens = np.array(data.draw(st.lists(st.integers(-2, 3), min_size=count,
                                         max_size=count)), dtype=float)
    walked = cycle_ratio._walked(step, weight, tokens)
    doubled = cycle_ratio._doubled(step, weight, tokens)
    np.testing.assert_array_equal(doubled[0], walked[0])
    np.testing.assert_array_equal(doubled[1], walked[1])  # NaN where the walk's is NaN
    assert list(doubled[2].root) == walked[2].root
    for u in range(count):
        assert doubled[2].nodes(u) == walked[2].nodes(u)
