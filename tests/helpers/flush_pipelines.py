"""Drawn flush pipelines: one block per stage behind an input, priced by the planner and run by
the simulator (tests/planner/test_flush_longest_path.py, tests/cost/test_flush_orders.py)."""

from __future__ import annotations

import networkx as nx
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.machine.device import DEVICES
from pdcompile.machine.device_groups import DeviceGroup
from pdcompile.plan import Plan, Stage
from pdcompile.schedule.kinds import kind, names
from pdcompile.schedule.placement import v_position

FLUSH = names("flush")


@st.composite
def flush_pipelines(draw: st.DrawFn) -> tuple[nx.DiGraph, Plan, Cluster, str, int]:
    """(graph, plan, cluster, schedule, microbatches): one block per stage behind an input,
    some edges skipping ahead; 1-8 stages, 1-32 microbatches; replicated stages under
    '1f1b-flush' and 'gpipe', chunks placed as the interleaved and V schedules place them;
    half of the clusters mixed (devices of different speeds and memories)."""
    schedule = draw(st.sampled_from(FLUSH))
    row = kind(schedule)
    if row.v_shape:
        p = draw(st.integers(2, 4))
        ranks = [(v_position(c, p),) for c in range(2 * p)]
        least = max(1, row.microbatches_per_rank * p)
        microbatches = draw(st.integers(least, 32))
    elif row.interleaved:
        p, v = draw(st.integers(2, 4)), draw(st.integers(2, 3))
        ranks = [(c % p,) for c in range(min(8, p * v) // p * p)]
        microbatches = p * draw(st.integers(1, 32 // p))
    elif row.split_backward:  # zb-h1: one stage per rank
        ranks = [(r,) for r in range(draw(st.integers(1, 8)))]
        microbatches = len(ranks) * draw(st.integers(1, 32 // len(ranks)))
    else:
        replicas = draw(st.lists(st.integers(1, 3), min_size=1, max_size=8))
        ranks, first = [], 0
        for r in replicas:
            ranks.append(tuple(range(first, first + r)))
            first += r
        microbatches = draw(st.integers(max(replicas), 32))
    stages = len(ranks)
    graph = new_cost_graph("flush")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=float(draw(st.integers(0, 10**7))), params=0.0)
    for i in range(stages):
        add_block(graph, f"n{i}", fwd=draw(st.floats(1e-3, 1e-2)),
                  bwd=draw(st.floats(1e-3, 2e-2)), act=float(draw(st.integers(0, 5 * 10**7))),
                  params=draw(st.floats(0, 1e8)))
        graph.add_edge("x" if i == 0 else f"n{i - 1}", f"n{i}")
        for j in draw(st.lists(st.integers(0, max(0, i - 2)), max_size=1)):
            if j < i - 1:  # a skip: stage j's output read again by stage i
                graph.add_edge(f"n{j}", f"n{i}")
    workers = max(r for group in ranks for r in group) + 1
    servers = (workers + 1) // 2
    cluster = Cluster.parse(draw(st.sampled_from([
        f"{workers}@1e9~10us", f"{workers}@1e10~5us",
        f"{servers}x2@1e10,1e9~5us,20us", f"{servers}x2@1e9,1e8~5us,20us"])))
    if draw(st.booleans()):  # a mixed cluster: groups of devices of different speeds
        cuts = sorted(draw(st.sets(st.integers(1, cluster.workers - 1), max_size=2))) \
            if cluster.workers > 1 else []
        bounds = [0, *cuts, cluster.workers]
        cluster = Cluster(levels=cluster.levels, groups=tuple(
            DeviceGroup(DEVICES[draw(st.sampled_from(["v100", "a100", "titanx", "h100"]))],
                        b - a, draw(st.none() | st.sampled_from([0.25, 0.5, 2.0])))
            for a, b in zip(bounds, bounds[1:], strict=False)))
    plan = Plan(stages=tuple(Stage((*(("x",) if i == 0 else ()), f"n{i}"), len(group), group)
                             for i, group in enumerate(ranks)),
                time_per_minibatch=0.0, dp_time=0.0, workers=workers)
    return graph, plan, cluster, schedule, microbatches
