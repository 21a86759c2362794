"""The cost of a pipeline plan: per-stage compute, weight sync, communication, memory, time.

One function, `evaluate`, prices a plan for every planner and every report. Two models:

* ``"pipedream"``: exactly the model of PipeDream's optimizer (Narayanan et al., SOSP 2019;
  ``optimizer_graph_hierarchical.py``). A stage of T seconds of fwd+bwd and P parameter bytes on
  r replicas costs ``(T + 4 (r-1) P / (B r)) / r`` (the all-reduce is added to compute, not
  overlapped); a cut with O output bytes costs ``2 O / (B r)`` on each side of it (r: that side's
  replicas) and the stage time is the maximum of the three. O is the activation bytes of the
  cut's *augmented antichain* (see antichain.py). `Input` sources and unused `__getitem__` sinks
  are dropped first, as the original does, and (a quirk of its recurrence, kept) the first stage's
  output transfer is never charged, only the second stage's input. Memory:
  ``ceil(D / r) (act + P)`` with D the workers downstream of the stage (the original's stash
  estimate).

* ``"native"``: our best honest model of this project's runtime. Gradient sync is a ring
  all-reduce among the replicas, ``2 (r-1)/r P / B + 2 (r-1) latency``, done once per round of r
  minibatches and not overlapped with compute (the ALLREDUCE action blocks its rank). Point-to-point
  sends are asynchronous, so a stage's network time overlaps its compute: stage time =
  ``max(compute + sync, comm)``, with ``comm`` = bytes the stage receives plus sends per minibatch
  (every edge crossing its boundary, skip connections included, each at the bandwidth of the
  cluster level between the two stages' ranks; links are full duplex, activations one way and
  gradients the other) plus one latency per tensor, divided by r. On a level with `cpu_copies`
  (loopback between processes of one host) the sender's CPU makes each copy, so a stage also
  spends the bytes it sends (activations forward, gradients back) / bandwidth / r of its own
  time: stage time = ``max(compute + sync + copies, comm)``. Memory per worker for 1F1B:
  ``n (P + keep) + P (gradients) + optimizer_state * P`` with n = ceil((r + D) / r) minibatches in
  flight (weight versions stashed = n); flush schedules keep one weight version and min(n, M) of
  M microbatches. Flush schedules also pay the pipeline bubble, (M + S - 1) / M. Inputs (see
  `input_nodes`) stay on the first stage and cost no compute (a profile's `Input` forward time is
  data loading, overlapped by the input pipeline); what they feed to later stages is traffic.
  Where the workers of a host outnumber its cores (`Level.cores`, as `local-N` on a small
  machine), they take turns: a minibatch then takes at least the CPU work of the busiest host's
  ranks (compute, sync, and every loopback copy on both of its ends) over its cores
  (`shared_core_time`), whatever the slowest stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from pdcompile.cluster import Cluster
from pdcompile.costgraph import edge_bytes
from pdcompile.errors import PlanError
from pdcompile.plan import Stage

COST_MODELS = ("native", "pipedream")
SCHEDULES = ("1f1b", "1f1b-flush", "gpipe", "2bw")
OPTIMIZER_STATE = 2.0  # bytes of optimizer state per parameter byte (Adam: two moments)


@dataclass(frozen=True)
class ModelOptions:
    """What `evaluate` and the planners need besides the graph and the cluster."""

    cost_model: str = "native"
    schedule: str = "1f1b"
    microbatches: int = 1
    optimizer_state: float = OPTIMIZER_STATE

    def __post_init__(self) -> None:
        if self.cost_model not in COST_MODELS:
            raise PlanError(f"unknown cost model {self.cost_model!r}; use one of {COST_MODELS}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; use one of {SCHEDULES}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"microbatches must be a positive integer (got {self.microbatches!r})")


# ------------------------------------------------------------------------------ primitives
def in_flight(replicas: int, downstream: int, options: ModelOptions) -> float:
    """Minibatches (or microbatch fractions of one) whose activations a worker keeps at once."""
    if options.cost_model == "pipedream":
        return float(math.ceil(downstream / replicas))
    depth = math.ceil((replicas + downstream) / replicas)
    if options.schedule in ("1f1b", "2bw"):
        return float(depth)
    if options.schedule == "gpipe":
        return 1.0
    return min(depth, options.microbatches) / options.microbatches


def weight_versions(replicas: int, downstream: int, options: ModelOptions) -> float:
    """Copies of a stage's weights a worker holds (weight stashing)."""
    if options.schedule == "1f1b":
        return float(math.ceil((replicas + downstream) / replicas))
    if options.schedule == "2bw":
        return 2.0
    return 1.0


