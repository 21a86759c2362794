"""PipeDream's generation of antichain states starts from one source and joins no two sinks, so
on a graph with a side branch that ends in a sink of its own (a read of the input's shape that
only an assert uses, as fx traces timm's eva02) it stopped after that branch's few states; a
final state of everything alone then left the DP one jump from them to the whole graph, and a
plan of K stages put the whole model on its last stage. The prefixes of the topological order
now join the states there (planner/antichain.py `_with_prefixes`)."""

from __future__ import annotations

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile import plan
from pdcompile.cost.costgraph import add_block, new_cost_graph, topological_order
from pdcompile.planner.antichain import antichain_states


def _with_side_branch(blocks: int, side: int) -> nx.DiGraph:
    """An input read by `side` free nodes, each a sink (reads of its shape that only asserts
    use: so many downsets that the planner takes PipeDream's generation), and by a chain of
    `blocks` equal blocks."""
    graph = new_cost_graph("side branch")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=4e5, params=0.0)
    for i in range(side):
        add_block(graph, f"shape{i}", fwd=0.0, bwd=0.0, act=8.0, params=0.0)
        graph.add_edge("x", f"shape{i}")
    before = "x"
    for i in range(blocks):
        add_block(graph, f"block{i}", fwd=1e-3, bwd=2e-3, act=4e5, params=1e6)
        graph.add_edge(before, f"block{i}")
        before = f"block{i}"
    return graph


def test_a_side_branch_ending_in_its_own_sink_does_not_stop_the_cuts_between_blocks() -> None:
    graph = _with_side_branch(blocks=4, side=12)
    found = plan(graph, "local-4", stages=4, schedule="1f1b-flush", microbatches=4)
    blocks = [sorted(n for n in s.nodes if n.startswith("block")) for s in found.stages]
    assert blocks == [["block0"], ["block1"], ["block2"], ["block3"]], found.config


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 12), side=st.integers(1, 6))
def test_every_prefix_of_the_order_is_a_state_where_the_generation_stops_short(
        blocks: int, side: int) -> None:
    graph = _with_side_branch(blocks, side)
    core = graph.subgraph([n for n in graph.nodes if n != "x"]).copy()  # the input pinned
    states = antichain_states(core)
    order = topological_order(core)
    assert states.order == tuple(order)
    downsets = set(states.downsets)
    assert all((1 << i) - 1 in downsets for i in range(len(order) + 1))
    for s, bits in enumerate(states.downsets):  # reachable from exactly the states inside it
        inside = {t for t, other in enumerate(states.downsets) if other != bits
                  and other & bits == other}
        assert {t for t in range(len(states)) if states.reach[s] >> t & 1} == inside
