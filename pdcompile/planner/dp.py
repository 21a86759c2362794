"""PipeDream's dynamic program over antichain states (Narayanan et al., SOSP 2019, section 3.1).

Both cost models run the recurrence "best pipeline for a piece of the graph on m workers = min over
the last stage's start state k and replicas r of max(best pipeline before k on m - r workers,
the last stage's time)". The states are those of antichain.py, so branching graphs work.

* `pipedream_dp` reproduces the original optimizer: front to back, one level per cluster level
  (the level below's best pipeline on all its workers is the "compute time" of a segment at the
  level above), all workers used, optional memory constraint and straight option.
* `native_dp` prices stages with the native model of costmodel.py, back to front (so that a
  stage knows the workers downstream of it, which its memory depends on) and over rank positions
  (contiguous ranks: the cluster level that each stage's replicas and its boundaries span is known,
  so one pass covers every level of the hierarchy).

Both are vectorised with numpy over (successor state, workers, replicas).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import networkx as nx
import numpy as np

from pdcompile.cost.costgraph import edge_bytes
from pdcompile.cost.ties import tie_owners
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.planner.antichain import AntichainStates
from pdcompile.planner.costmodel import (
    ModelOptions,
    Placement,
    StageParts,
    demand_of,
    placement,
    stage_parts,
    values_of,
)
from pdcompile.schedule.kinds import kind

INF = float("inf")
FINITE_PERIOD_LIMIT = 1e9  # seconds per minibatch: past it no period is searched for (32 years)


@dataclass(frozen=True)
class DPStage:
    """One stage found by a DP: between states `before` and `after`, on these ranks."""

    before: int
    after: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class DPResult:
    """Stages in pipeline order and the DP's own objective (seconds per minibatch); `free`:
    where a streaming schedule's rule on tied stages changed the optimum (`native_dp`), the
    optimum without it, whose cuts the planner may still use with the tied stages set equal
    (planner/tie_repair.py: lowering them leaves workers idle, which the DP never does)."""

    stages: tuple[DPStage, ...]
    objective: float
    free: DPResult | None = None
    # the best pipeline on each smaller count of the grid's units, fewest first (its stages on
    # the last units, as the grid prices them): the table holds them already, and the DP's
    # objective may misrank them against the price (under a flush it counts no stage's fill
    # before it), so the planner prices those a bound leaves a chance (planner/fewer_workers.py)
    fewer: tuple[DPResult, ...] = ()


# ------------------------------------------------------------------------------ state tables
@dataclass(frozen=True)
class StateTables:
    """Per-state cumulative sums and what crosses a state's boundary (numpy arrays)."""

    compute: np.ndarray  # [s] fwd+bwd seconds of the downset
    forward: np.ndarray  # [s] fwd seconds of the downset
    params: np.ndarray  # [s] parameter bytes of the downset
    keep: np.ndarray  # [s] activation bytes the backward keeps (native) / act (pipedream)
    act: np.ndarray  # [s] act bytes of the downset (pipedream's stash estimate)
    frontier: np.ndarray  # [s] PipeDream cut bytes: act of the augmented antichain
    inside: np.ndarray  # [s, n] successors of node n inside the downset (member nodes only)
    degree: np.ndarray  # [n] successors of node n
    weight: np.ndarray  # [n] bytes node n sends to a stage that reads it (its largest edge)
    leaving: np.ndarray  # [s] bytes of member nodes with a successor outside the downset
    copies: np.ndarray  # [s] bytes of the edges leaving the downset (loopback copies, at most)
    edges: np.ndarray  # [n, n] bytes of edge u -> v
    valid: np.ndarray  # [k, j] bool: a stage may span (k, j]
    # tied parameters (the CostGraph's `ties`, cost/ties.py), one row per tie:
    tie_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [t] bytes
    tie_readers: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [t, s] readers
    # of the tie in the downset
    tie_owner: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [t, s] 1 where
    # the downset holds the reader whose params count the tie (cost/ties.py `tie_owners`)

    def tie_copies(self, k: int, js: np.ndarray) -> np.ndarray:
        """Bytes of the tied parameters that the stages (k, j] for j in `js` hold a copy of
        but `params` counts at another stage (cost/ties.py `copied_bytes`): a reader of the tie
        in the stage, not the first."""
        if self.tie_bytes.size == 0:
            return np.zeros(js.size)
        held = self.tie_readers[:, js] - self.tie_readers[:, k:k + 1] > 0  # [t, j]
        first = self.tie_owner[:, js] - self.tie_owner[:, k:k + 1] > 0
        return (held & ~first).T @ self.tie_bytes

    def crossing(self, k: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bytes received, sent and passing over per minibatch by the stages (k, j] for j in
        `js`: each node's output once per boundary it crosses (cost/crossing.py's rule, with
        all later readers taken as one stage); passing: from downset k to beyond downset j."""
        member = self.inside[k] >= 0  # nodes of downset k (others are marked -1)
        open_ = np.flatnonzero(member & (self.inside[k] < self.degree))  # read beyond k
        if open_.size == 0:
            none = np.zeros(js.size)
            return none, self.leaving[js].copy(), none.copy()
        counts = self.inside[np.ix_(js, open_)]  # [j, u]
        w = self.weight[open_]
        received = (counts > self.inside[k, open_]) @ w
        still_open = (counts < self.degree[open_]) @ w  # from downset k beyond downset j
        return received, self.leaving[js] - still_open, still_open

    def copied(self, k: int, js: np.ndarray) -> np.ndarray:
        """Bytes per minibatch of the edges from the stages (k, j] to beyond j, for j in `js`:
        a bound on what they send counted once per later stage that reads it (crossing_bytes'
        rule, the largest edge into each), which is what their CPU copies over loopback links."""
        open_ = np.flatnonzero((self.inside[k] >= 0) & (self.inside[k] < self.degree))
        out = self.copies[js].copy()
        if open_.size:  # less the edges from downset k to beyond j
            out -= ((self.inside[js] < 0) @ self.edges[open_].T).sum(axis=1)
        return out


def state_tables(graph: nx.DiGraph, states: AntichainStates,
                 pinned: tuple[str, ...] = ()) -> StateTables:
    """Tables of `states` over `graph` (node attributes as in costgraph).

    `pinned`: nodes of `graph` outside the states (inputs) that live on the first stage; they
    count as members of every state, and `native_dp` charges them to the first stage.
    """
    order = tuple(states.order) + tuple(pinned)
    n, s = len(order), len(states)
    member = np.zeros((s, n), dtype=np.float64)
    for i in range(s):
        bits = states.downsets[i]
        member[i, :len(states.order)] = [(bits >> v) & 1 for v in range(len(states.order))]
    member[:, len(states.order):] = 1.0
    node = [graph.nodes[x] for x in order]
    pinned_set = set(pinned)  # inputs: no compute (cost.crossing.input_nodes)
    comp = np.array([0.0 if x in pinned_set else float(d["fwd"]) + float(d["bwd"])
                     for x, d in zip(order, node, strict=True)])
    fwd = np.array([0.0 if x in pinned_set else float(d["fwd"])
                    for x, d in zip(order, node, strict=True)])
    par = np.array([float(d["params"]) for d in node])
    act = np.array([float(d["act"]) for d in node])
    keep = np.array([float(d.get("keep", d["act"])) for d in node])
    index = {x: i for i, x in enumerate(order)}
    adjacency = np.zeros((n, n))  # [u, v]: edge u -> v
    weight = np.zeros(n)
    for u, v in graph.edges:
        adjacency[index[u], index[v]] = 1.0
        weight[index[u]] = max(weight[index[u]], edge_bytes(graph, u, v))
    degree = adjacency.sum(axis=1)
    counts = member @ adjacency.T  # [s, n]: successors of n inside the downset
    inside = np.where(member > 0, counts, -1.0)
    leaving = ((member > 0) & (counts < degree)) @ weight
    sizes = np.zeros((n, n))  # [u, v]: bytes of edge u -> v
    for u, v in graph.edges:
        sizes[index[u], index[v]] = edge_bytes(graph, u, v)
    copies = ((member > 0) * ((member <= 0) @ sizes.T)).sum(axis=1)
    frontier = np.array([sum(act[v] for v in states.frontier[i]) for i in range(s)])
    valid = np.zeros((s, s), dtype=bool)
    width = (s + 7) // 8
    for j in range(s):
        raw = np.frombuffer(states.reach[j].to_bytes(width, "little"), dtype=np.uint8)
        valid[:, j] = np.unpackbits(raw, bitorder="little")[:s].astype(bool)
    block_of = {m: x for x, d in zip(order, node, strict=True) for m in d.get("members", [x])}
    # each tie read in the graph, with the block whose params count it (cost/ties.py's rule)
    ties = [(t, o) for t, o in zip(graph.graph.get("ties", ()), tie_owners(graph), strict=True)
            if o is not None]
    readers = np.zeros((len(ties), n))
    owner = np.zeros((len(ties), n))
    for t, (tie, block) in enumerate(ties):
        for name in tie["nodes"]:
            if name in block_of:
                readers[t, index[block_of[name]]] = 1.0
        owner[t, index[block]] = 1.0
    return StateTables(compute=member @ comp, forward=member @ fwd, params=member @ par,
                       keep=member @ keep, act=member @ act, frontier=frontier, inside=inside,
                       degree=degree, weight=weight, leaving=leaving, copies=copies,
                       edges=sizes, valid=valid,
                       tie_bytes=np.array([float(t["bytes"]) for t, _ in ties]),
                       tie_readers=readers @ member.T, tie_owner=owner @ member.T)


# ------------------------------------------------------------------------------ native
TIE_CHOICES = 64  # the most replica-count combinations over ties a DP runs for (StageGrid)
TIE_BATCH = 16  # ... and how many of them `native_dp` runs side by side (its arrays' memory)
TIE_WORK = 20_000_000  # ... exactly where that takes at most this many stage values in all
UNIT_LIMIT = 32  # a DP spans at most this many units of workers (a straight one: every worker)
PARTS_BYTES = 512 << 20  # the grid keeps stage parts of rows up to this size, ...
VALUES_BYTES = 256 << 20  # ... and planning objectives up to this; others are recomputed


def unit_bounds(workers: int, *, straight: bool = False) -> np.ndarray:
    """The first rank of each unit a DP over `workers` spans, and `workers` last: one worker
    per unit up to UNIT_LIMIT (and in a straight pipeline, one replica per stage), else
    UNIT_LIMIT units of near-equal size, so that the (workers, replicas) pairs of the grid stay
    within UNIT_LIMIT (UNIT_LIMIT + 1) / 2 however big the cluster: equal units where some
    count from UNIT_LIMIT / 2 up divides the workers (stages then have replica counts with
    small common multiples, which keeps the pricing of their transfers short)."""
    if straight or workers <= UNIT_LIMIT:
        return np.arange(workers + 1)
    units = next((u for u in range(UNIT_LIMIT, UNIT_LIMIT // 2 - 1, -1) if workers % u == 0),
                 UNIT_LIMIT)
    return (np.arange(units + 1) * workers) // units


def dp_pairs(workers: int, *, straight: bool = False) -> int:
    """The (workers, replicas) pairs of a grid over `workers` (`stage_grid`): its width, which
    with the number of states sets the work of a pass of the DP."""
    units = len(unit_bounds(workers, straight=straight)) - 1
    return units if straight else units * (units + 1) // 2


@dataclass(frozen=True)
class _Row:
    """The stages starting at one state: their end states and figures ([j, 1] each)."""

    js: np.ndarray
    figures: dict[str, np.ndarray]
    rest: np.ndarray  # [j, 1] fwd+bwd of everything after each end state
    # [t, j] True where the stage holds some of tie t's readers but not all: the tie then
    # spans several stages, whose replicas a streaming schedule needs equal (`tie_allowed`)
    tie_split: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    tie_held: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))  # [t, j]
    # True where the stage holds one of tie t's readers at least


@dataclass
class _Kept:
    """Arrays kept up to a byte budget, first come first kept: a DP sweeps its rows again and
    again in the same order, where evicting the oldest would keep nothing that is used next."""

    budget: int
    used: int = 0
    items: dict[tuple[object, ...], object] = field(default_factory=dict)

    def keep(self, key: tuple[object, ...], value: object, size: int) -> None:
        if self.used + size <= self.budget:
            self.items[key] = value
            self.used += size


@dataclass(frozen=True)
class StageGrid:
    """Every candidate stage (k, j] at every position (m units for it and the rest, r of them
    its replicas) with the pieces of its objective (costmodel.StageParts), shared by the native
    DPs: the planning objective's (`native_dp`, each of its variants) and the bisection on the
    period (`native_dp_period`). A row (one start state k: [j, q] arrays) is built when a DP
    asks for it and kept while the grid's byte budgets allow (PARTS_BYTES, VALUES_BYTES), so
    the memory stays bounded whatever the number of states and workers. A unit is one worker,
    or on clusters wider than UNIT_LIMIT a group of neighbouring workers (`bounds`)."""

    workers: int  # units the DP spans
    last: int
    mq: np.ndarray  # [q] units of the stage and all after it, ascending, then ...
    rq: np.ndarray  # [q] ... units of the stage (its replicas), ascending
    bounds: np.ndarray  # [units + 1] first rank of each unit; the ranks spanned last
    rows: dict[int, _Row]  # k -> the stages starting at state k
    coef: Placement  # [q] the cost coefficients of each position
    options: ModelOptions
    memory: float | None
    recompute: bool  # the stages may also recompute their activations (where planned)
    parts_kept: _Kept = field(default_factory=lambda: _Kept(PARTS_BYTES))
    values_kept: _Kept = field(default_factory=lambda: _Kept(VALUES_BYTES))
    widths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [q]
    # workers of the stage at each position (its replicas; units may hold several workers)
    ties: int = 0  # tied parameters that some stage may split (rows' `tie_split`)

    def tie_counts(self, free: DPResult) -> list[tuple[int, ...]]:
        """The replica counts (in workers) that the stages splitting a tie may share under a
        streaming schedule, one tuple per choice with a count per tie (`tie_allowed`), for a
        DP whose optimum without the rule is `free`: every combination of the widths the grid
        places (exact), where that stays within TIE_CHOICES combinations and TIE_WORK
        elements of work, else (one DP pass per choice is too much on a wide grid of many
        states) the combinations of the widths of the stages holding each tie in `free`; those
        first either way."""
        widths = sorted({int(w) for w in self.widths})
        held = self._replicas_per_tie(free, split=False)
        near = list(itertools.product(*(sorted(h) or widths for h in held)))[:TIE_CHOICES]
        work = len(self.mq) * sum(row.js.size for row in self.rows.values())
        if len(widths) ** self.ties <= TIE_CHOICES and work * len(widths) ** self.ties \
                <= TIE_WORK:  # all of them, those of `free` first (a period's search stops
            # at the first that reaches it)
            return near + [c for c in itertools.product(widths, repeat=self.ties)
                           if c not in near]
        return near

    def ties_apart(self, result: DPResult) -> bool:
        """Whether the result's stages splitting some tie sit on unequal worker counts (the
        rule `tie_allowed` enforces; False for a grid without it)."""
        if self.ties == 0:
            return False
        return any(len(h) > 1 for h in self._replicas_per_tie(result, split=True))

    def _replicas_per_tie(self, result: DPResult, *, split: bool) -> list[set[int]]:
        """Per tie, the replica counts of the result's stages holding one of its readers (with
        `split`: only those holding some of its readers but not all, `_Row.tie_split`)."""
        held: list[set[int]] = [set() for _ in range(self.ties)]
        for stage in result.stages:
            row = self.rows[stage.before]
            marks = row.tie_split if split else row.tie_held
            for t in np.flatnonzero(marks[:, np.searchsorted(row.js, stage.after)]):
                held[t].add(len(stage.ranks))
        return held

    def tie_allowed(self, k: int, choices: list[tuple[int, ...] | None],
                    ) -> np.ndarray | None:
        """[b, j, q] False where the stage (k, j] at position q splits a tie t over stages but
        is not on choices[b][t] workers (a streaming schedule would update such stages apart,
        cost/ties.py `updates_apart`; a choice None rules out nothing); None where nothing is
        ruled out."""
        split = self.rows[k].tie_split  # [t, j]
        if not split.any() or all(c is None for c in choices):
            return None
        counts = np.array([c if c is not None else (-1,) * self.ties for c in choices])
        wrong = (counts[:, :, None] != self.widths[None, None, :]).astype(np.float64)
        wrong[[c is None for c in choices]] = 0.0  # [b, t, q]
        return ~(np.einsum("tj,btq->bjq", split.astype(np.float64), wrong) > 0)

    def ranks(self, first_unit: int, units: int) -> tuple[int, ...]:
        """The ranks of `units` units from `first_unit` on."""
        return tuple(range(int(self.bounds[first_unit]), int(self.bounds[first_unit + units])))

    def parts(self, k: int, recompute: bool = False) -> StageParts:
        """The pieces of the objective of the stages starting at state k ([j, q] arrays), those
        recomputing their activations if `recompute`."""
        key = (k, recompute)
        if key in self.parts_kept.items:
            return self.parts_kept.items[key]  # type: ignore[return-value]
        row = self.rows[k]
        again = None
        if recompute:
            again = row.figures["forward"]
        figures = {name: v for name, v in row.figures.items() if name != "forward"}
        parts = stage_parts(**figures, coef=self.coef, options=self.options,
                            memory=self.memory, recompute=again)
        self.parts_kept.keep(key, parts, sum(np.asarray(getattr(parts, f)).nbytes
                                             for f in StageParts.__dataclass_fields__))
        return parts

    def stage_values(self, k: int, options: ModelOptions) -> np.ndarray:
        """The planning objective of the stages starting at state k (kept per `flight`): the
        better of keeping and recomputing activations where recomputation is planned.
        `options` may differ from the grid's in `flight` only."""
        key = (options.flight, k)
        if key in self.values_kept.items:
            return self.values_kept.items[key]  # type: ignore[return-value]
        rest = self.rows[k].rest
        values = values_of(self.parts(k), rest, options)
        if self.recompute:
            values = np.minimum(values, values_of(self.parts(k, True), rest, options))
        self.values_kept.keep(key, values, values.nbytes)
        return values

    def stage_demand(self, k: int, options: ModelOptions, period: float,
                     after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(in flight, demand) of the stages starting at state k (costmodel.demand_of), the
        better of keeping and recomputing activations where recomputation is planned."""
        flight, demand = demand_of(self.parts(k), options, period, after)
        if self.recompute:
            other_flight, other = demand_of(self.parts(k, True), options, period, after)
            better = other < demand
            flight, demand = np.where(better, other_flight, flight), np.minimum(demand, other)
        return flight, demand

    def best_per_units(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per unit count m (0..workers): the smallest of `values` ([q], or [b, q] for several
        DPs side by side) over the replica counts r, and the position q of the first r reaching
        it (m = 0: INF at position 0); [m] or [b, m] arrays."""
        n = self.workers
        lead = values.shape[:-1]
        if len(self.mq) == n:  # one replica count per m (straight): nothing to choose
            out_v = np.full((*lead, n + 1), INF)
            out_q = np.zeros((*lead, n + 1), dtype=np.int64)
            out_v[..., self.mq], out_q[..., self.mq] = values, np.arange(n)
            return out_v, out_q
        grid_v = np.full((*lead, n + 1, n + 1), INF)  # [m, r]: at most UNIT_LIMIT + 1 squared
        grid_v[..., self.mq, self.rq] = values
        r_best = np.argmin(grid_v, axis=-1)  # [m] the first r of the smallest
        col = np.zeros((n + 1, n + 1), dtype=np.int64)
        col[self.mq, self.rq] = np.arange(len(self.mq))
        return (np.take_along_axis(grid_v, r_best[..., None], axis=-1)[..., 0],
                col[np.arange(n + 1), r_best])


def stage_grid(tables: StateTables, cluster: Cluster, *, options: ModelOptions,
               memory: float | None, straight: bool = False, workers: int | None = None,
               copies: int = 1, copy_link: Level | None = None,
               recompute: bool = False, interfaces: str = "seen") -> StageGrid:
    """The grid of `tables` on the first `workers` ranks (default all), in units of workers
    (`unit_bounds`); straight: one replica per stage; `copies` / `copy_link`: the pipeline is
    replicated (costmodel.placement); `recompute`: every stage may also recompute its
    activations (pdcompile.cost.recompute); `interfaces`: how the stages see the servers'
    shared interfaces (costmodel.placement)."""
    n = workers or cluster.workers
    bounds = unit_bounds(n, straight=straight)
    units = len(bounds) - 1
    s = len(tables.compute)
    last = s - 1
    pairs = [(m, r) for m in range(1, units + 1) for r in ((1,) if straight else range(1, m + 1))]
    mq = np.array([m for m, _ in pairs])
    rq = np.array([r for _, r in pairs])
    coef = _stacked([placement(cluster, int(bounds[units - m]),
                               int(bounds[units - m + r] - bounds[units - m]), n,
                               copies=copies, copy_link=copy_link,
                               interfaces=interfaces) for m, r in pairs])
    total = float(tables.compute[last])
    backward = tables.compute - tables.forward  # bwd seconds of each downset
    copying = any(level.cpu_copies for level in cluster.levels)
    rows = {}
    for k in range(last):
        js = np.nonzero(tables.valid[k])[0]
        if js.size == 0:
            continue
        received, sent, passing = tables.crossing(k, js)
        # loopback copies, where some link copies by CPU (a product over the graph's nodes)
        copied = tables.copied(k, js) if copying else sent
        base = 0.0 if k == 0 else 1.0  # the first stage holds the pinned inputs
        if k == 0:  # ... so it receives nothing and sends what they feed beyond it too
            received, sent = np.zeros(js.size), tables.leaving[js].copy()
            passing = np.zeros(js.size)
            copied = tables.copies[js].copy() if copying else sent
        tie_copy = tables.tie_copies(k, js)  # a tie's copies on its later holders
        figures = {"compute": (tables.compute[js] - tables.compute[k])[:, None],
                   "backward": (backward[js] - backward[k])[:, None],
                   "params": (tables.params[js] - tables.params[k] + tie_copy)[:, None],
                   "keep": (tables.keep[js] - base * tables.keep[k])[:, None],
                   "received": received[:, None], "sent": sent[:, None],
                   "passing": passing[:, None], "sent_copies": copied[:, None]}
        if recompute:
            figures["forward"] = (tables.forward[js] - tables.forward[k])[:, None]
        held = tables.tie_readers[:, js] - tables.tie_readers[:, k:k + 1]  # [t, j]
        split = (held > 0) & (held < tables.tie_readers[:, last:last + 1])
        rows[k] = _Row(js, figures, (total - tables.compute[js])[:, None], split, held > 0)
    widths = np.array([int(bounds[units - m + r] - bounds[units - m]) for m, r in pairs],
                      dtype=np.int64)
    # the ties some stage splits (a tie read by one block never is): the rule's subjects,
    # none under a flush, which updates every stage once per minibatch
    splittable = np.zeros(tables.tie_bytes.size, dtype=bool)
    if not kind(options.schedule).flush:
        for row in rows.values():
            splittable |= row.tie_split.any(axis=1)
    for k, row in rows.items():
        rows[k] = replace(row, tie_split=row.tie_split[splittable],
                          tie_held=row.tie_held[splittable])
    return StageGrid(units, last, mq, rq, bounds, rows, coef, options, memory, recompute,
                     widths=widths, ties=int(splittable.sum()))


def native_dp(grid: StageGrid, *, options: ModelOptions, straight: bool = False,
              fill: bool = False, max_stages: int | None = None) -> DPResult:
    """Best plan under the native model's planning objective (costmodel.stage_values) on the
    grid's workers, using every one of them (straight: one worker per stage, as many stages as
    workers if the graph allows, fewer otherwise; with `fill` exactly as many; `max_stages`: at
    most that many stages). `options` may differ from the grid's in `flight` only.

    Under a streaming schedule the stages splitting a tie hold one replica count (cost/ties.py
    `updates_apart`): where the optimum without that rule breaks it, the DP runs again for
    every choice of `StageGrid.tie_counts` (TIE_BATCH at a time, side by side in numpy) and
    keeps the best, the first choice among equals (where none keeps the rule, the optimum
    without it). Raises PlanError when no plan fits the memory.
    """
    free = _native_dp(grid, options=options, straight=straight, fill=fill,
                      max_stages=max_stages, choices=[None])
    if free is None:
        raise PlanError("no plan fits")  # the planner turns this into an actionable message
    if not grid.ties_apart(free):  # the optimum without the rule keeps it
        return free
    choices = grid.tie_counts(free)
    best: DPResult | None = None
    for start in range(0, len(choices), TIE_BATCH):
        found = _native_dp(grid, options=options, straight=straight, fill=fill,
                           max_stages=max_stages, choices=list(choices[start:start + TIE_BATCH]))
        if found is not None and (best is None or found.objective < best.objective):
            best = found
    # no plan keeps the rule: the free optimum, which the planner mends or drops
    # (planner/search.py, planner/tie_repair.py)
    return replace(best, free=free) if best is not None else free


def _native_dp(grid: StageGrid, *, options: ModelOptions, straight: bool, fill: bool,
               max_stages: int | None, choices: list[tuple[int, ...] | None],
               ) -> DPResult | None:
    """`native_dp` for each of `choices` side by side (index b of the arrays below: the stages
    splitting tie t on choices[b][t] workers, None: free); the best of them, None if none
    fits."""
    n, last = grid.workers, grid.last
    depth = n if max_stages is None else max(1, min(n, max_stages))
    prev = grid.mq - grid.rq
    batch = len(choices)
    # best[b, d, k, m]: the best pipeline of the rest after state k on m units in at most
    # d + 1 stages (one layer when the stage count is free)
    layers = depth if max_stages is not None else 1
    best = np.full((batch, layers, last + 1, n + 1), INF)
    best[:, :, last, 0] = 0.0
    if straight and not fill:  # the last stage may leave workers after it unused: a stage
        # priced on m units left starts at rank n - m, where the plan puts it
        best[:, :, last, :] = 0.0
    choice_j = np.full((batch, layers, last + 1, n + 1), -1, dtype=np.int64)
    choice_r = np.zeros((batch, layers, last + 1, n + 1), dtype=np.int64)
    for k in range(last - 1, -1, -1):
        if k not in grid.rows:
            continue
        js = grid.rows[k].js
        values = grid.stage_values(k, options)  # [j, q]
        allowed = grid.tie_allowed(k, choices)  # masked apart from the kept values, which
        # serve every choice
        stage = values[None] if allowed is None else np.where(allowed, values, INF)  # [b, j, q]
        for d in range(layers):
            if max_stages is None:
                follow = best[:, 0][:, js][:, :, prev]  # [b, j, q]
            elif d == 0:  # a single stage: nothing may follow
                follow = np.where(js[:, None] == last, np.where(prev == 0, 0.0, INF), INF)
            else:
                follow = best[:, d - 1][:, js][:, :, prev]
            cand = np.maximum(stage, follow)  # [b, j, q]
            if cand.shape[0] != batch:
                cand = np.broadcast_to(cand, (batch, *cand.shape[1:]))
            arg = np.argmin(cand, axis=1)  # [b, q] best successor state per (m, r)
            val, q_best = grid.best_per_units(
                np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :])  # [b, m]
            better = val < best[:, d, k]
            best[:, d, k] = np.where(better, val, best[:, d, k])
            chosen_j = js[np.take_along_axis(arg, q_best, axis=1)]
            choice_j[:, d, k] = np.where(better, chosen_j, choice_j[:, d, k])
            choice_r[:, d, k] = np.where(better, grid.rq[q_best], choice_r[:, d, k])
    top = layers - 1
    used = n
    b = int(np.argmin(best[:, top, 0, used]))
    if not math.isfinite(best[b, top, 0, used]):
        return None

    def walked(units: int) -> DPResult:
        """The plan on the last `units` units, back along the choices."""
        stages = []
        k, m, d = 0, units, top
        while k != last:
            j, r = int(choice_j[b, d, k, m]), int(choice_r[b, d, k, m])
            stages.append(DPStage(before=k, after=j, ranks=grid.ranks(n - m, r)))
            k, m = j, m - r
            d = d - 1 if max_stages is not None else d
        return DPResult(stages=tuple(stages), objective=float(best[b, top, 0, units]))

    fewer: tuple[DPResult, ...] = ()
    if not straight and not fill:
        fewer = tuple(walked(units) for units in range(1, n)
                      if math.isfinite(best[b, top, 0, units]))
    return replace(walked(used), fewer=fewer)


