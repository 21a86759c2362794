"""1F1B's steady state priced faster gives the same figures: the event graph built on arrays
(`steady_cycle`) against one built event by event, and the deepening of in-flight counts whose
trials start from the binding graph's policy and stop early (`pipeline_time._deepened`) against
one that prices every trial from a cold start. The references here are the straightforward
versions the faster ones replaced; the figures must agree to the bit (the planner's plans may
not change), ties between cycles of equal ratio included: hence few distinct costs."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.cost import pipeline_time
from pdcompile.cost.cycle_ratio import largest_cycle_ratio, policy_iteration
from pdcompile.cost.links import link_busy_seconds, pair_levels
from pdcompile.cost.pipeline_time import PAIRS_CAP, StageTerms, runnable_in_flight
from pdcompile.cost.steady_cycle import _tie_events, steady_cycle
from pdcompile.machine.cluster import Cluster, Level

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# 2 hosts of 4 processes (loopback: the sender's CPU copies) joined by a slow network
CLUSTER = Cluster(levels=(Level(4, 2e9, 2e-5, cpu_copies=True), Level(2, 1e8, 5e-5)))
SECONDS = [0.0, 1e-3, 2e-3, 3e-3]  # few values: cycles tie


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[list[StageTerms], dict[tuple[int, int], float],
                                         list[tuple[int, ...]]]:
    """2-4 stages of 1-3 replicas on consecutive ranks of `CLUSTER`, runnable in-flight counts,
    a skip edge at times, and tied parameters between the first and last stage at times."""
    count = draw(st.integers(2, 4))
    replicas = [draw(st.integers(1, 3)) for _ in range(count)]
    if sum(replicas) > 8:
        replicas = [1] * count
    flight = runnable_in_flight([draw(st.integers(1, 4)) for _ in range(count)], replicas)
    tied = draw(st.booleans()) and replicas[0] == replicas[-1]
    terms, ranks, rank = [], [], 0
    for s in range(count):
        bwd = draw(st.sampled_from(SECONDS[1:]))
        tie = 1e-3 if tied and s in (0, count - 1) else 0.0
        terms.append(StageTerms(
            fwd=draw(st.sampled_from(SECONDS[1:])), bwd=bwd,
            allreduce=draw(st.sampled_from(SECONDS)) + tie, step=draw(st.sampled_from(SECONDS)),
            copy=draw(st.sampled_from(SECONDS)), cpu_copies=0.0, replicas=replicas[s],
            in_flight=flight[s], deferred=draw(st.sampled_from([0.0, bwd / 2])), tie=tie,
            tie_group=(0, count - 1) if tie else ()))
        ranks.append(tuple(range(rank, rank + replicas[s])))
        rank += replicas[s]
    edges = {(s, s + 1): draw(st.sampled_from([0.0, 1e5, 2e6])) for s in range(count - 1)}
    if count > 2 and draw(st.booleans()):
        edges[0, 2] = 1e6
    return terms, edges, ranks


def _reference_cycle(terms: list[StageTerms], edges: dict[tuple[int, int], float],
                     stage_ranks: list[tuple[int, ...]],
                     cluster: Cluster) -> tuple[float, tuple[int, ...]]:
    """`steady_cycle`'s graph built one event and one edge at a time (cost/steady_cycle.py's
    docstring), priced by `largest_cycle_ratio`."""
    period = math.lcm(*(t.replicas for t in terms))
    graph: list[list[tuple[int, float, int]]] = []
    stage: list[int] = []

    class Nodes:  # what `_tie_events` makes its events with
        @staticmethod
        def nodes(count: int, s: int) -> int:
            graph.extend([] for _ in range(count))
            stage.extend([s] * count)
            return len(graph) - count

    def add(u: int, v: int, seconds: float, tokens: int) -> None:
        graph[u].append((v, seconds, tokens))

    forward = [Nodes.nodes(period, s) for s in range(len(terms))]
    backward = [Nodes.nodes(period, s) for s in range(len(terms))]
    tied = _tie_events(Nodes, terms, period)  # type: ignore[arg-type]
    after: list[list[tuple[int, float, int]]] = []
    for s, t in enumerate(terms):
        r, held = t.replicas, (t.in_flight - 1) * t.replicas
        rounds = Nodes.nodes(period // r, s) if r > 1 else -1
        hops = []
        for m in range(period):
            add(forward[s] + m, backward[s] + (m - held) % period, t.fwd + t.copy, -held)
            later = m + held + r
            if r == 1 and s in tied:
                hops.append((tied[s] + m, 0.0, 0))
                add(tied[s] + m, forward[s] + later % period, t.tie + t.step, held + r)
                continue
            if r == 1:
                hops.append((forward[s] + later % period, t.step, held + r))
                continue
            last = m - m % r + r - 1
            hops.append((rounds + m // r, 0.0, last - m))
            if s in tied:
                add(rounds + m // r, tied[s] + m // r, t.allreduce - t.tie, 0)
                add(tied[s] + m // r, forward[s] + later % period, t.tie + t.step, later - last)
                continue
            add(rounds + m // r, forward[s] + later % period, t.allreduce + t.step, later - last)
        for m, (target, seconds, tokens) in enumerate(hops):
            add(backward[s] + m, target, t.bwd + seconds, tokens)
        after.append(hops)
    for (a, c), size in edges.items():
        levels = pair_levels(cluster, stage_ranks[a], stage_ranks[c])
        pair = len(levels)
        for there, (sender, receiver, ready) in enumerate(
                ((a, c, terms[a].fwd + terms[a].copy),
                 (c, a, terms[c].bwd - terms[c].deferred))):
            starts = Nodes.nodes(period, sender)
            events = forward if there == 0 else backward
            for m in range(period):
                level = levels[m % pair]
                busy = link_busy_seconds(size, level)
                arrival = busy + level.latency if size > 0 else 0.0
                add(events[sender] + m, starts + m, ready, 0)
                add(starts + m, starts + (m + pair) % period, busy, pair)
                add(starts + m, events[receiver] + m, arrival, 0)
                if level.cpu_copies and busy > 0:
                    if there == 0:
                        held = (terms[a].in_flight - 1) * terms[a].replicas
                        add(starts + m, backward[a] + (m - held) % period, busy, -held)
                    else:
                        target, seconds, tokens = after[c][m]
                        add(starts + m, target, busy + terms[c].deferred + seconds, tokens)
    ratio, cycle = largest_cycle_ratio(graph)
    return ratio, tuple(sorted({stage[u] for u in cycle}))


def _reference_deepened(terms: list[StageTerms], edges: dict[tuple[int, int], float],
                        stage_ranks: list[tuple[int, ...]], cluster: Cluster, chosen: list[int],
                        limits: list[int], per: float) -> list[int]:
    """`pipeline_time._deepened` with every trial priced from a cold start."""
    replicas = [t.replicas for t in terms]

    def cycle(flight: list[int]) -> tuple[float, tuple[int, ...]] | None:
        deeper = [replace(t, in_flight=n) for t, n in zip(terms, flight, strict=True)]
        return steady_cycle(deeper, edges, stage_ranks, cluster, cap=PAIRS_CAP)

    found = cycle(chosen)
    while found is not None and found[0] > per:
        ratio, stages = found
        better = None
        for s in [*stages, *(k for k in range(max(stages)) if k not in stages)]:
            if chosen[s] >= limits[s]:
                continue
            trial = runnable_in_flight(chosen[:s] + [chosen[s] + 1] + chosen[s + 1:], replicas)
            if trial == chosen:
                continue
            tried = cycle(trial)
            if tried is not None and tried[0] < ratio * (1.0 - 1e-9):
                better = trial, tried
                break
        if better is None:
            break
        chosen, found = better
    return chosen


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pipeline=pipelines())
def test_the_graph_on_arrays_is_the_graph_event_by_event(
        pipeline: tuple[list[StageTerms], dict[tuple[int, int], float],
                        list[tuple[int, ...]]]) -> None:
    """Same ratio to the bit, same stages on the binding cycle (ties broken alike)."""
    terms, edges, ranks = pipeline
    assert steady_cycle(terms, edges, ranks, CLUSTER, cap=PAIRS_CAP) \
        == _reference_cycle(terms, edges, ranks, CLUSTER)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pipeline=pipelines(), data=st.data())
def test_warm_started_deepening_deepens_as_cold_starts_do(
        pipeline: tuple[list[StageTerms], dict[tuple[int, int], float],
                        list[tuple[int, ...]]], data: st.DataObject) -> None:
    """From the drawn in-flight counts towards a target below the steady state's period
    (deepening needs several steps, most trials fail), within drawn memory limits."""
    terms, edges, ranks = pipeline
    chosen = [t.in_flight for t in terms]
    limits = [n + data.draw(st.integers(0, 4)) for n in chosen]
    ratio, _ = steady_cycle(terms, edges, ranks, CLUSTER, cap=PAIRS_CAP)
    per = ratio * data.draw(st.sampled_from([0.2, 0.5, 0.8, 1.0]))
    assert pipeline_time._deepened(terms, edges, ranks, CLUSTER, chosen, limits, per) \
        == _reference_deepened(terms, edges, ranks, CLUSTER, chosen, limits, per)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data(), count=st.integers(2, 12))
def test_a_start_and_a_stop_keep_the_largest_ratio(data: st.DataObject, count: int) -> None:
    """Started from another graph's policy (same edges per node, other targets and tokens),
    the policy iteration ends at the cold start's ratio; told to stop at a ratio, it stops only
    where the graph has a cycle at least that slow."""

    def graph() -> list[list[tuple[int, float, int]]]:
        potential = data.draw(st.lists(st.integers(-3, 3), min_size=count, max_size=count))
        out = []
        for u in range(count):
            row = []
            for _ in range(2 if u % 3 else 1):
                v = data.draw(st.integers(0, count - 1))
                row.append((v, data.draw(st.sampled_from(SECONDS)),
                            potential[v] - potential[u] + data.draw(st.integers(1, 3))))
            out.append(row)
        return out

    before, after = graph(), graph()
    cold = policy_iteration(after)
    warm = policy_iteration(after, start=policy_iteration(before))
    assert warm.ratio == pytest.approx(cold.ratio, rel=1e-12, abs=1e-15)
    stop = cold.ratio * data.draw(st.sampled_from([0.5, 1.0, 1.5]))
    stopped = policy_iteration(after, start=policy_iteration(before), stop=stop)
    assert stopped.stopped == (stop <= stopped.ratio)
    if stopped.stopped:
        assert cold.ratio >= stop * (1 - 1e-12)
    else:
        assert stopped.ratio == pytest.approx(cold.ratio, rel=1e-12, abs=1e-15)
    assert np.array_equal(cold.degree, [len(row) for row in after])
