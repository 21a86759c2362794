"""Time on the wires: a point-to-point transfer and a ring all-reduce on one cluster level.

The one place these formulas are written; the planners, the stage tables and the simulator call
them. A level has a bandwidth (bytes/s) and a latency (s) per message (cluster.Level).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdcompile.machine.cluster import Cluster, Level


def link_busy_seconds(nbytes: float, level: Level) -> float:
    """Seconds a transfer of `nbytes` occupies its link (latency not included: the link can carry
    the next message while this one's last byte is in flight)."""
    return nbytes / level.bandwidth if nbytes > 0 else 0.0


def transfer_seconds(nbytes: float, level: Level) -> float:
    """Seconds from the start of a transfer of `nbytes` to its arrival: bytes / bandwidth +
    latency; 0 for nothing."""
    return nbytes / level.bandwidth + level.latency if nbytes > 0 else 0.0


def ring_allreduce_seconds(nbytes: float, replicas: int, level: Level) -> float:
    """A ring all-reduce of `nbytes` among `replicas` workers over `level` (its slowest link):
    2 (r-1)/r bytes / bandwidth + 2 (r-1) latencies; 0 for one replica."""
    if replicas <= 1:
        return 0.0
    r = replicas
    return 2.0 * (r - 1) / r * nbytes / level.bandwidth + 2.0 * (r - 1) * level.latency


def stage_allreduce_seconds(nbytes: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """The all-reduce of a stage replicated on `ranks`, over the slowest level they span."""
    level = cluster.levels[cluster.slowest_level_of(list(ranks))]
    return ring_allreduce_seconds(nbytes, len(ranks), level)


def pair_levels(cluster: Cluster, a: Sequence[int], b: Sequence[int]) -> list[Level]:
    """The level each transfer between two stages on ranks `a` and `b` crosses, per microbatch
    residue: microbatch m goes from a[m % len(a)] to b[m % len(b)] (round robin over replicas),
    so the rank pairs used are those of m < lcm(len(a), len(b))."""
    if len(cluster.levels) == 1 and max(*a, *b) < cluster.workers:  # one level: every pair
        return [cluster.levels[0]] * math.lcm(len(a), len(b))
    return [cluster.levels[cluster.link_level(a[m % len(a)], b[m % len(b)])]
            for m in range(math.lcm(len(a), len(b)))]


def slowest_link(cluster: Cluster, a: Sequence[int], b: Sequence[int]) -> Level:
    """The slowest level that the transfers between two stages on ranks `a` and `b` cross
    (`pair_levels`)."""
    levels = pair_levels(cluster, a, b)
    return cluster.levels[max(cluster.levels.index(level) for level in levels)]


__all__ = ["link_busy_seconds", "pair_levels", "ring_allreduce_seconds", "slowest_link",
           "stage_allreduce_seconds", "transfer_seconds"]