def native_dp_period(grid: StageGrid, *, options: ModelOptions, period: float,
                     straight: bool = False, fill: bool = False,
                     ) -> tuple[DPResult, tuple[int, ...]] | None:
    """A streaming plan that reaches `period` seconds per minibatch under the closed form's
    circuits (costmodel.stage_demand) on the grid's workers, all of them used (straight: one
    worker per stage, any number of them unless `fill`), and each stage's in-flight count;
    None if there is none. Among the continuations of each (state, workers) it keeps the one of
    least demand, which is best for every stage before it. The stages splitting a tie hold one
    replica count (where the plan without that rule breaks it, each of `StageGrid.tie_counts`
    is tried until one reaches the period)."""
    free = _native_dp_period(grid, options=options, period=period, straight=straight,
                             fill=fill, tie_counts=None)
    if free is None or not grid.ties_apart(free[0]):
        return free
    for counts in grid.tie_counts(free[0]):
        found = _native_dp_period(grid, options=options, period=period, straight=straight,
                                  fill=fill, tie_counts=counts)
        if found is not None:
            return found
    return None


def _native_dp_period(grid: StageGrid, *, options: ModelOptions, period: float,
                      straight: bool, fill: bool, tie_counts: tuple[int, ...] | None,
                      ) -> tuple[DPResult, tuple[int, ...]] | None:
    """`native_dp_period` with the stages splitting a tie t on tie_counts[t] workers."""
    n, last = grid.workers, grid.last
    prev = grid.mq - grid.rq
    q_all = np.arange(len(grid.mq))
    demand = np.full((last + 1, n + 1), INF)  # least demand of a pipeline of the rest after k
    demand[last, 0] = -INF
    if straight and not fill:  # the last stage may leave workers after it unused: a stage
        # priced on m units left starts at rank n - m, where the plan puts it
        demand[last, :] = -INF
    flight = np.zeros((last + 1, n + 1))
    choice_j = np.full((last + 1, n + 1), -1, dtype=np.int64)
    choice_r = np.zeros((last + 1, n + 1), dtype=np.int64)
    for k in range(last - 1, -1, -1):
        if k not in grid.rows:
            continue
        js = grid.rows[k].js
        after = demand[js][:, prev]  # [j, q]
        n_q, e_q = grid.stage_demand(k, options, period, after)
        allowed = grid.tie_allowed(k, [tie_counts])
        if allowed is not None:
            e_q = np.where(allowed[0], e_q, INF)
        arg = np.argmin(e_q, axis=0)
        val, q_best = grid.best_per_units(e_q[arg, q_all])
        better = val < demand[k]
        demand[k] = np.where(better, val, demand[k])
        choice_j[k] = np.where(better, js[arg[q_best]], choice_j[k])
        choice_r[k] = np.where(better, grid.rq[q_best], choice_r[k])
        flight[k] = np.where(better, n_q[arg[q_best], q_best], flight[k])
    if not math.isfinite(demand[0, n]):
        return None
    stages, counts = [], []
    k, m = 0, n
    while k != last:
        j, r = int(choice_j[k, m]), int(choice_r[k, m])
        stages.append(DPStage(before=k, after=j, ranks=grid.ranks(n - m, r)))
        counts.append(int(flight[k, m]))
        k, m = j, m - r
    return DPResult(stages=tuple(stages), objective=period), tuple(counts)


