"""The closed form follows the simulator where a replicated stage all-reduces in lockstep.

Under '1f1b' every replica of a stage joins one all-reduce after each round (a microbatch per
replica), and the simulator's ALLREDUCE waits for the round's last backward; the next round's
forwards at that stage wait for the all-reduce, and the round's microbatches then return
together through the single-replica stages before it, which take them one after another. The
closed form's circuits (`pipeline_time._circuit_ratio`) count both; without them it was
optimistic by up to 37% on such pipelines (GNMT-8's 1-1-2 on one server of cluster A, with
4/3/1 in flight: 25.99 ms closed form, 29.81 ms simulated). Replicated stages of different sizes
side by side (2-3-1) chain rounds over lcm(r_1, r_2) microbatches, which those circuits missed;
1f1b is now priced by the largest cycle ratio of its event graph over that period
(`cost.steady_cycle`), these tests' common measure.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdcompile import Cluster
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.pipeline_time import runnable_in_flight
from pdcompile.plan import Plan, Stage
from pdcompile.planner.costmodel import ModelOptions, priced_time
from pdcompile.planner.simulation import simulate_steady

BUCKET = 25 * 2**20  # PyTorch DDP's default gradient bucket


def _chain(blocks: list[tuple[float, float, float, float]]) -> object:
    """An input, then one block per stage: (fwd, bwd, activation bytes, parameter bytes)."""
    graph = new_cost_graph("lockstep")
    add_block(graph, "x", fwd=0.0, bwd=0.0, act=1e6, params=0.0)
    previous = "x"
    for i, (fwd, bwd, act, params) in enumerate(blocks):
        add_block(graph, f"n{i}", fwd=fwd, bwd=bwd, act=act, params=params)
        graph.add_edge(previous, f"n{i}")
        previous = f"n{i}"
    return graph


def _closed_and_simulated(graph: object, replicas: list[int], in_flight: list[int],
                          cluster: Cluster) -> tuple[float, float]:
    stages, rank = [], 0
    for i, (r, n) in enumerate(zip(replicas, in_flight, strict=True)):
        nodes = ("x", "n0") if i == 0 else (f"n{i}",)
        stages.append(Stage(nodes, r, tuple(range(rank, rank + r)), in_flight=n))
        rank += r
    plan = Plan(stages=tuple(stages), time_per_minibatch=0.0, dp_time=0.0, workers=rank)
    closed = priced_time(graph, [(list(s.nodes), s.ranks) for s in stages], cluster,
                         options=ModelOptions(schedule="1f1b"), in_flight=in_flight)
    _, simulated = simulate_steady(graph, plan, cluster)
    return closed.time_per_minibatch, simulated.time_per_minibatch


def test_gnmt_like_replicated_last_stage_waits_for_its_round() -> None:
    """GNMT-8's 1-1-2 on one server of cluster A (its stage costs, 4/3/1 in flight): the
    round trip of stage 1 through the lockstep round binds, as the simulator finds."""
    graph = _chain([(0.008651, 0.012637, 1.2582912e7, 2e7),
                    (0.009654, 0.014994, 1.287168e7, 2e7),
                    (0.015228, 0.028252, 1e6, 1.4e8)])
    cluster = replace(Cluster.parse("4@10GB/s~10us:v100"), allreduce_bucket=BUCKET)
    closed, simulated = _closed_and_simulated(graph, [1, 1, 2], [4, 3, 1], cluster)
    assert closed == pytest.approx(simulated, rel=0.01)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(st.tuples(st.floats(2e-3, 2e-2), st.floats(2e-3, 4e-2),
                                 st.floats(1e5, 2e7), st.floats(0.0, 2e8)),
                       min_size=2, max_size=4),
       last=st.integers(2, 3), flights=st.lists(st.integers(1, 6), min_size=4, max_size=4),
       cluster=st.sampled_from(["4@1e10~5us", "8@1e9~5us", "2x2@1e10,1e9~5us,20us"]),
       bucketed=st.booleans())
def test_closed_form_follows_lockstep_rounds_of_a_replicated_last_stage(
        blocks: list[tuple[float, float, float, float]], last: int, flights: list[int],
        cluster: str, bucketed: bool) -> None:
    """Single-replica stages, then a last stage of 2-3 replicas, any runnable in-flight
    counts: the closed form within 12% of the simulator (the worst of 900 random draws was
    -10%; before the lockstep circuits, -37%)."""
    machine = Cluster.parse(cluster)
    if bucketed:
        machine = replace(machine, allreduce_bucket=BUCKET)
    replicas = [1] * (len(blocks) - 1) + [last]
    if sum(replicas) > machine.workers:
        replicas[-1] = machine.workers - len(blocks) + 1
    flight = runnable_in_flight(flights[:len(blocks)], replicas)
    closed, simulated = _closed_and_simulated(_chain(blocks), replicas, flight, machine)
    assert closed == pytest.approx(simulated, rel=0.12)


def _assert_closed_form_near(pattern: list[int], blocks: list[tuple[float, float, float, float]],
                             flights: list[int], cluster: str, bucketed: bool, *,
                             rel: float) -> None:
    """The closed form of `pattern`'s chain on `cluster` within `rel` of the simulator."""
    machine = Cluster.parse(cluster)
    if bucketed:
        machine = replace(machine, allreduce_bucket=BUCKET)
    flight = runnable_in_flight(flights[:len(pattern)], pattern)
    closed, simulated = _closed_and_simulated(_chain(blocks[:len(pattern)]), pattern, flight,
                                              machine)
    assert closed == pytest.approx(simulated, rel=rel)


