"""Discrete-event simulation of a lowered schedule on a cluster model (no tensors, costs only).

Each rank runs its actions in order. An action starts when the rank is free and its dependencies
(`pdcompile.schedule.deps.dependencies`, the same function validation uses) are met:

- F, B: `StageCosts.fwd[s]` / `bwd[s]` seconds; where the schedule splits the backward
  ("zb-h1", "interleaved-zb", ...), B (input gradients) takes `(1 - share) * bwd[s]` and
  W (weight gradients) the rest, `share * bwd[s]`: the stage's own share where the costs say
  what its runtime defers (`StageCosts.wgrad`: its fused Linear layers' dW, priced by the cost
  pass), else `wgrad_share` (default 1/2: a Linear layer's dX and dW are each a matrix product
  the size of its forward); where it does not, a stage that sends input
  gradients upstream is split the same way, its W after the backward's last SEND_B, as the
  runtime computes its Linear layers' weight gradients after that send
  (backends/weights_after_send.py; its timeline event spans the sends and W, as the runtime
  records it); a stage that recomputes its activations (`options["recompute"]`) runs its
  forward again in its backward: B takes `fwd[s]` more;
- SEND_*: non-blocking, takes no time on the rank over a network; the transfer starts when the
  link from the sending rank to the receiving rank is free (one transfer at a time per directed
  rank pair, in send order) and takes latency + bytes / bandwidth of the cluster level the link
  crosses; on a level with `cpu_copies` (loopback: the sender's CPU makes the copy) the send
  occupies the rank until its bytes are on the link, through any wait for it (`begin + busy`);
- RECV_*: ends when the data has arrived (its duration is the time the rank waited);
- ALLREDUCE k: starts when every replica of the stage has reached it; a ring all-reduce of the
  stage's parameters over the slowest level the replicas span, 2 (r-1)/r * P / bw + 2 (r-1) latency;
- STEP: `StageCosts.optimizer[s]` seconds, by default reading weights and gradients and writing
  weights once at the device's memory bandwidth (3 P / mem_bandwidth); a rank whose stages
  share tied parameters with stages on other ranks (`StageCosts.ties`) all-reduces their
  gradients in its first STEP of each update, as the runtime does, once every rank sharing them
  has reached its own (backends/tie_updates.py): a ring over those ranks on the slowest level
  they span (cost/ties.py), before the step;
- weight stashing (asynchronous '1f1b', `stash=True`): on a rank where an update can come while
  a minibatch is in flight (`schedule.generators.updates_in_flight`; not the last stage, which runs
  each backward right after its forward), the first forward after an optimizer step
  snapshots the stage's weights (a new version), adding `StageCosts.stash[s]` seconds, by default
  a read and a write of the weights at the device's memory bandwidth (2 P / mem_bandwidth), as
  the runtime (runtime/stash.py) clones them; a backward hands the stashed version's gradients to
  the live weights without a copy (runtime/stage_runtime.py moves the tensors), so it adds none.

Ranks that outnumber their host's processors (`Level.cores`, set by `local-N` to this machine's
cores) share them: `backends/processor_sharing.py` runs the same rules in an event loop where k
ranks computing on c cores each advance at c / k of their speed, and a loopback transfer also
keeps the receiving side's copy busy. Otherwise every rank has a processor of its own.

Memory per worker (peak), by cost/memory.py's formula (the planner's): weights + gradients +
optimizer state + stashed weight versions (1f1b: one per minibatch in flight beyond the newest,
where the stage copies at all; 2bw: one extra version) + activations of the microbatches in
flight (from F to B, or to W where the backward is split; a stage that recomputes keeps only
its inputs, the bytes of its incoming edges, plus one microbatch's activations while it
recomputes them, and, where the backward is split, from its B to its W). A rank holding several
chunks adds up its chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdcompile.backends.action_costs import ActionCosts, Times, recomputing
from pdcompile.backends.processor_sharing import share_processors
from pdcompile.backends.tie_updates import with_tie_waits
from pdcompile.backends.weights_after_send import merged_backwards, with_weights_after_send
from pdcompile.cost.memory import WorkerMemory, worker_memory
from pdcompile.cost.pipeline_time import server_interface_seconds
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.deps import dependency_lists, execution_order, is_lowered
from pdcompile.schedule.ir import COMPUTE_KINDS, Action, Kind, Schedule
from pdcompile.schedule.kinds import kind, weight_versions
from pdcompile.timeline import Event, Timeline
from pdcompile.units import format_bytes, format_seconds


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
    memory: dict[int, WorkerMemory] = field(default_factory=dict)

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
            f"{'rank':>5} {'in flight':>9} {'weights':>10} {'grads':>10} {'optimizer':>10} "
            f"{'stashed':>10} {'activations':>11} {'total':>10}",
        ]
        for rank, m in sorted(self.memory.items()):
            lines.append(f"{rank:>5} {m.in_flight:>9} {format_bytes(m.weights):>10} "
                         f"{format_bytes(m.gradients):>10} {format_bytes(m.optimizer):>10} "
                         f"{format_bytes(m.stashed):>10} {format_bytes(m.activations):>11} "
                         f"{format_bytes(m.total):>10}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Prepared:
    """What the simulator works out from a lowered schedule alone, whatever the costs: the
    schedule with the W actions the runtime times after a backward's sends, every action's
    dependencies and one order that meets them (a third of a simulation's time on a 16-rank
    pipeline; a planner simulating many plans of one schedule works it out once, `prepare`),
    and where the timeline merges each added W into its backward (`merged_backwards`)."""

    schedule: Schedule
    timed: Schedule
    deps: dict[int, list[tuple[tuple[int, int], ...]]]
    order: list[tuple[int, int]]
    merged: dict[int, dict[int, int]]


def prepare(schedule: Schedule) -> Prepared:
    """`Prepared` for the lowered `schedule` (ScheduleError where it is not lowered)."""
    if not is_lowered(schedule):
        raise ScheduleError(f"simulate() needs a lowered schedule; call "
                            f"schedule.lower.lower(schedule) first (schedule {schedule.name!r})")
    timed = with_weights_after_send(schedule)
    deps = dependency_lists(timed)
    return Prepared(schedule, timed, deps, execution_order(timed, deps),
                    merged_backwards(schedule, timed))


def simulate(schedule: Schedule, costs: StageCosts, cluster: Cluster, *,
             timeline: bool = True, stash: bool = True,
             wgrad_share: float | None = None, prepared: Prepared | None = None) -> SimResult:
    """Run the lowered `schedule` against `costs` on `cluster` (see module docstring).

    `stash=False`: the pipeline runs without weight stashing (no snapshot copies).
    `wgrad_share`: the part of every backward that computes weight gradients (W, where the
    schedule splits the backward or the stage computes them after its input-gradient send; 0:
    every backward one block before its sends); None (default): each stage's own part where
    `costs.wgrad` gives it, else `schedule.kinds.WGRAD_SHARE`. `prepared`: `prepare(schedule)`
    worked out before (None: worked out here)."""
    if not is_lowered(schedule):
        raise ScheduleError(f"simulate() needs a lowered schedule; call "
                            f"schedule.lower.lower(schedule) first (schedule {schedule.name!r})")
    if prepared is not None and prepared.schedule is not schedule:
        raise ScheduleError(f"simulate() was handed the preparation of another schedule than "
                            f"{schedule.name!r}; pass prepare(schedule) of this one, or none")
    if costs.stages != schedule.stages:
        raise ScheduleError(f"the schedule has {schedule.stages} stages but the stage costs have "
                            f"{costs.stages}; build both from the same plan")
    top = max(schedule.ranks)
    if top >= cluster.workers:
        raise ScheduleError(f"the schedule uses rank {top} but cluster {cluster.describe()} has "
                            f"{cluster.workers} workers; choose a larger cluster")
    if wgrad_share is not None and not 0.0 <= wgrad_share <= 1.0:
        raise ScheduleError(f"wgrad_share is the part of a backward spent on weight gradients, "
                            f"between 0 and 1 (got {wgrad_share})")
    # where the runtime computes weight gradients after a backward's sends, they are timed there
    prepared = prepared or prepare(schedule)
    timed, deps, order = prepared.timed, prepared.deps, prepared.order
    tied = with_tie_waits(timed, costs, deps)  # the costs' ties: not part of the preparation
    if tied is not deps:
        deps, order = tied, execution_order(timed, tied)
    work = ActionCosts(timed, costs, cluster, stash=stash, wgrad_share=wgrad_share)
    sharing = cluster.shared_cores()
    if sharing is not None and cluster.oversubscribed(timed.actions):
        begin, end = share_processors(timed, deps, work, group_size=sharing[0],
                                      cores=sharing[1])
    else:
        begin, end = _dedicated(timed, deps, order, work)
    # the timeline records such a backward as the runtime does: one B spanning its W
    merged = prepared.merged
    for rank, pairs in merged.items():
        for w, b in pairs.items():
            end[rank][b] = end[rank][w]

    events: list[Event] = []
    compute: list[tuple[Event, Action]] = []
    for rank, index in order:
        action = timed.actions[rank][index]
        if index in merged.get(rank, ()):
            continue
        if action.kind in COMPUTE_KINDS:
            event = Event(rank, str(action), begin[rank][index], end[rank][index])
            compute.append((event, action))
            events.append(event)
        elif timeline:
            events.append(Event(rank, str(action), begin[rank][index], end[rank][index]))

    meta: dict[str, object] = {
        "schedule": schedule.name, "microbatches": schedule.microbatches,
        "microbatches_per_minibatch": int(schedule.options.get("microbatches_per_minibatch", 1))}
    if "shares" in schedule.options:  # rounds of unequal shares repeat after their sizes' lcm
        meta["round"] = math.lcm(*(schedule.round_size(s) for s in range(schedule.stages)))
    flush = kind(schedule.name).flush
    if flush:
        meta["minibatches"] = 1
    line = Timeline.with_compute(events, compute, "simulated", meta)
    # the timeline may hold compute events only
    makespan = max((times[-1] for times in end.values() if times), default=0.0)
    per_minibatch = makespan if flush else line.time_per_minibatch()
    # the servers' network interfaces, shared by every flow of their workers: the event pass
    # gives each directed rank pair a lane of its own, so they bound the throughput instead
    # (the closed form's bound, cost/pipeline_time.py)
    per = schedule.microbatches if flush \
        else int(schedule.options.get("microbatches_per_minibatch", 1))
    shared = server_interface_seconds(
        {e: costs.edge_bytes(*e) for e in costs.stage_edges()}, schedule.stage_ranks,
        costs.params, cluster, schedule=schedule.name, microbatches=per, ties=costs.ties) * per
    per_minibatch = max(per_minibatch, shared)
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
        memory=_memory(schedule, costs, work.copying),
    )


_RECEIVES = frozenset((Kind.RECV_F, Kind.RECV_B))


def _dedicated(schedule: Schedule, deps: dict[int, list[tuple[tuple[int, int], ...]]],
               order: list[tuple[int, int]], work: ActionCosts) -> tuple[Times, Times]:
    """(start, end) of every action when every rank has a processor of its own: one pass in
    dependency order, each action starting when its rank is free and its inputs are there."""
    free_at = {rank: 0.0 for rank in schedule.actions}
    begin: Times = {rank: [0.0] * len(a) for rank, a in schedule.actions.items()}
    end: Times = {rank: [0.0] * len(a) for rank, a in schedule.actions.items()}
    arrival: Times = {rank: [0.0] * len(a) for rank, a in schedule.actions.items()}
    link_free: dict[tuple[int, int], float] = {}
    actions = schedule.actions
    for rank, index in order:
        action = actions[rank][index]
        kind = action.kind
        start = free_at[rank]
        waits = deps[rank][index]
        if kind in _RECEIVES:
            ((sender, at),) = waits
            finish = arrival[sender][at] if arrival[sender][at] > start else start
        else:
            for other, at in waits:
                if end[other][at] > start:
                    start = end[other][at]
            if kind in COMPUTE_KINDS or kind is Kind.STEP:
                finish = start + work.compute(rank, action)
            elif kind == Kind.ALLREDUCE:
                finish = start + work.allreduce[action.stage]
            else:  # SEND_F / SEND_B: the link carries it; with CPU copies the sender waits
                dst, busy, latency, cpu_copies = work.send(rank, action)
                transfer = max(start, link_free.get((rank, dst), 0.0))
                link_free[rank, dst] = transfer + busy
                arrival[rank][index] = transfer + busy + latency
                finish = transfer + busy if cpu_copies else start
        begin[rank][index] = start
        end[rank][index] = finish
        free_at[rank] = finish
    return begin, end


def _memory(schedule: Schedule, costs: StageCosts,
            copying: dict[int, bool]) -> dict[int, WorkerMemory]:
    """Peak memory per rank from its action order (in flight: F done, B not yet; W not yet
    where the backward is split)."""
    split = kind(schedule.name).split_backward
    release = Kind.W if split else Kind.B
    again = recomputing(schedule)
    kept = [costs.activations[s] if s not in again else
            sum(costs.edge_bytes(a, b) for a, b in costs.stage_edges() if b == s)
            for s in range(costs.stages)]
    out: dict[int, WorkerMemory] = {}
    for rank, actions in schedule.actions.items():
        stages = schedule.stages_of_rank(rank)
        live = peak = 0
        held = held_peak = 0.0
        for action in actions:
            stage = action.stage
            if action.kind == Kind.F:
                live += 1
                peak = max(peak, live)
                held += kept[stage]
                held_peak = max(held_peak, held)
            elif action.kind == Kind.B and stage in again:  # the activations, rebuilt
                held_peak = max(held_peak, held + costs.activations[stage])
                if split:  # and what W needs of them stays until W (counted whole)
                    held += costs.activations[stage]
            if action.kind == release:
                live -= 1
                held -= kept[stage]
                if split and stage in again:
                    held -= costs.activations[stage]
        params = sum(costs.params[s] for s in stages)
        versions = weight_versions(schedule.name, peak, copies=copying[rank])
        out[rank] = worker_memory(params, activations=held_peak, in_flight=peak,
                                  versions=versions, optimizer_state=costs.optimizer_state)
    return out