def native_dp_bisect(grid: StageGrid, *, options: ModelOptions, low: float, high: float,
                     straight: bool = False, fill: bool = False, tolerance: float = 0.03,
                     ) -> tuple[DPResult, tuple[int, ...]] | None:
    """The fastest period that `native_dp_period` reaches, by bisection between `low` and
    `high` seconds per minibatch to a relative `tolerance`; None if not even `high`. An
    infinite `high` (every candidate priced infinite) is first brought down to a finite period
    some plan reaches: bisecting from infinity would return the first plan found, unsearched."""
    if math.isnan(high):
        return None
    low = low if math.isfinite(low) and low > 0 else 0.0
    found = native_dp_period(grid, options=options, period=high, straight=straight, fill=fill)
    if found is None:
        return None
    if not math.isfinite(high):
        finite = _finite_period(grid, options=options, low=low, straight=straight, fill=fill)
        if finite is None:
            return found
        high = finite
        found = native_dp_period(grid, options=options, period=high, straight=straight,
                                 fill=fill) or found
    low = max(low, high * 1e-6)
    while high > low * (1 + tolerance):
        # each root alone: low * high overflowed to inf past 1e154 s (a node costed at
        # 1e300 s), mid became inf, and the bisection never ended
        mid = math.sqrt(low) * math.sqrt(high)
        if not low < mid < high:
            break  # no float between them (subnormal periods): it would never end either
        attempt = native_dp_period(grid, options=options, period=mid, straight=straight,
                                   fill=fill)
        if attempt is None:
            low = mid
        else:
            high, found = mid, attempt
    return found