# four stages' (forward, backward, activation bytes, parameter bytes), in-flight counts, and
# clusters: what the lockstep property tests draw
FOUR_BLOCKS = st.lists(st.tuples(st.floats(2e-3, 2e-2), st.floats(2e-3, 4e-2),
                                 st.floats(1e5, 2e7), st.floats(0.0, 2e8)),
                       min_size=4, max_size=4)
FOUR_FLIGHTS = st.lists(st.integers(1, 6), min_size=4, max_size=4)
MACHINES = st.sampled_from(["8@1e10~5us", "8@1e9~5us", "2x4@1e10,1e9~5us,20us"])

MIDDLE = [[1, 2, 1], [2, 1, 2], [1, 2, 1, 1], [1, 1, 2, 1], [1, 3, 1], [2, 1, 1, 2], [1, 2, 1, 2],
          [3, 1, 2], [1, 2, 1, 3]]  # a replicated stage with single-replica stages around it


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.sampled_from(MIDDLE),
       blocks=FOUR_BLOCKS, flights=FOUR_FLIGHTS, cluster=MACHINES, bucketed=st.booleans())
def test_closed_form_follows_lockstep_rounds_of_replicated_middle_stages(
        pattern: list[int], blocks: list[tuple[float, float, float, float]],
        flights: list[int], cluster: str, bucketed: bool) -> None:
    """A replicated stage between single-replica ones (1-2-1, 2-1-2, ...), any runnable
    in-flight counts: its round's all-reduce holds the next round's forwards, which cross the
    stages after it again before they return, and a single stage after a replicated one takes
    its rounds back one by one (`pipeline_time._waiting`). The closed form within 15% of the
    simulator (the worst of 240 random draws: -13.9%, 3-1-2 with one in flight each, and
    +12.0%; before these circuits, -25.9%, 1-3-1 with one in flight each)."""
    _assert_closed_form_near(pattern, blocks, flights, cluster, bucketed, rel=0.15)


ADJACENT = [[2, 2, 1], [1, 2, 2, 1], [2, 2, 1, 1], [1, 2, 2], [2, 2], [2, 2, 2], [3, 3, 1],
            [1, 3, 3], [1, 1, 2, 2], [2, 2, 1, 2], [1, 2, 3, 1]]  # replicated stages side by side


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.sampled_from(ADJACENT),
       blocks=FOUR_BLOCKS, flights=FOUR_FLIGHTS, cluster=MACHINES, bucketed=st.booleans())
@example(pattern=[2, 2, 1, 1], blocks=[(0.01836, 0.02018, 4.456e6, 1.8185e8),
                                       (0.01765, 0.03143, 1.8989e7, 8.833e7),
                                       (0.002985, 0.02152, 1.4929e7, 8.759e7),
                                       (0.007323, 0.02442, 6.487e6, 1.947e8)],
         flights=[4, 4, 6, 4], cluster="2x4@1e10,1e9~5us,20us", bucketed=False)
