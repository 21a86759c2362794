"""A tie's all-reduce between servers crosses their network interfaces, as any ring does.

Where the ranks sharing a tied parameter sit on several servers, its all-reduce at each update
enters and leaves every server it spans (2 (r-1)/r of the tie's bytes each way, as a replicated
stage's ring). `pipeline_time.server_interface_seconds` counts it beside the activations and
the replicas' rings, so the closed form and the simulator, which both take that throughput
bound, see it (before, a tie's bytes never reached the interfaces).
"""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.pipeline_time import server_interface_seconds
from pdcompile.cost.ties import SharedWeights
from pdcompile.plan import Plan, Stage
from pdcompile.planner import price_plan

TIE = 1e8
ACT = 1e9  # bytes per minibatch from stage 0 to stage 1
NIC = 1e9
SERVERS = Cluster.parse(f"4x2@1e11,{NIC}")  # two servers of four workers


def _lm(tied: bool) -> nx.DiGraph:
    """Embedding, two blocks, a head reading the embedding's weight again (`tied`) or a weight
    of its own of the same bytes."""
    graph = new_cost_graph("lm", 8)
    names = ["emb", "b0", "b1", "head"]
    for name in names:
        own = TIE if name == "emb" or (name == "head" and not tied) else 0.0
        add_block(graph, name, fwd=1e-3, bwd=2e-3, act=ACT, params=1e5 + own)
    for a, b in zip(names, names[1:], strict=False):
        graph.add_edge(a, b)
    if tied:
        graph.graph["ties"] = [{"bytes": TIE, "nodes": ["emb", "head"]}]
    return graph


@pytest.mark.parametrize("schedule, micro, updates", [("1f1b-flush", 8, 1.0),
                                                      ("gpipe", 8, 1.0),
                                                      ("1f1b", 1, 1 / 4)])
def test_a_tie_between_servers_loads_their_interfaces(schedule: str, micro: int,
                                                      updates: float) -> None:
    """Stage 0 on server 0's four workers, stage 1 on server 1's: each microbatch's
    activations cross the interfaces, and each update's all-reduce of the tie over the eight
    ranks (2 x 7/8 of its bytes each way; once per minibatch in a flush, once per round of
    four under '1f1b'). The interface binds, in the closed form and the simulator alike."""
    plan = Plan(stages=(Stage(("emb", "b0"), 4, (0, 1, 2, 3)),
                        Stage(("b1", "head"), 4, (4, 5, 6, 7))),
                time_per_minibatch=0.0, dp_time=0.0, workers=8, schedule=schedule,
                microbatches=micro)
    times = {}
    for tied in (True, False):
        priced = price_plan(_lm(tied), plan, SERVERS, memory=1e30, simulate=True)
        assert priced.extra["bound"] == "server interface"
        times[tied] = priced.extra["closed_form_time_per_minibatch"]
        assert priced.extra["simulated_time_per_minibatch"] == pytest.approx(times[tied])
    assert times[False] == pytest.approx(ACT / NIC)
    assert times[True] == pytest.approx((ACT + 2 * 7 / 8 * TIE * updates) / NIC)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), schedule=st.sampled_from(["1f1b-flush", "1f1b", "zb-h1"]),
       nbytes=st.floats(0, 1e9), per_server=st.sampled_from([1, 2, 4]))
def test_a_tie_adds_its_ring_to_each_server_it_spans(data: st.DataObject, schedule: str,
                                                     nbytes: float, per_server: int) -> None:
    """On random placements of equal replicas, the busiest interface grows by at most one
    ring of the tie per update, not at all where every rank sharing it sits on one server."""
    stages, replicas = data.draw(st.integers(2, 4)), data.draw(st.sampled_from([1, 2]))
    cluster = Cluster.parse(f"{per_server}x{stages * replicas}@1e11,1e9")
    ranks = [tuple(range(s * replicas, (s + 1) * replicas)) for s in range(stages)]
    edges = {(s, s + 1): data.draw(st.floats(0, 1e8)) for s in range(stages - 1)}
    params = [data.draw(st.floats(0, 1e8)) for _ in range(stages)]
    sharing = tuple(sorted(data.draw(st.sets(st.integers(0, stages - 1), min_size=2))))
    tie = SharedWeights(sharing, nbytes)
    micro = 1 if schedule == "1f1b" else 4 * replicas

    def busiest(ties: tuple[SharedWeights, ...]) -> float:
        return server_interface_seconds(edges, ranks, params, cluster, schedule=schedule,
                                        microbatches=micro, ties=ties)

    added = busiest((tie,)) - busiest(())
    r = len(tie.ranks(ranks))
    per_update = 1 / replicas if schedule == "1f1b" else 1 / micro
    assert -1e-12 <= added <= 2 * (r - 1) / r * nbytes * per_update / 1e9 * (1 + 1e-9) + 1e-12
    if len({rank // per_server for rank in tie.ranks(ranks)}) == 1:
        assert added == pytest.approx(0.0, abs=1e-12)
    elif not any(edges.values()) and not any(params):  # the tie alone crosses
        assert added == pytest.approx(2 * (r - 1) / r * nbytes * per_update / 1e9)