def stage_memory(params: float, keep: float, replicas: int, downstream: int,
                 options: ModelOptions) -> float:
    """Bytes per worker of a stage with `params` weight bytes and `keep` activation bytes."""
    flight = in_flight(replicas, downstream, options)
    if options.cost_model == "pipedream":
        return flight * (keep + params)
    versions = weight_versions(replicas, downstream, options)
    return versions * params + params * (1.0 + options.optimizer_state) + flight * keep


def sync_seconds(params: float, replicas: int, bandwidth: float, latency: float,
                 options: ModelOptions) -> float:
    """Weight-sync time per minibatch of a stage replicated `replicas` ways."""
    if replicas <= 1:
        return 0.0
    r = replicas
    if options.cost_model == "pipedream":
        return 4.0 * (r - 1) * params / (bandwidth * r) / r
    ring = 2.0 * (r - 1) / r * params / bandwidth + 2.0 * (r - 1) * latency
    return ring / r


def bubble(stages: int, options: ModelOptions) -> float:
    """Factor on the slowest stage for flush schedules (1 for asynchronous ones)."""
    if options.cost_model == "native" and options.schedule in ("1f1b-flush", "gpipe"):
        return (options.microbatches + stages - 1) / options.microbatches
    return 1.0


@dataclass(frozen=True)
class Placement:
    """Per-byte and fixed costs of a stage on ranks [start, start + replicas) of `workers`, as
    the planners price it (native model): the all-reduce spans those ranks; what the stage
    receives crosses the link from rank start - 1, what it sends the link to start + replicas."""

    sync_per_byte: float
    sync_fixed: float
    in_per_byte: float
    in_per_msg: float
    out_per_byte: float
    out_per_msg: float
    in_flight: float
    versions: float
    copy_in_per_byte: float = 0.0   # CPU time per byte sent back over the input link (loopback)
    copy_out_per_byte: float = 0.0  # CPU time per byte sent forward over the output link


def placement(cluster: Cluster, start: int, replicas: int, workers: int,
              options: ModelOptions) -> Placement:
    """Coefficients of a stage at a rank position (see `Placement`); all already divided by the
    replicas, so that stage time = max(T / r + P * sync_per_byte + sync_fixed + in bytes *
    copy_in_per_byte + out bytes * copy_out_per_byte, in/out terms)."""
    r, end = replicas, start + replicas - 1
    sync_a = sync_b = in_a = in_l = out_a = out_l = copy_in = copy_out = 0.0
    if r > 1:
        lv = cluster.levels[cluster.link_level(start, end)]
        sync_a = 2.0 * (r - 1) / r / lv.bandwidth / r
        sync_b = 2.0 * (r - 1) * lv.latency / r
    if start > 0:
        li = cluster.levels[cluster.link_level(start - 1, end)]
        in_a, in_l = 1.0 / (li.bandwidth * r), li.latency / r
        copy_in = in_a if li.cpu_copies and options.cost_model == "native" else 0.0
    if end + 1 < workers:
        lo = cluster.levels[cluster.link_level(start, end + 1)]
        out_a, out_l = 1.0 / (lo.bandwidth * r), lo.latency / r
        copy_out = out_a if lo.cpu_copies and options.cost_model == "native" else 0.0
    downstream = workers - start - r
    return Placement(sync_a, sync_b, in_a, in_l, out_a, out_l,
                     in_flight(r, downstream, options), weight_versions(r, downstream, options),
                     copy_in, copy_out)


