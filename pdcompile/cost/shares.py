"""Proportional shares: how many of each round's microbatches every replica of a stage takes
when the replicas compute at different speeds (a mixed cluster), and the speed that buys.

Replicas that take microbatches in turn (round robin) run at the slowest one's pace: a round of
r microbatches lasts r / r times the slowest replica's time per microbatch. With shares c_i of a
round of n = sum(c) microbatches, replica i is busy c_i / s_i (its speed s_i) and the round lasts
max_i c_i / s_i, so the stage runs as r replicas of speed n / (r max_i c_i / s_i) each
(`shared_speed`), up to sum(s) / r when the shares are exactly proportional.

Counts are whole numbers. `proportional_shares` rounds by giving every replica one microbatch and
then each next one to the replica that would finish it first (the smallest (c_i + 1) / s_i,
ties to the lower index), which makes the round as short as any whole counts can for its size.
`round_shares` picks the size for asynchronous 1F1B, where a round is one weight update: the
smallest from r up to `most` whose shares come within `tolerance` of the proportional speed.
"""

from __future__ import annotations

from collections.abc import Sequence

ROUND_MOST = 2  # a 1F1B round of proportional shares holds at most this many per replica
TOLERANCE = 0.05  # ... and stops growing once its speed is within this of proportional


def proportional_shares(speeds: Sequence[float], total: int) -> tuple[int, ...]:
    """`total` microbatches over replicas of `speeds`, at least one each (module docstring)."""
    if total < len(speeds) or not speeds or min(speeds) <= 0:
        raise ValueError(f"{total} microbatches cannot give each of {len(speeds)} replicas of "
                         f"speeds {list(speeds)} one")
    counts = [1] * len(speeds)
    for _ in range(total - len(speeds)):
        best = min(range(len(speeds)), key=lambda i: ((counts[i] + 1) / speeds[i], i))
        counts[best] += 1
    return tuple(counts)


def shared_speed(speeds: Sequence[float], shares: Sequence[int]) -> float:
    """The speed every replica of a stage runs at, as if all were alike, where they take
    `shares` of each round: n / (r max_i c_i / s_i). Round robin (all ones): the slowest."""
    longest = max(c / s for c, s in zip(shares, speeds, strict=True))
    return sum(shares) / (len(shares) * longest)


def round_shares(speeds: Sequence[float], *, most: int = ROUND_MOST,
                 tolerance: float = TOLERANCE) -> tuple[int, ...]:
    """Shares of a round for asynchronous 1F1B: the smallest round (from one each up to `most`
    each) whose `shared_speed` is within `tolerance` of the proportional one, else the fastest.
    Replicas of one speed take one each (round robin)."""
    if max(speeds) - min(speeds) <= 1e-12 * max(speeds):
        return (1,) * len(speeds)
    ideal = sum(speeds) / len(speeds)
    best: tuple[float, tuple[int, ...]] = (0.0, (1,) * len(speeds))
    for total in range(len(speeds), most * len(speeds) + 1):
        counts = proportional_shares(speeds, total)
        speed = shared_speed(speeds, counts)
        if speed >= ideal * (1 - tolerance):
            return counts
        if speed > best[0] * (1 + 1e-12):
            best = (speed, counts)
    return best[1]


__all__ = ["ROUND_MOST", "TOLERANCE", "proportional_shares", "round_shares", "shared_speed"]
