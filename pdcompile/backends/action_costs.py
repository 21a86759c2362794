"""What each action of a lowered schedule costs its rank in the simulator, by the rules of
backends/simulate.py's docstring: F, B and W from the stage costs (B and W split where the
schedule has W actions of the stage; B with the forward again on a stage that recomputes) over
the rank's speed (a mixed cluster's `Cluster.speed_of`, so an emulated slowdown stretches B
before the send and W after it, as runtime/slowdown.py does), STEP and the first forward after
it (a weight snapshot, where the rank stashes) at its device's memory bandwidth, sends on the
link their ranks share, all-reduces on the slowest level their replicas span; a rank's first
STEP of each update also all-reduces the tied parameters its stages share with other ranks
(cost/ties.py; backends/tie_updates.py makes it wait for those ranks first). Both timing loops
read it: the one that gives every rank a processor (simulate.py) and the one that shares them
(processor_sharing.py).
"""

from __future__ import annotations

from pdcompile.cost.links import (
    exposed_allreduce_seconds,
    link_busy_seconds,
    stage_allreduce_seconds,
)
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.cost.ties import rank_tie_seconds
from pdcompile.cost.updates import copy_seconds, step_seconds, update_scale
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.generators import updates_in_flight
from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.kinds import WGRAD_SHARE, kind


class ActionCosts:
    """What each action costs its rank (the rules of the module docstring), for both timing
    loops: the one that gives every rank a processor and the one that shares them."""

    def __init__(self, schedule: Schedule, costs: StageCosts, cluster: Cluster, *,
                 stash: bool, wgrad_share: float | None = None) -> None:
        self.schedule, self.costs, self.cluster = schedule, costs, cluster
        # B and W seconds per stage: the backward split where the schedule has W actions of the
        # stage (a split backward, or weight gradients after the sends:
        # backends/weights_after_send.py), the forward again in B where the stage recomputes
        split = {a.stage for actions in schedule.actions.values() for a in actions
                 if a.kind == Kind.W}
        # (of a backward, what is weight gradients: `wgrad_share` where given, else each
        # stage's own part where the costs know it, else WGRAD_SHARE)
        shares = (wgrad_share,) * costs.stages if wgrad_share is not None \
            else costs.wgrad_shares(WGRAD_SHARE)
        share = [shares[s] if s in split else 0.0 for s in range(costs.stages)]
        again = recomputing(schedule)
        self.backward = tuple((1.0 - share[s]) * costs.bwd[s]
                              + (costs.fwd[s] if s in again else 0.0)
                              for s in range(costs.stages))
        self.weight = tuple(share[s] * b for s, b in enumerate(costs.bwd))
        step_time = costs.optimizer or tuple(step_seconds(p, cluster.device)
                                             for p in costs.params)
        copy_time = (costs.stash or tuple(copy_seconds(p, cluster.device)
                                          for p in costs.params)) \
            if stash and kind(schedule.name).copies_weights else (0.0,) * costs.stages
        # a mixed cluster's ranks compute at their device's speed (F, B, W: the CostGraph's
        # times are the reference device's) and update at their memory's (step, copy)
        ranks = schedule.actions
        self.slowness = {rank: 1.0 / cluster.speed_of(rank) for rank in ranks}
        scale = {rank: update_scale(cluster, (rank,)) for rank in ranks}
        self.step_time = {rank: tuple(t * scale[rank] for t in step_time) for rank in ranks}
        self.copy_time = {rank: tuple(t * scale[rank] for t in copy_time) for rank in ranks}
        # a rank snapshots its weights only if an update can come while a minibatch is in flight
        self.copying = {rank: bool(schedule.options.get("vertical_sync"))
                        or updates_in_flight(actions)
                        for rank, actions in schedule.actions.items()}
        self.fresh = dict(self.copying)  # no snapshot of the current weights yet
        # what of each all-reduce remains after the backward it follows (cost/links.py)
        self.allreduce = [exposed_allreduce_seconds(
            stage_allreduce_seconds(costs.params[stage], replicas, cluster),
            backward=(self.backward[stage] + self.weight[stage])
            / cluster.slowest_speed(replicas), params=costs.params[stage],
            bucket=cluster.allreduce_bucket)
            for stage, replicas in enumerate(schedule.stage_ranks)]
        # per rank, the tie all-reduces of each update (at its first STEP of the update)
        self.ties = rank_tie_seconds(costs.ties, schedule.stage_ranks, cluster)
        self._tied_updates: dict[int, set[int]] = {rank: set() for rank in self.ties}
        # a send's link, bytes and seconds, per (rank, stage, peer, receiving rank): the same for
        # every microbatch that pair carries (a 16-rank stream sends some 600 times per pair)
        self._sends: dict[tuple[int, int, int, int], tuple[int, float, float, bool]] = {}

    def compute(self, rank: int, action: Action) -> float:
        """Seconds of the rank's processor for F, B, W or STEP; call once per action, in the
        rank's order (a STEP makes the next F snapshot the weights)."""
        stage, kind = action.stage, action.kind
        slowness = self.slowness[rank]
        if kind == Kind.F:
            if self.fresh[rank]:
                self.fresh[rank] = False
                return self.costs.fwd[stage] * slowness + self.copy_time[rank][stage]
            return self.costs.fwd[stage] * slowness
        if kind == Kind.B:
            return self.backward[stage] * slowness
        if kind == Kind.W:
            return self.weight[stage] * slowness
        if kind == Kind.STEP:
            self.fresh[rank] = self.copying[rank]
            joined = self._tied_updates.get(rank)
            if joined is not None and action.microbatch not in joined:
                joined.add(action.microbatch)
                return self.ties[rank] + self.step_time[rank][stage]
            return self.step_time[rank][stage]
        raise ValueError(f"{action} is not a computation")

    def send(self, rank: int, action: Action) -> tuple[int, float, float, bool]:
        """(receiving rank, seconds on the link, latency, whether the sender's CPU copies)."""
        assert action.peer is not None
        dst = self.schedule.rank_of(action.peer, action.microbatch)
        key = (rank, action.stage, action.peer, dst)
        found = self._sends.get(key)
        if found is None:
            found = self._sends[key] = self._send(rank, action.stage, action.peer, dst)
        return found

    def _send(self, rank: int, stage: int, peer: int, dst: int) -> tuple[int, float, float, bool]:
        if dst == rank:  # two chunks of one rank (the tip of a V): handed over in memory
            return dst, 0.0, 0.0, False
        level = self.cluster.levels[self.cluster.link_level(rank, dst)]
        size = self.costs.edge_bytes(stage, peer)
        if not size:
            return dst, 0.0, 0.0, False
        return dst, link_busy_seconds(size, level), level.latency, level.cpu_copies


Times = dict[int, list[float]]  # per rank, one entry per action


def recomputing(schedule: Schedule) -> frozenset[int]:
    """The stages that drop their activations after the forward and recompute them in the
    backward (`options["recompute"]`, set by `schedule.generators.generate(recompute=...)`)."""
    return frozenset(int(s) for s in schedule.options.get("recompute", ()))


__all__ = ["ActionCosts", "Times", "recomputing"]