def _finite_period(grid: StageGrid, *, options: ModelOptions, low: float, straight: bool,
                   fill: bool) -> float | None:
    """A finite period that some plan reaches, growing fourfold from `low` (or a nanosecond)
    up to FINITE_PERIOD_LIMIT seconds; None past it."""
    period = max(low, 1e-9)
    while period <= FINITE_PERIOD_LIMIT:
        if native_dp_period(grid, options=options, period=period, straight=straight,
                            fill=fill) is not None:
            return period
        period *= 4
    return None


def _stacked(coefs: list[Placement]) -> Placement:
    """One Placement whose fields are arrays over the candidate positions."""
    fields = {f: np.array([getattr(c, f) for c in coefs], dtype=np.float64)
              for f in Placement.__dataclass_fields__}
    return Placement(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ pipedream
def pipedream_dp(tables: StateTables, cluster: Cluster, *, memory: float | None,
                 straight: bool = False, tie_counts: tuple[int, ...] | None = None,
                 ) -> DPResult:
    """The original optimizer's hierarchical recurrence (see the module docstring).

    `memory` None means no memory constraint (the original's default); otherwise its
    stash estimate must fit. Levels are the cluster's, innermost first. A level wider than
    UNIT_LIMIT (not straight) is planned in units of neighbouring members (`unit_bounds`), so
    that its (units, replicas) pairs stay within UNIT_LIMIT^2 / 2 whatever the cluster: stages
    then hold whole units (a bound on the exact optimum, measured in the tests).

    `tie_counts` (one level only): a stage holding some but not all readers of tie t
    (`tables.tie_readers`) must sit on tie_counts[t] workers, the rule under which a streaming
    schedule can run a plan whose stages share tied parameters (cost/ties.py `updates_apart`);
    the planner runs this once per choice of counts (planner/search.py `_pipedream_plan`).
    """
    if tie_counts is not None and len(cluster.levels) > 1:
        raise PlanError("the pipedream DP applies the tie rule on one level of workers only")
    s = len(tables.compute)
    last = s - 1
    levels = cluster.levels
    seg = tables.compute[None, :] - tables.compute[:, None]  # [a, j] fwd+bwd of (a, j]
    seg = np.where(tables.valid, seg, INF)
    seg[0] = np.where(np.arange(s) > 0, tables.compute, INF)
    # per level: its starts, its values val[a, j, m] and its recorded split of (a, j] on m units
    tables_levels: list[tuple[np.ndarray, np.ndarray, Callable[[int, int, int], tuple[int, int]]]]
    tables_levels = []
    # per level: its members in units (unit_bounds: at most UNIT_LIMIT units, one member each
    # where the level is that small, and always in a straight pipeline)
    level_bounds = [unit_bounds(level.workers, straight=straight) for level in levels]
    inside = 1
    for depth, level in enumerate(levels):
        final = depth == len(levels) - 1
        starts = np.array([0]) if final else np.arange(s)
        bounds = level_bounds[depth]
        units = len(bounds) - 1
        # the innermost level over every start has additive segments: two exact shortcuts
        # (not with a memory limit or straight: single stages then give no finite bound; not
        # on units of several members: they count one member per unit)
        fast = (depth == 0 and not final and memory is None and not straight
                and units == level.workers)
        if fast and int(_cost_classes(tables).max()) + 1 <= s // 4:
            # few cost classes (states differing by zero-cost nodes): values per class, the
            # splits recovered along the walk back only
            val = _pd_level_by_class(tables, seg, level.workers, level.bandwidth)
            tables_levels.append((starts, val, functools.partial(
                _pd_level_split, tables, seg, val, level.workers, level.bandwidth)))
        elif fast and len(np.unique(tables.compute)) >= s // 2:
            # the pruned level; not when many states share their compute (the windows of
            # useful splits stay crowded): there the plain level is faster
            tables_levels.append((starts, *_as_split(*_pd_level_all_starts(
                tables, seg, level.workers, level.bandwidth))))
        else:  # the plain level; all three give the same tables
            tables_levels.append((starts, *_as_split(*_pd_level(
                tables, seg, starts, units, level.bandwidth, inside, memory, straight,
                bounds=bounds, tie_counts=tie_counts))))
        if not final:
            seg = tables_levels[-1][1][:, :, units]  # [a, j]
        inside = level.workers
    # walk back down: split each top-level segment with the level below
    top_val = tables_levels[-1][1]
    objective = float(top_val[0, last, len(level_bounds[-1]) - 1])
    if not math.isfinite(objective):
        raise PlanError("no plan fits")
    segments = [(0, last, 1, tuple(range(cluster.workers)))]  # (a, j, replica factor, ranks)
    for depth in range(len(levels) - 1, -1, -1):
        starts, _, split = tables_levels[depth]
        row = {int(a): i for i, a in enumerate(starts)}
        group = cluster.group_size(depth - 1) if depth > 0 else 1  # workers per unit here
        out = []
        for a, j, factor, ranks in segments:
            i = row[a]
            pieces = []
            bounds = level_bounds[depth]
            m, end = len(bounds) - 1, j
            while True:
                k, r = split(i, end, m)
                if k < 0:  # the base case: (a, end] on all m remaining units
                    pieces.append((a, end, m))
                    break
                pieces.append((k, end, r))
                end, m = k, m - r
            pieces.reverse()
            # ranks: this segment's members are blocks of `group` ranks; a piece on r units
            # takes their consecutive members out of every copy of the segment.
            members = [ranks[u * group:(u + 1) * group] for u in range(len(ranks) // group)]
            per_copy = levels[depth].workers
            copies = [members[c * per_copy:(c + 1) * per_copy]
                      for c in range(len(members) // per_copy)]
            offset = 0  # in units of this level (pieces run front to back)
            for before, after, r in pieces:
                first, stop = int(bounds[offset]), int(bounds[offset + r])
                mine = tuple(sorted(x for copy in copies for block in copy[first:stop]
                                    for x in block))
                out.append((before, after, factor * (stop - first), mine))
                offset += r
        segments = out
    stages = tuple(DPStage(before=a, after=j, ranks=ranks) for a, j, _, ranks in segments)
    return DPResult(stages=stages, objective=objective)


def _as_split(val: np.ndarray, kk: np.ndarray, rr: np.ndarray,
              ) -> tuple[np.ndarray, Callable[[int, int, int], tuple[int, int]]]:
    """A level's values and its split tables as (values, split(row, end, units) -> (k, r))."""
    def split(i: int, j: int, m: int) -> tuple[int, int]:
        return int(kk[i, j, m]), int(rr[i, j, m])
    return val, split


def _pd_level(tables: StateTables, seg: np.ndarray, starts: np.ndarray, n: int, bandwidth: float,
              inside: int, memory: float | None, straight: bool, *,
              bounds: np.ndarray | None = None, tie_counts: tuple[int, ...] | None = None,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One level of the original recurrence for every start in `starts`.

    Returns val[a, j, m] (best time of (a, j] on m units, INF if none), and the choice
    k[a, j, m] (-1: one stage on all m units) and r[a, j, m] (replicas of the last stage).
    `bounds` (unit_bounds): the level's members grouped into n units (unit u holds members
    bounds[u] to bounds[u + 1]); None: one member per unit. A stage on the units after the
    first m - r of m holds bounds[m] - bounds[m - r] members, so the arithmetic is the
    original's with those replica counts (the same floats where every unit is one member).
    `tie_counts`: stages splitting tie t only on tie_counts[t] members (`pipedream_dp`).
    """
    s = len(tables.compute)
    last = s - 1
    na = len(starts)
    ruled = tie_counts is not None and tables.tie_bytes.size > 0
    counts = np.array(tie_counts if ruled else (), dtype=np.int64)  # [t]
    total = tables.tie_readers[:, last] if ruled else np.zeros(0)  # [t] readers of each tie

    def splits(ks: np.ndarray, j: int) -> np.ndarray:
        """[t, k] True where the stage (k, j] holds some of tie t's readers but not all."""
        held = tables.tie_readers[:, j][:, None] - tables.tie_readers[:, ks]
        return (held > 0.5) & (held < total[:, None] - 0.5)

    def off_rule(ks: np.ndarray, j: int, members: np.ndarray) -> np.ndarray:
        """[k, p] True where the stage (k, j] on `members` [p] workers breaks the tie rule."""
        if not ruled:
            return np.zeros((ks.size, members.size), dtype=bool)
        wrong = counts[:, None] != members[None, :]  # [t, p]
        return (splits(ks, j).T.astype(np.int64) @ wrong.astype(np.int64)) > 0
    if bounds is None:
        bounds = np.arange(n + 1)
    everyone = int(bounds[n])  # the level's members
    val = np.full((na, s, n + 1), INF)
    kk = np.full((na, s, n + 1), -1, dtype=np.int64)
    rr = np.zeros((na, s, n + 1), dtype=np.int64)
    mem_limit = INF if memory is None else memory
    ms = np.arange(1, n + 1)
    # base case: one stage (a, j] on m units (bounds[m] members)
    for i, a in enumerate(starts):
        t = seg[a]  # [j]
        p = tables.params - tables.params[a]
        act = tables.act - tables.act[a]
        for m in (ms if not straight else ms[:1]):
            w = int(bounds[m])
            stash = math.ceil((everyone - w) / w) * (act + p)
            base = (t + 4.0 * (w - 1) * p / (bandwidth * w) / inside) / w
            base = np.where(stash <= mem_limit, base, INF)
            if ruled:  # the stages (a, j] on w members, every j
                held = tables.tie_readers - tables.tie_readers[:, a:a + 1]  # [t, j]
                split = (held > 0.5) & (held < total[:, None] - 0.5)
                base = np.where((split & (counts[:, None] != w)).any(axis=0), INF, base)
            val[i, :, m] = base
    rmax = 1 if straight else n - 1
    pairs = [(m, r) for m in range(2, n + 1) for r in range(1, min(rmax, m - 1) + 1)]
    if not pairs:
        return val, kk, rr
    pm = np.array([m for m, _ in pairs])
    pr = np.array([r for _, r in pairs])
    replicas = bounds[pm] - bounds[pm - pr]  # [p] members of the last stage
    stash_factor = np.ceil((everyone - bounds[pm]) / replicas)  # [p]
    col = np.zeros((n + 1, n + 1), dtype=np.int64)  # (m, r) -> pair index
    col[pm, pr] = np.arange(pm.size)
    by_units = np.ascontiguousarray(val.transpose(0, 2, 1))  # [a, m, j], for gathers along j
    row_of = np.full(s, -1, dtype=np.int64)
    row_of[starts] = np.arange(na)
    for j in range(1, s):
        ks = np.nonzero(tables.valid[:, j])[0]
        ks = ks[ks > 0]
        if ks.size == 0:
            continue
        # rows whose start reaches j (others stay INF); val[a, k] is INF unless a reaches k
        if na == 1:
            rows = np.array([0])
        else:
            reaching = starts[tables.valid[starts, j]]
            if reaching.size == 0:
                continue
            rows = row_of[reaching]
        p = (tables.params[j] - tables.params[ks])[:, None]
        act = (tables.act[j] - tables.act[ks])[:, None]
        rep = replicas
        stage = (seg[ks, j][:, None] + 4.0 * (rep - 1) * p / (bandwidth * rep)) / rep  # [k, p]
        stage = np.maximum(stage, 2.0 * tables.frontier[ks][:, None] / (bandwidth * rep))
        if j < last:
            stage = np.maximum(stage, 2.0 * tables.frontier[j] / (bandwidth * rep))
        stage = np.where(stash_factor * (act + p) <= mem_limit, stage, INF)
        if ruled:
            stage = np.where(off_rule(ks, j, replicas), INF, stage)
        arg = np.empty((rows.size, pm.size), dtype=np.int64)  # [a, p]
        best_p = np.empty((rows.size, pm.size))
        step = max(1, CHUNK // (pm.size * ks.size))  # starts per batch (bounds memory)
        for lo in range(0, rows.size, step):
            some = rows[lo:lo + step]
            cand = by_units[np.ix_(some, pm - pr, ks)]  # [a, p, k] first part on m - r units
            np.maximum(cand, stage.T[None, :, :], out=cand)
            arg[lo:lo + step] = np.argmin(cand, axis=2)
            best_p[lo:lo + step] = np.take_along_axis(cand, arg[lo:lo + step, :, None],
                                                      axis=2)[:, :, 0]
        # per m: the first r with the smallest time, taken only if strictly better than the
        # single stage (the original's order: base case, then r ascending)
        padded = np.full((rows.size, n + 1, n + 1), INF)
        padded[:, pm, pr] = best_p
        r_best = np.argmin(padded, axis=2)  # [a, m]
        v_best = np.take_along_axis(padded, r_best[:, :, None], axis=2)[:, :, 0]
        k_best = ks[np.take_along_axis(arg, col[np.arange(n + 1)[None, :], r_best], axis=1)]
        current = val[rows, j, :]
        better = v_best < current
        val[rows, j, :] = np.where(better, v_best, current)
        by_units[rows, :, j] = val[rows, j, :]
        kk[rows, j, :] = np.where(better, k_best, kk[rows, j, :])
        rr[rows, j, :] = np.where(better, r_best, rr[rows, j, :])
    return val, kk, rr


CHUNK = 1 << 20  # candidates evaluated per numpy batch (bounds memory)
SMALL = 1 << 16  # elements per block of the level by class (cache-sized)


def _pd_level_all_starts(tables: StateTables, seg: np.ndarray, n: int, bandwidth: float,
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_pd_level` for every start at the innermost level, with the same tables, ties included.

    Why it is faster: it runs by (m units, r replicas of the last stage), m ascending, over all
    (start a, end j) at once, and only tries split states k whose compute could beat the best
    time known for (a, j): a pipeline on u units takes at least its compute over u, so k must
    satisfy compute(a, k) <= (m - r) * best and compute(k, j) <= r * best, a window of states
    sorted by cumulative compute. Candidates outside it are slower than the best known, so the
    minimum and its first (smallest) k are unchanged. Needs additive segments (seg = compute
    differences), hence the innermost level only, and neither a memory limit nor `straight`.
    """
    s = len(tables.compute)
    last = s - 1
    comp = tables.compute
    val = np.full((s, s, n + 1), INF)
    kk = np.full((s, s, n + 1), -1, dtype=np.int64)
    rr = np.zeros((s, s, n + 1), dtype=np.int64)
    for start in range(s):  # base case, as in _pd_level
        p = tables.params - tables.params[start]
        for m in range(1, n + 1):
            val[start, :, m] = (seg[start] + 4.0 * (m - 1) * p / (bandwidth * m)) / m
    rmax = n - 1
    by_comp = np.lexsort((np.arange(s), comp))  # states by cumulative compute, then index
    sorted_comp = comp[by_comp]
    valid = tables.valid.copy()
    valid[:, 0] = False  # a split is never the empty state
    cell_a, cell_j = np.nonzero(tables.valid)
    slack = 1.0 + 1e-9
    for m in range(2, n + 1):
        best = val[cell_a, cell_j, m].copy()  # the single stage, then improved by r
        best_k = np.full(cell_a.size, -1, dtype=np.int64)
        best_r = np.zeros(cell_a.size, dtype=np.int64)
        for r in range(1, min(rmax, m - 1) + 1):
            prev = val[:, :, m - r]
            bound = np.where(np.isfinite(best), best * slack, np.inf)
            lo = np.searchsorted(sorted_comp, comp[cell_j] - r * bound, side="left")
            hi = np.searchsorted(sorted_comp, comp[cell_a] + (m - r) * bound, side="right")
            hi = np.maximum(hi, lo)
            count = hi - lo
            r_val = np.full(cell_a.size, INF)
            r_k = np.full(cell_a.size, -1, dtype=np.int64)
            start = 0
            while start < cell_a.size:
                stop = start + 1 + int(np.searchsorted(np.cumsum(count[start:]), CHUNK))
                stop = min(stop, cell_a.size)
                cells = np.arange(start, stop)
                sizes = count[cells]
                total = int(sizes.sum())
                start = stop
                if total == 0:
                    continue
                owner = np.repeat(cells, sizes)
                offset = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)
                k = by_comp[lo[owner] + offset]
                a = cell_a[owner]
                j = cell_j[owner]
                keep = valid[a, k] & valid[k, j]
                owner, k, a, j = owner[keep], k[keep], a[keep], j[keep]
                if owner.size == 0:
                    continue
                p = tables.params[j] - tables.params[k]
                stage = (seg[k, j] + 4.0 * (r - 1) * p / (bandwidth * r)) / r
                stage = np.maximum(stage, 2.0 * tables.frontier[k] / (bandwidth * r))
                stage = np.where(j < last,
                                 np.maximum(stage, 2.0 * tables.frontier[j] / (bandwidth * r)),
                                 stage)
                cand = np.maximum(prev[a, k], stage)
                # per cell (owner runs are contiguous): the smallest candidate, and the
                # smallest k reaching it (np.argmin's first index over ascending k)
                heads = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
                mins = np.minimum.reduceat(cand, heads)
                hit = cand == np.repeat(mins, np.diff(np.r_[heads, owner.size]))
                first_k = np.minimum.reduceat(np.where(hit, k, s), heads)
                r_val[owner[heads]] = mins
                r_k[owner[heads]] = first_k
            better = r_val < best  # r ascending: a later r must be strictly better
            best = np.where(better, r_val, best)
            best_k = np.where(better, r_k, best_k)
            best_r = np.where(better, r, best_r)
        taken = best_r > 0
        val[cell_a, cell_j, m] = best
        kk[cell_a[taken], cell_j[taken], m] = best_k[taken]
        rr[cell_a[taken], cell_j[taken], m] = best_r[taken]
    return val, kk, rr


def _cost_classes(tables: StateTables) -> np.ndarray:
    """Class of every state: states with the same cumulative compute and params and the same
    frontier bytes (the first and the last state apart) give the same stage times in the
    memory-free level, as a split or as an end."""
    s = len(tables.compute)
    keys: dict[tuple[float, float, float, int], int] = {}
    out = np.empty(s, dtype=np.int64)
    for i in range(s):
        tag = 1 if i == 0 else 2 if i == s - 1 else 0
        key = (float(tables.compute[i]), float(tables.params[i]), float(tables.frontier[i]), tag)
        out[i] = keys.setdefault(key, len(keys))
    return out


def _class_stages(tables: StateTables, rep: np.ndarray, n: int, bandwidth: float) -> np.ndarray:
    """stage[r, c, e]: the last stage's time from a state of class c to one of class e on r
    replicas (r < n), with the same arithmetic as `_pd_level` (so the same floats)."""
    last = len(tables.compute) - 1
    comp = tables.compute[rep]
    par = tables.params[rep]
    front = tables.frontier[rep]
    seg = comp[None, :] - comp[:, None]  # [c, e], as pipedream_dp's seg
    p = par[None, :] - par[:, None]
    out = np.full((n, rep.size, rep.size), INF)
    for r in range(1, n):
        stage = (seg + 4.0 * (r - 1) * p / (bandwidth * r)) / r
        stage = np.maximum(stage, (2.0 * front / (bandwidth * r))[:, None])
        out[r] = np.where((rep < last)[None, :],
                          np.maximum(stage, (2.0 * front / (bandwidth * r))[None, :]), stage)
    return out


def _pd_level_by_class(tables: StateTables, seg: np.ndarray, n: int, bandwidth: float,
                       ) -> np.ndarray:
    """The value table val[a, j, m] of `_pd_level` for every start at the innermost level,
    memory-free and not straight (additive segments), computed per cost class of the split.

    A split state k enters (a, j] only through val[a, k, m - r] and the last stage's time, which
    depends on the classes of k and j alone (`_cost_classes`). Per start a, split class c and
    end class e, t[a, e, c] = min over r of max(smallest val[a, ., m - r] over class c,
    stage(c, e, r)) is a lower bound on the candidates through class c, attained when some state
    of class c lies between a and j (reached from a, reaching j) and the class's finite values
    from a are all equal ("even": then that state has the smallest value). So a cell (a, j)
    takes the best class among those between a and j; if that class is uneven, the cell is
    evaluated over all its splits. The table is the same as `_pd_level`'s (the same floats:
    each value is one of its candidates); the splits come from `_pd_level_split`.
    """
    s = len(tables.compute)
    valid = tables.valid
    cls = _cost_classes(tables)
    n_cls = int(cls.max()) + 1
    order = np.argsort(cls, kind="stable")
    heads = np.searchsorted(cls[order], np.arange(n_cls))
    rep = order[heads]  # the first state of each class
    stages_t = _class_stages(tables, rep, n, bandwidth).transpose(0, 2, 1).copy()  # [r, e, c]
    reach = np.isfinite(seg)  # [a, k]: val[a, k, .] is finite
    planes = np.empty((n + 1, s, s))  # planes[m] = val[:, :, m]
    planes[0] = INF
    p_all = tables.params[None, :] - tables.params[:, None]
    for m in range(1, n + 1):  # base case: _pd_level's arithmetic, in place
        here = planes[m]
        np.multiply(4.0 * (m - 1), p_all, out=here)
        np.divide(here, bandwidth * m, out=here)
        np.add(seg, here, out=here)
        np.divide(here, m, out=here)
    del p_all
    cells_a, cells_j = np.nonzero(valid[:, 1:])  # the cells the recurrence updates
    cells_j = cells_j + 1
    ends = cls[cells_j]
    between = _Between(reach, valid, order, heads)
    low = np.full((n + 1, s, n_cls), INF)  # smallest val[a, k, m] over the k of class c
    even = np.ones((s, n_cls), dtype=bool)  # ... its finite values equal, for every m so far
    unreached = ~reach[:, order]
    rows = max(1, SMALL // s)
    by_cls = np.empty((min(rows, s), s))
    block = max(1, SMALL // (n_cls * n_cls))  # small blocks: they stay in cache
    t = np.empty((min(block, s), n_cls, n_cls))
    t_r = np.empty_like(t)
    for m in range(2, n + 1):
        prev = m - 1
        for lo in range(0, s, rows):
            hi = min(s, lo + rows)
            part = by_cls[:hi - lo]
            np.take(planes[prev][lo:hi], order, axis=1, out=part)
            low[prev, lo:hi] = np.minimum.reduceat(part, heads, axis=1)
            part[unreached[lo:hi]] = -INF  # the finite values' largest
            high = np.maximum.reduceat(part, heads, axis=1)
            even[lo:hi] &= (low[prev, lo:hi] == high) | (high == -INF)
        low[prev][:, cls[0]] = INF  # the empty state is never a split
        best = np.empty((s, n_cls))
        arg = np.empty((s, n_cls), dtype=np.int64)
        for lo in range(0, s, block):  # t[a, e, c], minimised over c
            hi = min(s, lo + block)
            here, here_r = t[:hi - lo], t_r[:hi - lo]
            np.maximum(low[m - 1][lo:hi, None, :], stages_t[1][None], out=here)
            for r in range(2, m):
                np.maximum(low[m - r][lo:hi, None, :], stages_t[r][None], out=here_r)
                np.minimum(here, here_r, out=here)
            arg[lo:hi] = np.argmin(here, axis=2)
            best[lo:hi] = np.take_along_axis(here, arg[lo:hi, :, None], axis=2)[:, :, 0]
        value = best[cells_a, ends]
        c = arg[cells_a, ends]
        finite = np.flatnonzero(np.isfinite(value))
        rest = finite[~between.one(cells_a[finite], cells_j[finite], c[finite])]
        step = max(1, CHUNK // (n_cls + between.from_a.shape[1]))
        for lo in range(0, rest.size, step):  # the best class is not between: the best between
            part = rest[lo:lo + step]
            a_r, e_r = cells_a[part], ends[part]
            tc = np.maximum(low[m - 1][a_r], stages_t[1][e_r])
            for r in range(2, m):
                np.minimum(tc, np.maximum(low[m - r][a_r], stages_t[r][e_r]), out=tc)
            tc[~between.all(a_r, cells_j[part])] = INF
            c[part] = np.argmin(tc, axis=1)
            value[part] = tc[np.arange(part.size), c[part]]
        odd = np.flatnonzero(np.isfinite(value) & ~even[cells_a, c])
        if odd.size:  # the best class between has unequal values from a: every split
            value[odd] = _pd_cells(planes, cls, stages_t, valid, cells_a[odd], cells_j[odd], m)
        base = planes[m][cells_a, cells_j]
        planes[m][cells_a, cells_j] = np.where(value < base, value, base)
    return planes.transpose(1, 2, 0)


class _Between:
    """Is some state k of class c reached from a (reach[a, k]) and reaching j (valid[k, j])?
    Bitsets over the members of each class (states `order`, classes starting at `heads`), in
    64-bit words: one AND per word."""

    def __init__(self, reach: np.ndarray, valid: np.ndarray, order: np.ndarray,
                 heads: np.ndarray) -> None:
        s = reach.shape[0]
        sizes = np.diff(np.r_[heads, s])
        self.words = (sizes + 63) // 64  # per class
        self.first_word = np.cumsum(self.words) - self.words
        n_words = int(self.words.sum())
        word_class = np.repeat(np.arange(heads.size), self.words)
        member = (heads[word_class] + 64 * (np.arange(n_words) - self.first_word[word_class]))
        member = member[:, None] + np.arange(64)[None, :]  # [word, bit] -> position in `order`
        present = member < (heads + sizes)[word_class][:, None]
        state = order[np.minimum(member, s - 1)]

        def pack(rows: np.ndarray) -> np.ndarray:  # rows[x, k] -> bits[x, word]
            bits = rows[:, state] & present[None]  # [x, word, 64]
            return np.packbits(bits, axis=2, bitorder="little").view(np.uint64)[:, :, 0].copy()

        self.from_a = pack(reach)  # [a, word]
        self.to_j = pack(valid.T)  # [j, word]

    def one(self, a: np.ndarray, j: np.ndarray, c: np.ndarray) -> np.ndarray:
        """[cell]: class c[cell] between a[cell] and j[cell]."""
        out = np.zeros(a.size, dtype=bool)
        for o in range(int(self.words[c].max(initial=0))):
            on = np.flatnonzero(o < self.words[c])
            w = self.first_word[c[on]] + o
            out[on] |= (self.from_a[a[on], w] & self.to_j[j[on], w]) != 0
        return out

    def all(self, a: np.ndarray, j: np.ndarray) -> np.ndarray:
        """[cell, c]: every class."""
        hit = (self.from_a[a] & self.to_j[j]) != 0
        return np.logical_or.reduceat(hit, self.first_word, axis=1)


def _pd_cells(planes: np.ndarray, cls: np.ndarray, stages_t: np.ndarray, valid: np.ndarray,
              cell_a: np.ndarray, cell_j: np.ndarray, m: int) -> np.ndarray:
    """min over r < m and splits k > 0 of max(val[a, k, m - r], stage(k, j, r)) per cell
    (planes[m'] = val[:, :, m'], stages_t[r, e, c] the last stage's time)."""
    out = np.full(cell_a.size, INF)
    step = max(1, CHUNK // valid.shape[0])
    for start in range(0, cell_a.size, step):
        cells = np.arange(start, min(cell_a.size, start + step))
        sub = valid[1:, cell_j[cells]].T  # [cell, k - 1]
        owner, k = np.nonzero(sub)  # owner ascending, then k ascending
        if owner.size == 0:
            continue
        k = k + 1
        a = cell_a[cells][owner]
        e = cls[cell_j[cells]][owner]
        cand = np.full(owner.size, INF)
        for r in range(1, m):
            np.minimum(cand, np.maximum(planes[m - r][a, k], stages_t[r][e, cls[k]]), out=cand)
        heads = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        out[cells[owner[heads]]] = np.minimum.reduceat(cand, heads)
    return out


def _pd_level_split(tables: StateTables, seg: np.ndarray, val: np.ndarray, n: int,
                    bandwidth: float, a: int, j: int, m: int) -> tuple[int, int]:
    """The split (k, r) that `_pd_level` records for (a, j] on m units of the memory-free level
    over every start, from its value table: the first r, then the first k, of the smallest
    candidate, if strictly better than the single stage; (-1, 0) otherwise."""
    if m < 2 or not tables.valid[a, j]:
        return -1, 0
    ks = np.nonzero(tables.valid[:, j])[0]
    ks = ks[ks > 0]
    if ks.size == 0:
        return -1, 0
    last = len(tables.compute) - 1
    p = tables.params[j] - tables.params[ks]
    best_v, best_k, best_r = INF, -1, 0
    for r in range(1, min(n - 1, m - 1) + 1):
        stage = (seg[ks, j] + 4.0 * (r - 1) * p / (bandwidth * r)) / r
        stage = np.maximum(stage, 2.0 * tables.frontier[ks] / (bandwidth * r))
        if j < last:
            stage = np.maximum(stage, 2.0 * tables.frontier[j] / (bandwidth * r))
        cand = np.maximum(val[a, ks, m - r], stage)
        i = int(np.argmin(cand))
        if cand[i] < best_v:
            best_v, best_k, best_r = float(cand[i]), int(ks[i]), r
    p_a = tables.params[j] - tables.params[a]
    base = (seg[a, j] + 4.0 * (m - 1) * p_a / (bandwidth * m) / 1) / m
    return (best_k, best_r) if best_v < base else (-1, 0)