# ------------------------------------------------------------------------------ inputs
def input_nodes(graph: nx.DiGraph) -> tuple[str, ...]:
    """The graph's inputs under the native model: sources without parameters or backward work
    (fx placeholders, PipeDream's `Input` nodes). They live on the first stage and cost no
    compute there: a PipeDream profile's `Input` forward time is data loading, which the input
    pipeline overlaps with training. What they feed to later stages is charged as traffic.
    Empty when every node is such a source."""
    found = tuple(n for n in graph.nodes
                  if graph.in_degree(n) == 0 and graph.out_degree(n) > 0
                  and not float(graph.nodes[n]["params"]) and not float(graph.nodes[n]["bwd"]))
    return found if len(found) < graph.number_of_nodes() else ()


# ------------------------------------------------------------------------------ pipedream graph
def pipedream_view(graph: nx.DiGraph) -> tuple[nx.DiGraph, dict[str, str | None]]:
    """The graph PipeDream's optimizer plans over: `Input*` sources and unused `__getitem__` sinks
    removed. Returns it and a map removed node -> the node whose stage it joins (None: the first
    stage, where the original puts its inputs)."""
    view = graph.copy()
    attach: dict[str, str | None] = {}
    for node in list(view.nodes):
        if view.in_degree(node) == 0 and str(view.nodes[node].get("label", "")).startswith("Input"):
            if view.number_of_nodes() > 1:
                attach[node] = None
                view.remove_node(node)
    for node in list(view.nodes):
        if (view.out_degree(node) == 0 and view.number_of_nodes() > 1
                and str(view.nodes[node].get("label", "")).startswith("__getitem__")):
            preds = list(view.predecessors(node))
            if preds:
                attach[node] = preds[0]
                view.remove_node(node)
    for node, target in list(attach.items()):  # chains of removed nodes
        while target is not None and target in attach:
            target = attach[target]
        attach[node] = target
    return view, attach


def augmented_frontier(graph: nx.DiGraph, downset: set[str]) -> set[str]:
    """PipeDream's augmented antichain of a downset: its maximal nodes plus each maximal node's
    ancestors that feed something outside that maximal node's own ancestry."""
    maximal = [n for n in downset if not any(s in downset for s in graph.successors(n))]
    out: set[str] = set(maximal)
    for a in maximal:
        ancestors = nx.ancestors(graph, a)
        for p in ancestors:
            if any(s not in ancestors and s != a for s in graph.successors(p)):
                out.add(p)
    return out