@example(pattern=[1, 2, 3, 1], blocks=[(0.01143, 0.02323, 1.6896e7, 1.1627e8),
                                       (0.01136, 0.00315, 1.9598e7, 1.9823e8),
                                       (0.01538, 0.0096, 7.846e6, 6.484e7),
                                       (0.009371, 0.006802, 1.391e6, 6.01e7)],
         flights=[6, 3, 2, 4], cluster="8@1e9~5us", bucketed=False)
def test_closed_form_follows_lockstep_rounds_of_replicated_stages_side_by_side(
        pattern: list[int], blocks: list[tuple[float, float, float, float]],
        flights: list[int], cluster: str, bucketed: bool) -> None:
    """Replicated stages next to each other (2-2-1, 1-2-2-1, 1-2-3-1, ...), any runnable
    in-flight counts: a replicated stage's own round holds its next forwards also where the
    stages after it are replicated (the round's microbatches then spread over their replicas
    and queue only (j - 1) // r deep, `pipeline_time._queued`), and a later replicated
    stage's round lies on the circuit of a replicated stage before it. The closed form within
    15% of the simulator (worst of 300 random draws of these patterns: -10.6%, 2-2-1-2, and
    +11.8%; before, -22.8% (2-2-1-1) and -29.2% (1-2-3-1): the two examples, now -0.3% and
    -0.1%). Rounds of different sizes side by side (2-3-1, 3-2-1): the next test. Since
    1f1b is priced by its event graph (`cost.steady_cycle`), 200 draws of these patterns and
    200 of `MIDDLE`'s agree with the simulator within 0.4%."""
    _assert_closed_form_near(pattern, blocks, flights, cluster, bucketed, rel=0.15)


UNEQUAL = [[2, 3, 1], [3, 2, 1], [2, 3], [3, 2], [3, 4, 1], [1, 2, 3], [1, 3, 2], [2, 3, 1, 1],
           [3, 2, 1, 1], [2, 4, 1], [4, 2, 1], [2, 3, 2], [3, 2, 3], [1, 3, 2, 1],
           [1, 2, 4, 1]]  # replicated neighbours whose rounds differ in size


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.sampled_from(UNEQUAL),
       blocks=FOUR_BLOCKS, flights=FOUR_FLIGHTS, cluster=MACHINES, bucketed=st.booleans())
@example(pattern=[2, 3, 1], blocks=[(0.01716, 0.03613, 1.847e7, 1.081e8),
                                    (0.009043, 0.0288, 5.585e6, 1.623e8),
                                    (0.01729, 0.03601, 1.184e7, 1.9e8)],
         flights=[5, 3, 4], cluster="8@1e9~5us", bucketed=False)
@example(pattern=[2, 3, 2], blocks=[(0.01061, 0.02351, 8.259e6, 1.845e7),
                                    (0.01068, 0.03295, 6.004e6, 7.189e7),
                                    (0.003695, 0.02702, 1.228e6, 1.331e8)],
         flights=[5, 3, 2], cluster="8@1e10~5us", bucketed=True)
@example(pattern=[3, 2, 3], blocks=[(0.01076, 0.01395, 1.371e7, 1.838e7),
                                    (0.007709, 0.03586, 4.625e6, 1.935e8),
                                    (0.01972, 0.02386, 9.047e5, 1.87e7)],
         flights=[2, 2, 1], cluster="8@1e10~5us", bucketed=True)
def test_closed_form_follows_rounds_of_different_sizes_side_by_side(
        pattern: list[int], blocks: list[tuple[float, float, float, float]],
        flights: list[int], cluster: str, bucketed: bool) -> None:
    """Replicated stages of different replica counts next to each other (2-3-1, 3-2-1, 2-3,
    3-4-1, ...), any runnable in-flight counts: a round of one ends on different replicas of
    the other, so the binding circuit runs through several replicas of both over
    lcm(r_1, r_2) microbatches; the closed form prices 1f1b by its event graph over that
    period (`cost.steady_cycle`). Within 15% of the simulator, as the tests above (measured
    on 300 random draws of these patterns: every one within 1e-13 of the simulator; before,
    by `pipeline_time`'s circuits, -24.5% at worst (2-3-2), 14 of 300 outside 15%: the three
    examples, then -20.3%, -18.5% and -17.6%)."""
    _assert_closed_form_near(pattern, blocks, flights, cluster, bucketed, rel=0.15)
