"""The steady state of PipeDream's 1F1B with round-robin replicas, as a timed event graph.

Every action of the schedule waits for the one before it on its rank and for what it receives;
the simulator (backends/simulate.py) starts each as soon as both allow, so its times obey
x_v >= x_u + (u's seconds) along every such dependency, with equality on the latest: max-plus
linear. Microbatch m runs on replica m mod r_s of stage s, so the schedule repeats after
L = lcm(r_0, ..., r_{S-1}) microbatches, and its steady state takes the largest cycle ratio of
the graph of one period's events (`cycle_ratio`) per microbatch: seconds over microbatches
along the slowest circuit, whichever replicas and stages that circuit passes through. Where
adjacent stages have rounds of different sizes (2-3-1: a round of stage 0 ends on either
replica of stage 1 and of stage 2), the binding circuit runs through several replicas of both,
over several rounds; no circuit of one stage's round alone gives it (`pipeline_time`'s circuits
were 18-20% below the simulator there).

Events per microbatch residue m (start times): F_s(m) and B_s(m) on replica m mod r_s; the
all-reduce A_s(k) of round k (microbatches k r_s .. k r_s + r_s - 1, replicated stages); per
stage edge (a, c) the start of the activations' transfer a -> c and of the gradients' c -> a,
each on the directed rank pair that m uses. Edges, with N_s in flight per replica
(warm-up N_s - 1, so D_s = (N_s - 1) r_s):

* a replica's order: F_s(m) -> B_s(m - D_s) (forward and a weight copy where the stage stashes);
  B_s(m) -> F_s(m + D_s + r_s) (backward with its deferred weight gradients, the step), through
  A_s(k) on a replicated stage, which waits for the backward of every replica's microbatch of
  its round (the all-reduce's exposed seconds, then the step);
* stages sharing tied parameters across ranks (`tie_group`, equal replica counts, as '1f1b'
  requires) all-reduce them at each update once every one of them has reached it: their
  update k passes through one event T(k) of their group, the backward (one replica) or the
  all-reduce (several) of round k leading into it, and from it the tie's seconds and the step
  lead to the next forward;
* a transfer starts when its sender's action ends (a backward's send before its deferred weight
  gradients) and when the rank pair's link has carried the previous microbatch of the pair
  (lcm(r_a, r_c) earlier), and arrives latency + bytes / bandwidth later; where the sender's CPU
  copies (loopback), the sender is busy until its bytes are on the link.

Tokens count microbatches, so the ratio is seconds per microbatch. Stage work, link occupancy,
round trips and every lockstep round are cycles of this one graph. Not in it: the servers'
network interfaces and ranks sharing processors (bounds the callers apply), replicas taking
unequal shares of a round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pdcompile.cost.cycle_ratio import Solved, policy_iteration_on
from pdcompile.cost.links import link_busy_seconds, pair_levels
from pdcompile.machine.cluster import Cluster


class Terms(Protocol):
    """What a stage's `pipeline_time.StageTerms` gives this graph (seconds; see there)."""

    @property
    def fwd(self) -> float: ...
    @property
    def bwd(self) -> float: ...
    @property
    def allreduce(self) -> float: ...
    @property
    def step(self) -> float: ...
    @property
    def copy(self) -> float: ...
    @property
    def replicas(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def deferred(self) -> float: ...
    @property
    def tie(self) -> float: ...
    @property
    def tie_group(self) -> tuple[int, ...]: ...


class _Graph:
    """Nodes numbered as they are made (`stage`: each one's stage), and edges added in blocks
    of arrays (source, target, seconds, tokens; scalars broadcast): `arrays` orders them node
    after node, each node's edges in the order they were added, the order a list of edges per
    node would have (the policy iteration prefers a node's first edge among equals)."""

    def __init__(self) -> None:
        self.count = 0
        self.stage: list[np.ndarray] = []
        self.blocks: list[tuple[np.ndarray, ...]] = []

    def nodes(self, count: int, stage: int) -> int:
        """`count` new nodes of `stage`; the first one's number."""
        first = self.count
        self.count += count
        self.stage.append(np.full(count, stage, dtype=np.intp))
        return first

    def add(self, source: np.ndarray, target: np.ndarray, seconds: np.ndarray | float,
            tokens: np.ndarray | int) -> None:
        size = len(source)
        self.blocks.append((source, target, _column(seconds, size), _column(tokens, size)))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(edges out per node, then every edge's target, seconds and tokens, node after
        node)."""
        source, target, seconds, tokens = (np.concatenate(part) for part in zip(*self.blocks,
                                                                                 strict=True))
        order = np.argsort(source, kind="stable")
        return (np.bincount(source, minlength=self.count), target[order], seconds[order],
                tokens[order])


def _column(value: np.ndarray | float, size: int) -> np.ndarray:
    """`value` as `size` floats: a number repeated, an array as it is (np.broadcast_to did
    this at some microseconds a call, 50,000 calls in a wide cluster's search)."""
    if isinstance(value, (int, float)):
        return np.full(size, float(value))
    if isinstance(value, np.ndarray) and value.shape == (size,) and value.dtype == float:
        return value
    return np.broadcast_to(np.asarray(value, dtype=float), (size,))


def steady_cycle(terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                 stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *,
                 cap: int) -> tuple[float, tuple[int, ...]] | None:
    """(seconds per microbatch of 1F1B's steady state, the stages its binding circuit passes
    through), or None where the period (lcm of the replica counts) exceeds `cap` microbatches.
    `edges`: bytes per microbatch from stage a to stage c."""
    found = steady_solved(terms, edges, stage_ranks, cluster, cap=cap)
    return None if found is None else (found[0].ratio, found[1])


def steady_solved(terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                  stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *, cap: int,
                  start: Solved | None = None, stop: float = math.inf,
                  ) -> tuple[Solved, tuple[int, ...]] | None:
    """`steady_cycle` with the policy iteration's end (`cycle_ratio.policy_iteration`, its
    `start` and `stop`): the same pipeline with other in-flight counts has a graph of the same
    shape (they change the targets and tokens of edges, not how many leave each event), so its
    pricing may start from this one's policy."""
    graph = _steady_graph(terms, edges, stage_ranks, cluster, cap=cap)
    if graph is None:
        return None
    solved = policy_iteration_on(*graph.arrays(), start=start, stop=stop)
    stage = np.concatenate(graph.stage)
    return solved, tuple(sorted({int(stage[u]) for u in solved.cycle}))


def _steady_graph(terms: Sequence[Terms], edges: dict[tuple[int, int], float],
                  stage_ranks: Sequence[Sequence[int]], cluster: Cluster, *,
                  cap: int) -> _Graph | None:
    """The event graph of one period of the steady state (module docstring), or None where
    the period exceeds `cap` microbatches."""
    period = math.lcm(*(t.replicas for t in terms))
    if period > cap:
        return None
    graph = _Graph()
    forward = [graph.nodes(period, s) for s in range(len(terms))]
    backward = [graph.nodes(period, s) for s in range(len(terms))]
    tied = _tie_events(graph, terms, period)
    m = np.arange(period)
    # where each replica goes after its backward of m: its next forward, or its round's
    # all-reduce (per m: target, seconds, tokens)
    after: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for s, t in enumerate(terms):
        r, held = t.replicas, (t.in_flight - 1) * t.replicas
        rounds = graph.nodes(period // r, s) if r > 1 else -1
        graph.add(forward[s] + m, backward[s] + (m - held) % period, t.fwd + t.copy, -held)
        later = m + held + r  # the replica's next forward
        nothing = np.zeros(period)
        if r == 1 and s in tied:  # the tie's all-reduce, then the step
            hops = (tied[s] + m, nothing, np.zeros(period, dtype=np.intp))
            graph.add(tied[s] + m, forward[s] + later % period, t.tie + t.step, held + r)
        elif r == 1:
            hops = (forward[s] + later % period, np.full(period, t.step),
                    np.full(period, held + r))
        else:
            last = m - m % r + r - 1  # the round's last microbatch: the all-reduce's index
            hops = (rounds + m // r, nothing, last - m)
            if s in tied:  # the replicas' all-reduce, then the tie's, then the step
                graph.add(rounds + m // r, tied[s] + m // r, t.allreduce - t.tie, 0)
                graph.add(tied[s] + m // r, forward[s] + later % period, t.tie + t.step,
                          later - last)
            else:
                graph.add(rounds + m // r, forward[s] + later % period, t.allreduce + t.step,
                          later - last)
        graph.add(backward[s] + m, hops[0], t.bwd + hops[1], hops[2])
        after.append(hops)
    for (a, c), size in edges.items():
        levels = pair_levels(cluster, stage_ranks[a], stage_ranks[c])
        pair = len(levels)  # microbatches m and m + pair share a rank pair
        busy_of = [link_busy_seconds(size, level) for level in levels]
        busy = np.array(busy_of)[m % pair]
        arrival = np.array([b + level.latency if size > 0 else 0.0
                            for b, level in zip(busy_of, levels, strict=True)])[m % pair]
        copying = np.array([bool(level.cpu_copies and b > 0)
                            for b, level in zip(busy_of, levels, strict=True)])[m % pair]
        for there, (sender, receiver, ready) in enumerate(
                ((a, c, terms[a].fwd + terms[a].copy),
                 (c, a, terms[c].bwd - terms[c].deferred))):
            starts = graph.nodes(period, sender)
            events = forward if there == 0 else backward  # what sends it and what receives it
            graph.add(events[sender] + m, starts + m, ready, 0)
            graph.add(starts + m, starts + (m + pair) % period, busy, pair)
            graph.add(starts + m, events[receiver] + m, arrival, 0)
            if copying.any():  # the sender copies until it is on the link
                at = m[copying]
                if there == 0:
                    held = (terms[a].in_flight - 1) * terms[a].replicas
                    graph.add(starts + at, backward[a] + (at - held) % period, busy[at], -held)
                else:
                    target, seconds, tokens = (part[at] for part in after[c])
                    graph.add(starts + at, target, busy[at] + terms[c].deferred + seconds,
                              tokens)
    return graph


def _tie_events(graph: _Graph, terms: Sequence[Terms], period: int) -> dict[int, int]:
    """Per stage whose updates wait for a tie's all-reduce, the first of its group's update
    events T(k), k < period / replicas, made here (stages whose ties join them share one
    group). A group whose stages differ in replica count, which '1f1b' refuses, gets none."""
    group = list(range(len(terms)))  # union-find over the stages sharing ties

    def root(s: int) -> int:
        while group[s] != s:
            group[s] = group[group[s]]
            s = group[s]
        return s

    for s, t in enumerate(terms):
        if t.tie > 0.0:
            for other in t.tie_group:
                group[root(other)] = root(s)
    members: dict[int, list[int]] = {}
    for s, t in enumerate(terms):
        if t.tie > 0.0:
            members.setdefault(root(s), []).append(s)
    out: dict[int, int] = {}
    for stages in members.values():
        replicas = {terms[s].replicas for s in stages}
        if len(stages) < 2 or len(replicas) > 1:
            continue
        first = graph.nodes(period // replicas.pop(), stages[0])
        out.update((s, first) for s in stages)
    return out


__all__ = ["steady_cycle", "steady_solved"]
