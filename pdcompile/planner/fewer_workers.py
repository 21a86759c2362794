"""Plans on fewer workers than the cluster has: which smaller clusters the planner also tries,
and the words that say why a plan leaves workers idle.

Every plan on all of a cluster's workers shares its model's work at a price: the all-reduce of
every replicated stage's gradients (a tied parameter's too, between the stages holding it) and
the transfers between stages. Over a slow link that price can exceed what the extra workers
save: a GPT-like chain whose token embedding is tied to its output head takes 52.6 ms per
minibatch on one worker and 138 ms under data parallelism on two over 1 GB/s, every plan on
both paying the blocks' and the tie's all-reduce. So the planner (search.py) also prices the
whole model on one worker, and plans again on a smaller cluster (`smaller`: half the servers,
or half the workers of a flat cluster) wherever the best plan on all of them is slower than
every worker of the smaller cluster computing without pause (a lower bound on any plan
there), which it rarely is where the work scales: wide clusters pay for no second search.
The smaller cluster's ranks are the first ones of the cluster, so its plan is a plan on the
cluster with the later ranks idle, priced there as any other.

Any other number of workers comes from the DP's own table (planner/dp.py `DPResult.fewer`):
it holds the best pipeline of the model by its objective on every count of units (three
blocks of 100 MB of weights on 4 workers over 1 GB/s: every plan on 4 replicates a stage and
all-reduces it; 3 on 3 take 25.5 ms, the first half's 2 stages 31.1 ms). The objective can
misrank those against the price (under a flush it counts no stage's fill before it: 1-2-1 on
4 workers over 10 GB/s at 18.01 ms, straight on 3 of them, which it ranked behind, 15.11 ms),
so each, moved to the first ranks, is priced wherever its count's work bound is within
SIMULATED_WITHIN of the best found: one walk back and one price each. And the table is not
the whole search (the period's bisection chooses other in-flight counts and cuts, the polish
moves stages): on a flat cluster of up to EVERY_COUNT_WORKERS workers every smaller count is
planned in full where its work bound leaves it a chance (`fewer_clusters`), once per search,
so the planner is never slower, by its own price, than its plan on fewer of the workers
(1-2 on 3 workers over 1 GB/s took 46.36 ms, where its plan on 2 of them takes 44.73 ms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pdcompile.machine.cluster import Cluster
from pdcompile.plan import Stage
from pdcompile.units import format_bandwidth, format_seconds

# flat clusters of up to this many workers and graphs of up to this many nodes: every smaller
# count of the first workers is planned in full where a bound leaves it a chance (beyond, the
# DP's table and the first half): GPT-2 XL on flat 8 H100 (its search 9 s of CPU) planned the
# counts 2-7 for minutes
EVERY_COUNT_WORKERS = 8
EVERY_COUNT_NODES = 64


def smaller(cluster: Cluster) -> Cluster | None:
    """The cluster's first half, as a cluster of its own: half its outermost level's members
    (servers; workers of a flat cluster), the outermost level dropped where one member is left
    (one server: a flat cluster of its workers). None where fewer than two workers would be
    left (the whole model on one worker is priced anyway) or the cluster mixes devices."""
    if cluster.is_mixed:
        return None
    outer = cluster.levels[-1]
    half = outer.workers // 2
    if half >= 2:
        levels = cluster.levels[:-1] + (replace(outer, workers=half),)
    elif len(cluster.levels) > 1:
        levels = cluster.levels[:-1]
    else:
        return None
    workers = math.prod(level.workers for level in levels)
    if workers < 2:
        return None
    # a cluster of one kind written as device groups: its groups cut to the first ranks
    first = cluster.with_workers(workers).groups if cluster.groups else ()
    return replace(cluster, levels=levels, groups=first,
                   name=f"the first half of {cluster.name or 'the cluster'}")


def first_workers(cluster: Cluster, workers: int) -> Cluster:
    """A flat cluster's first `workers` workers, as a cluster of their own."""
    # one name for the counts of every smaller cluster: the search plans each once
    return replace(cluster, levels=(replace(cluster.levels[0], workers=workers),),
                   name=f"the first {workers} workers")


def fewer_clusters(cluster: Cluster, nodes: int) -> list[tuple[Cluster, bool]]:
    """The smaller clusters whose plans the planner also prices on `cluster`, and for each
    whether it is planned wherever the work bound alone leaves it a chance (True) or only where
    the best plan also pays more in communication than the half's bound exceeds the cluster's
    (planner/search.py `_on_fewer_workers`): every count from 2 of a flat cluster of up to
    EVERY_COUNT_WORKERS workers, for a graph of up to EVERY_COUNT_NODES `nodes` (the DP's
    objective, which ranks its table's plans on fewer workers, can disagree with the price,
    and the table is not the whole search); elsewhere the first half."""
    if len(cluster.levels) == 1 and not cluster.is_mixed and not cluster.groups \
            and cluster.workers <= EVERY_COUNT_WORKERS and nodes <= EVERY_COUNT_NODES:
        return [(first_workers(cluster, k), True) for k in range(2, cluster.workers)]
    half = smaller(cluster)
    return [] if half is None else [(half, False)]


def used_ranks(stages: Sequence[Stage]) -> set[int]:
    """The ranks that hold a stage."""
    return {rank for stage in stages for rank in stage.ranks}


def idle_reason(cluster: Cluster, chosen: Sequence[Stage], chosen_seconds: float,
                everyone: Sequence[Stage] | None, everyone_seconds: float | None,
                everyone_config: str) -> str:
    """One line: how many of the cluster's workers the chosen plan uses, and why not all:
    the best plan found on all of them (`everyone`, None: none fits), its slowest stage's
    all-reduce and transfer time, against the chosen plan's time."""
    used = used_ranks(chosen)
    total = cluster.workers
    idle = total - len(used)
    first_idle = [r for r in range(total) if r not in used][:4]
    shown = ", ".join(map(str, first_idle)) + (", ..." if idle > len(first_idle) else "")
    head = (f"{len(used)} of {total} workers (idle: rank{'s' if idle > 1 else ''} {shown}), "
            f"{format_seconds(chosen_seconds)} per minibatch")
    if everyone is None or everyone_seconds is None:
        return f"{head}: no plan on all {total} workers fits the memory or the schedule"
    if everyone_seconds <= chosen_seconds * (1 + 1e-9):
        return (f"{head}: the best plan found on all {total} ({everyone_config}) is no faster "
                f"({format_seconds(everyone_seconds)})")
    slowest = max(everyone, key=lambda s: s.time)
    links = " / ".join(format_bandwidth(level.bandwidth) for level in cluster.levels)
    others = "worker saves" if idle == 1 else f"{idle} workers save"
    return (f"{head}: the best plan found on all {total} ({everyone_config}) takes "
            f"{format_seconds(everyone_seconds)}, its slowest stage spending "
            f"{format_seconds(slowest.sync)} on all-reduces and {format_seconds(slowest.comm)} "
            f"on transfers over {links}: more than the other {others}")


__all__ = ["EVERY_COUNT_NODES", "EVERY_COUNT_WORKERS", "fewer_clusters", "first_workers",
           "idle_reason", "smaller", "used_ranks"]
