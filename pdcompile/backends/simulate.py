"""Discrete-event simulation of a lowered schedule on a cluster model (no tensors, costs only).

Each rank runs its actions in order. An action starts when the rank is free and its dependencies
(`pdcompile.deps.dependencies`, the same function validation uses) are met:

- F, B: `StageCosts.fwd[s]` / `bwd[s]` seconds (W: half of `bwd[s]`);
- SEND_*: non-blocking, takes no time on the rank over a network; the transfer starts when the
  link from the sending rank to the receiving rank is free (one transfer at a time per directed
  rank pair, in send order) and takes latency + bytes / bandwidth of the cluster level the link
  crosses; on a level with `cpu_copies` (loopback: the sender's CPU makes the copy) the send
  occupies the rank until its bytes are on the link, through any wait for it (`begin + busy`);
- RECV_*: ends when the data has arrived (its duration is the time the rank waited);
- ALLREDUCE k: starts when every replica of the stage has reached it; a ring all-reduce of the
  stage's parameters over the slowest level the replicas span, 2 (r-1)/r * P / bw + 2 (r-1) latency;
- STEP: `StageCosts.optimizer[s]` seconds, by default reading weights and gradients and writing
  weights once at the device's memory bandwidth (3 P / mem_bandwidth);
- weight stashing (asynchronous '1f1b', `stash=True`): on a rank where an update can come while
  a minibatch is in flight (`passes.schedule.updates_in_flight`; not the last stage, which runs
  each backward right after its forward), the first forward after an optimizer step
  snapshots the stage's weights (a new version), adding `StageCosts.stash[s]` seconds, by default
  a read and a write of the weights at the device's memory bandwidth (2 P / mem_bandwidth), as
  the runtime (runtime/stash.py) clones them; a backward hands the stashed version's gradients to
  the live weights without a copy (runtime/stage_runtime.py moves the tensors), so it adds none.

Memory per worker (peak): weights + one gradient buffer + stashed weight versions (1f1b: one per
minibatch in flight beyond the newest, PipeDream's weight stashing; 2bw: one extra version) +
activations of the microbatches in flight. Optimizer state (momentum, Adam moments) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcompile.cluster import Cluster
from pdcompile.deps import dependency_lists, execution_order, is_lowered
from pdcompile.errors import ScheduleError
from pdcompile.ir import Action, Kind, Schedule
from pdcompile.passes.schedule import updates_in_flight
from pdcompile.stage_costs import StageCosts
from pdcompile.timeline import Event, Timeline
from pdcompile.units import format_bytes, format_seconds


@dataclass(frozen=True)
class MemoryUse:
    """Peak bytes on one worker, by what they hold."""

    weights: float
    gradients: float
    stashed: float
    activations: float
    in_flight: int

    @property
    def total(self) -> float:
        """All of it."""
        return self.weights + self.gradients + self.stashed + self.activations


@dataclass
class SimResult:
    """What the simulator predicts for one run of a schedule."""

    schedule: str
    timeline: Timeline
    makespan: float
    time_per_minibatch: float
    throughput: float  # minibatches per second
    bubble: float  # over the whole run
    steady_bubble: float  # inside the steady-state window (flush schedules: the whole run)
    memory: dict[int, MemoryUse] = field(default_factory=dict)

    @property
    def peak_memory(self) -> float:
        """The largest per-worker total."""
        return max((m.total for m in self.memory.values()), default=0.0)

    def summary(self) -> str:
        """A few lines: times, bubble, memory per rank."""
        lines = [
            f"schedule {self.schedule}: makespan {format_seconds(self.makespan)}, "
            f"{format_seconds(self.time_per_minibatch)} per minibatch "
            f"({self.throughput:.2f} minibatches/s), bubble {self.bubble:.1%} "
            f"(steady state {self.steady_bubble:.1%})",
            f"{'rank':>5} {'in flight':>9} {'weights':>10} {'grads':>10} {'stashed':>10} "
            f"{'activations':>11} {'total':>10}",
        ]
        for rank, m in sorted(self.memory.items()):
            lines.append(f"{rank:>5} {m.in_flight:>9} {format_bytes(m.weights):>10} "
                         f"{format_bytes(m.gradients):>10} {format_bytes(m.stashed):>10} "
                         f"{format_bytes(m.activations):>11} {format_bytes(m.total):>10}")
        return "\n".join(lines)


def simulate(schedule: Schedule, costs: StageCosts, cluster: Cluster, *,
             timeline: bool = True, stash: bool = True) -> SimResult:
    """Run the lowered `schedule` against `costs` on `cluster` (see module docstring).

    `stash=False`: the pipeline runs without weight stashing (no snapshot copies)."""
    if not is_lowered(schedule):
        raise ScheduleError(f"simulate() needs a lowered schedule; call "
                            f"passes.lower.lower(schedule) first (schedule {schedule.name!r})")
    if costs.stages != schedule.stages:
        raise ScheduleError(f"the schedule has {schedule.stages} stages but the stage costs have "
                            f"{costs.stages}; build both from the same plan")
    top = max(schedule.ranks)
    if top >= cluster.workers:
        raise ScheduleError(f"the schedule uses rank {top} but cluster {cluster.describe()} has "
                            f"{cluster.workers} workers; choose a larger cluster")
    deps = dependency_lists(schedule)
    order = execution_order(schedule, deps)

    step_time = costs.optimizer or tuple(3.0 * p / cluster.device.mem_bandwidth
                                         for p in costs.params)
    copy_time = (costs.stash or tuple(2.0 * p / cluster.device.mem_bandwidth
                                      for p in costs.params)) \
        if stash and schedule.name == "1f1b" else (0.0,) * costs.stages
    # a rank snapshots its weights only if an update can come while a minibatch is in flight
    copying = {rank: bool(schedule.options.get("vertical_sync")) or updates_in_flight(actions)
               for rank, actions in schedule.actions.items()}
    fresh = dict(copying)  # no snapshot of the current weights yet
    allreduce = []
    for stage, ranks in enumerate(schedule.stage_ranks):
        r = len(ranks)
        level = cluster.levels[cluster.slowest_level_of(ranks)]
        allreduce.append(0.0 if r == 1 else
                         2 * (r - 1) / r * costs.params[stage] / level.bandwidth
                         + 2 * (r - 1) * level.latency)

    free_at = {rank: 0.0 for rank in schedule.actions}
    # end[rank][i]: when action i of rank finished; arrival[rank][i]: when a send's data arrived
    end: dict[int, list[float]] = {rank: [0.0] * len(a) for rank, a in schedule.actions.items()}
    arrival: dict[int, list[float]] = {rank: [0.0] * len(a) for rank, a in schedule.actions.items()}
    link_free: dict[tuple[int, int], float] = {}
    # link_speed[src, dst]: (bytes/s, latency, whether the sender's CPU makes the copy)
    link_speed: dict[tuple[int, int], tuple[float, float, bool]] = {}
    events: list[Event] = []
    compute: list[tuple[Event, Action]] = []
    actions = schedule.actions
    recv = (Kind.RECV_F, Kind.RECV_B)
    for rank, index in order:
        action = actions[rank][index]
        kind = action.kind
        start = free_at[rank]
        waits = deps[rank][index]
        if kind in recv:
            ((sender, at),) = waits
            finish = arrival[sender][at] if arrival[sender][at] > start else start
        else:
            for other, at in waits:
                if end[other][at] > start:
                    start = end[other][at]
            stage = action.stage
            if kind == Kind.F:
                finish = start + costs.fwd[stage]
                if fresh[rank]:
                    finish += copy_time[stage]
                    fresh[rank] = False
            elif kind == Kind.B:
                finish = start + costs.bwd[stage]
            elif kind == Kind.W:
                finish = start + 0.5 * costs.bwd[stage]
            elif kind == Kind.ALLREDUCE:
                finish = start + allreduce[stage]
            elif kind == Kind.STEP:
                finish = start + step_time[stage]
                fresh[rank] = copying[rank]
            else:  # SEND_F / SEND_B: the link carries it; with CPU copies the sender waits
                assert action.peer is not None
                dst = schedule.rank_of(action.peer, action.microbatch)
                link = (rank, dst)
                size = costs.edge_bytes(stage, action.peer)
                begin = max(start, link_free.get(link, 0.0))
                if link not in link_speed:
                    link_speed[link] = (cluster.bandwidth_between(rank, dst),
                                        cluster.latency_between(rank, dst),
                                        cluster.cpu_copies_between(rank, dst))
                bandwidth, latency, cpu_copies = link_speed[link]
                busy = size / bandwidth if size else 0.0
                link_free[link] = begin + busy
                arrival[rank][index] = begin + busy + (latency if size else 0.0)
                finish = begin + busy if cpu_copies and size else start
        end[rank][index] = finish
        free_at[rank] = finish
        if kind.is_compute:
            event = Event(rank, str(action), start, finish)
            compute.append((event, action))
            events.append(event)
        elif timeline:
            events.append(Event(rank, str(action), start, finish))

    meta: dict[str, object] = {
        "schedule": schedule.name, "microbatches": schedule.microbatches,
        "microbatches_per_minibatch": int(schedule.options.get("microbatches_per_minibatch", 1))}
    if schedule.name in ("1f1b-flush", "gpipe"):
        meta["minibatches"] = 1
    line = Timeline.with_compute(events, compute, "simulated", meta)
    makespan = max(free_at.values(), default=0.0)  # the timeline may hold compute events only
    flush = schedule.name in ("1f1b-flush", "gpipe")
    per_minibatch = makespan if flush else line.time_per_minibatch()
    bubble = line.bubble_fraction((0.0, makespan))
    t0, t1, _ = line.steady_window()
    return SimResult(
        schedule=schedule.name,
        timeline=line,
        makespan=makespan,
        time_per_minibatch=per_minibatch,
        throughput=1.0 / per_minibatch if per_minibatch > 0 else float("inf"),
        bubble=bubble,
        steady_bubble=bubble if flush else line.bubble_fraction((t0, t1)),
        memory=_memory(schedule, costs),
    )


def _memory(schedule: Schedule, costs: StageCosts) -> dict[int, MemoryUse]:
    """Peak memory per rank from its action order (in flight: F done, B not yet)."""
    out: dict[int, MemoryUse] = {}
    for rank, actions in schedule.actions.items():
        stage = schedule.stage_of_rank(rank)
        live = peak = 0
        for action in actions:
            if action.kind == Kind.F:
                live += 1
                peak = max(peak, live)
            elif action.kind == Kind.B:
                live -= 1
        params = costs.params[stage]
        if schedule.name == "1f1b":
            extra_versions = max(0, peak - 1)
        elif schedule.name == "2bw":
            extra_versions = 1
        else:
            extra_versions = 0
        out[rank] = MemoryUse(weights=params, gradients=params, stashed=extra_versions * params,
                              activations=peak * costs.activations[stage], in_flight=peak)
    return out
