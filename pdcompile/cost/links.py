"""Time on the wires: a point-to-point transfer and a ring all-reduce on one cluster level.

The one place these formulas are written; the planners, the stage tables and the simulator call
them. A level has a bandwidth (bytes/s) and a latency (s) per message (cluster.Level); one
transfer, and each hop of a ring, is one connection and runs at the level's `flow_rate` (a
network may cap single flows below the link). Where the cluster's replicas all-reduce their
gradients in buckets during the backward (`Cluster.allreduce_bucket`, PyTorch DDP), only part of
the all-reduce is left after the backward (`exposed_allreduce_seconds`). docs/cost-model.md gives
the sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pdcompile.machine.cluster import Cluster, Level


def link_busy_seconds(nbytes: float, level: Level) -> float:
    """Seconds a transfer of `nbytes` occupies its link (latency not included: the link can carry
    the next message while this one's last byte is in flight)."""
    return nbytes / level.flow_rate if nbytes > 0 else 0.0


def transfer_seconds(nbytes: float, level: Level) -> float:
    """Seconds from the start of a transfer of `nbytes` to its arrival: bytes / bandwidth +
    latency; 0 for nothing."""
    return nbytes / level.flow_rate + level.latency if nbytes > 0 else 0.0


def ring_allreduce_seconds(nbytes: float, replicas: int, level: Level) -> float:
    """A ring all-reduce of `nbytes` among `replicas` workers over `level` (its slowest link):
    2 (r-1)/r bytes / bus bandwidth (`Level.allreduce_rate`) + 2 (r-1) latencies; 0 for one
    replica."""
    if replicas <= 1:
        return 0.0
    r = replicas
    return 2.0 * (r - 1) / r * nbytes / level.allreduce_rate + 2.0 * (r - 1) * level.latency


def stage_allreduce_seconds(nbytes: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """The all-reduce of a stage replicated on `ranks`, over the slowest level they span."""
    level = cluster.levels[cluster.slowest_level_of(list(ranks))]
    return ring_allreduce_seconds(nbytes, len(ranks), level)


def exposed_allreduce_seconds(allreduce: Any, *, backward: Any, params: Any,
                              bucket: float | None) -> Any:
    """Seconds of a stage's all-reduce (`allreduce`, whole) that remain after its backward
    (`backward` seconds, over `params` bytes of gradients) ends.

    `bucket` None: the all-reduce starts after the backward, all of it remains. Otherwise
    gradients are all-reduced in buckets of `bucket` bytes, one after another on one stream,
    each as soon as the backward has produced it (PyTorch DDP). With gradients produced at an
    even rate over the backward, n = params / bucket buckets of a = allreduce / n seconds each,
    the last all-reduce ends max over k of (k/n backward + (n - k + 1) a) after the backward's
    start: what remains is the larger of the last bucket's all-reduce and the all-reduce less
    the backward but its last bucket's share, max(a, allreduce - (1 - 1/n) backward); all of it
    where the gradients fit one bucket (n <= 1).

    Floats give a float; numpy arrays (the planners' candidate stages) broadcast and give an
    array, by the same formula."""
    if bucket is None:
        return allreduce
    if isinstance(allreduce, float | int) and isinstance(backward, float | int) \
            and isinstance(params, float | int):
        if allreduce <= 0.0 or params <= bucket:
            return allreduce
        share = bucket / params  # 1/n
        return max(allreduce * share, allreduce - (1.0 - share) * backward)
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # where picks 1.0
        shares = np.where(np.asarray(params) > bucket,
                          np.asarray(bucket, dtype=np.float64) / np.asarray(params), 1.0)
    return np.maximum(allreduce * shares, allreduce - (1.0 - shares) * np.asarray(backward))


def pair_levels(cluster: Cluster, a: Sequence[int], b: Sequence[int]) -> list[Level]:
    """The level each transfer between two stages on ranks `a` and `b` crosses, per microbatch
    residue: microbatch m goes from a[m % len(a)] to b[m % len(b)] (round robin over replicas),
    so the rank pairs used are those of m < lcm(len(a), len(b))."""
    return [cluster.levels[k] for k in _pair_level_indices(cluster, a, b)]


def _pair_level_indices(cluster: Cluster, a: Sequence[int], b: Sequence[int]) -> list[int]:
    """`pair_levels` as indices into `cluster.levels` (what `slowest_link` compares)."""
    pairs = math.lcm(len(a), len(b))
    if len(cluster.levels) == 1 and max(*a, *b) < cluster.workers:  # one level: every pair
        return [0] * pairs
    return [cluster.link_level(a[m % len(a)], b[m % len(b)]) for m in range(pairs)]


def nic_busy_seconds(stage_ranks: Sequence[Sequence[int]], edges: dict[tuple[int, int], float],
                     params: Sequence[float], cluster: Cluster, *,
                     allreduces: Sequence[float] | None = None,
                     rings: Sequence[tuple[Sequence[int], float, float]] = ()) -> float:
    """Seconds per microbatch that the busiest server's network interface (the outermost
    level's link of one group of the level below) needs for everything crossing it, one way:
    the activations and gradients between stages (microbatch m goes from a[m % len(a)] to
    c[m % len(c)], `pair_levels`' rule), each replicated stage's ring all-reduces
    (`allreduces[s]` per microbatch, default once per round of its replicas, 1/r) and the other
    ring all-reduces in `rings`, each (ranks, bytes, all-reduces per microbatch): the tied
    parameters' over the ranks sharing them (cost/ties.py). A ring enters and leaves each server
    it spans once, carrying 2 (r-1)/r of its bytes. The flows of one server's workers share it,
    whatever a single flow may reach (`Level.flow_rate`), so a plan cannot run faster than this
    per microbatch; 0 on a one-level cluster. A throughput bound: where it is below a plan's
    time per microbatch the interface never limits the steady state (docs/cost-model.md)."""
    if len(cluster.levels) < 2:
        return 0.0
    nic = cluster.levels[-1].bandwidth
    server = cluster.group_size(len(cluster.levels) - 2)  # workers behind one interface
    load: dict[tuple[int, str], float] = {}

    def carry(src: int, dst: int, nbytes: float) -> None:
        if src // server != dst // server:
            load[src // server, "out"] = load.get((src // server, "out"), 0.0) + nbytes
            load[dst // server, "in"] = load.get((dst // server, "in"), 0.0) + nbytes

    for (a, c), size in edges.items():
        senders, receivers = stage_ranks[a], stage_ranks[c]
        rounds = math.lcm(len(senders), len(receivers))
        for m in range(rounds):  # activations forward, their gradients back: same bytes
            carry(senders[m % len(senders)], receivers[m % len(receivers)], size / rounds)
            carry(receivers[m % len(receivers)], senders[m % len(senders)], size / rounds)
    replicas = [(ranks, nbytes, 1.0 / len(ranks) if allreduces is None else allreduces[s])
                for s, (ranks, nbytes) in enumerate(zip(stage_ranks, params, strict=True))]
    for ranks, nbytes, count in [*replicas, *rings]:
        servers = sorted({rank // server for rank in ranks})
        r = len(set(ranks))
        if len(servers) > 1:
            for host in servers:
                for way in ("in", "out"):
                    load[host, way] = load.get((host, way), 0.0) \
                        + 2.0 * (r - 1) / r * nbytes * count
    return max(load.values(), default=0.0) / nic


def slowest_link(cluster: Cluster, a: Sequence[int], b: Sequence[int]) -> Level:
    """The slowest level that the transfers between two stages on ranks `a` and `b` cross
    (`pair_levels`)."""
    return cluster.levels[max(_pair_level_indices(cluster, a, b))]


__all__ = ["exposed_allreduce_seconds", "link_busy_seconds", "nic_busy_seconds", "pair_levels",
           "ring_allreduce_seconds", "slowest_link", "stage_allreduce_seconds",
           "transfer_seconds"]