# ------------------------------------------------------------------------------ evaluate
def evaluate(graph: nx.DiGraph, stages: Sequence[tuple[Sequence[str], Sequence[int]]],
             cluster: Cluster, *, options: ModelOptions, memory: float | None = None,
             ) -> tuple[tuple[Stage, ...], float]:
    """Price a plan given as (nodes, ranks) per stage in pipeline order.

    Returns the priced stages and the predicted time per minibatch (the slowest stage, times the
    bubble factor for flush schedules). Nodes of `graph` missing from every stage raise PlanError.
    """
    stage_of: dict[str, int] = {}
    for i, (nodes, _) in enumerate(stages):
        for node in nodes:
            stage_of[node] = i
    missing = [n for n in graph.nodes if n not in stage_of]
    if missing:
        raise PlanError(f"plan leaves nodes unassigned: {missing[:5]}")
    for u, v in graph.edges:
        if stage_of[u] > stage_of[v]:
            raise PlanError(f"edge {u} -> {v} goes from stage {stage_of[u]} back to stage "
                            f"{stage_of[v]}; stages must be convex")
    if options.cost_model == "pipedream":
        view, _ = pipedream_view(graph)
    else:
        view = graph
    count = len(stages)
    ranks = [tuple(r) for _, r in stages]
    inputs = set(input_nodes(view)) if options.cost_model == "native" else set()
    misplaced = [n for n in inputs if stage_of[n] != 0]
    if misplaced:
        raise PlanError(f"inputs {misplaced[:3]} must be in the first stage")
    workers_after = [sum(len(ranks[j]) for j in range(i + 1, count)) for i in range(count)]
    compute = [0.0] * count
    params = [0.0] * count
    keep = [0.0] * count
    for node, data in view.nodes(data=True):
        i = stage_of[node]
        if node not in inputs:
            compute[i] += float(data["fwd"]) + float(data["bwd"])
        params[i] += float(data["params"])
        keep[i] += float(data["act"] if options.cost_model == "pipedream"
                         else data.get("keep", data["act"]))
    comm = [0.0] * count
    if options.cost_model == "pipedream":
        prefix: set[str] = set()
        for i in range(count - 1):
            prefix |= {n for n in stages[i][0] if n in view}
            cut = sum(float(view.nodes[n]["act"]) for n in augmented_frontier(view, prefix))
            level = cluster.slowest_level_of(list(ranks[i]) + list(ranks[i + 1]))
            bw = cluster.levels[level].bandwidth
            if i > 0:  # the original never charges the first stage's output (its base case)
                comm[i] = max(comm[i], 2.0 * cut / (bw * len(ranks[i])))
            comm[i + 1] = max(comm[i + 1], 2.0 * cut / (bw * len(ranks[i + 1])))
    copies = [0.0] * count
    if options.cost_model != "pipedream":
        for u, v in view.edges:
            a, c = stage_of[u], stage_of[v]
            if a == c:
                continue
            level = cluster.slowest_level_of(list(ranks[a]) + list(ranks[c]))
            lv = cluster.levels[level]
            seconds = edge_bytes(view, u, v) / lv.bandwidth + lv.latency
            comm[a] += seconds / len(ranks[a])
            comm[c] += seconds / len(ranks[c])
            if lv.cpu_copies:  # a sends the activations, c their gradients, each by its CPU
                copy = edge_bytes(view, u, v) / lv.bandwidth
                copies[a] += copy / len(ranks[a])
                copies[c] += copy / len(ranks[c])
    priced = []
    for i in range(count):
        r = len(ranks[i])
        lv = cluster.levels[cluster.slowest_level_of(ranks[i])]
        sync = sync_seconds(params[i], r, lv.bandwidth, lv.latency, options)
        work = compute[i] / r + sync
        mem = stage_memory(params[i], keep[i], r, workers_after[i], options)
        priced.append(Stage(nodes=tuple(stages[i][0]), replicas=r, ranks=ranks[i],
                            compute=compute[i] / r, sync=sync, comm=comm[i], memory=mem,
                            time=max(work + copies[i], comm[i]), copies=copies[i]))
    slowest = max(s.time for s in priced) * bubble(count, options)
    if options.cost_model == "native":
        slowest = max(slowest, shared_core_time(priced, cluster))
    return tuple(priced), slowest


def shared_core_time(stages: Sequence[Stage], cluster: Cluster) -> float:
    """Seconds per minibatch the busiest host needs when its workers outnumber its cores: the
    CPU work of its ranks per minibatch (compute, sync, and the loopback copies each rank makes,
    sending, and receives, the same bytes coming back: twice `copies`) over its cores; 0 when
    every worker has a core of its own."""
    sharing = cluster.shared_cores()
    if sharing is None:
        return 0.0
    size, cores = sharing
    hosts: dict[int, float] = {}
    for stage in stages:
        for rank in stage.ranks:
            work = stage.compute + stage.sync + 2.0 * stage.copies
            hosts[rank // size] = hosts.get(rank // size, 0.0) + work
    return max(hosts.values(), default=0.0) / cores


def data_parallel_time(graph: nx.DiGraph, cluster: Cluster, *, options: ModelOptions) -> float:
    """Time per minibatch of plain data parallelism over every worker of the cluster."""
    view = pipedream_view(graph)[0] if options.cost_model == "pipedream" else graph
    inputs = set(input_nodes(view)) if options.cost_model == "native" else set()
    total = sum(float(d["fwd"]) + float(d["bwd"]) for n, d in view.nodes(data=True)
                if n not in inputs)
    params = sum(float(d["params"]) for _, d in view.nodes(data=True))
    if options.cost_model == "pipedream":
        # The original's recursion: each level all-reduces, divided by the workers inside.
        time, inside = total, 1
        for level in cluster.levels:
            n = level.workers
            time = (time + 4.0 * (n - 1) * params / (level.bandwidth * n) / inside) / n
            inside = n
        return time
    workers = cluster.workers
    lv = cluster.levels[cluster.slowest_level_of(list(range(workers)))]
    per_rank = total / workers + sync_seconds(params, workers, lv.bandwidth, lv.latency, options)
    sharing = cluster.shared_cores()
    if sharing is not None:  # the ranks of a host take turns on its cores
        size, cores = sharing
        return per_rank * min(size, workers) / cores
    return per_rank
