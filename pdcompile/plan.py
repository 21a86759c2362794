"""The Plan: the partitioner's decision as data (stages, replicas, ranks, predicted times)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from pdcompile.errors import PlanError
from pdcompile.schedule.ir import replica_of
from pdcompile.schedule.kinds import KINDS, unknown
from pdcompile.units import format_bytes, format_seconds

PLAN_FORMAT = "pdcompile.plan/1"
DERIVED = ("format", "config", "speedup_over_dp")  # written for readers, not read back


def _is_count(value: Any) -> bool:
    """An int that is not a bool (JSON's true is no rank, 1.0 and "1" none either)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _stage_dict(stage: Stage) -> dict[str, Any]:
    """A stage as plain data; `shares` only where the replicas take unequal turns."""
    data = asdict(stage) | {"nodes": list(stage.nodes), "ranks": list(stage.ranks),
                            "shares": list(stage.shares)}
    if not stage.shares:
        del data["shares"]
    return data


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its graph nodes, on `replicas` workers (`ranks`), with predicted costs.

    Times are seconds per minibatch as seen by the pipeline (a stage with r replicas handles one
    minibatch in r of them, so `compute` is the stage's fwd+bwd divided by r); `copies` is the
    time the stage's own CPU spends copying what it sends over loopback links (`Level.cpu_copies`),
    which it cannot overlap with compute; `memory` is bytes per worker. `in_flight`: microbatches
    (minibatches under '1f1b') each replica keeps in flight, i.e. its warm-up depth + 1, as the
    planner chose it within the memory; 0: the schedule's default (PipeDream's NOAM).
    `recompute`: the stage drops its activations after each forward and recomputes them in the
    backward (less memory, one more forward per microbatch; see pdcompile.cost.recompute).
    `shares`: how many microbatches (minibatches under '1f1b') of each round every replica
    takes, a faster replica more (`Schedule.shares`, planner/shares.py); (): one each, round
    robin.
    """

    nodes: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]
    compute: float = 0.0
    sync: float = 0.0
    comm: float = 0.0
    memory: float = 0.0
    time: float = 0.0
    copies: float = 0.0
    in_flight: int = 0
    recompute: bool = False
    shares: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_count(self.replicas) or self.replicas < 1:
            raise PlanError(f"a stage's replicas must be a positive integer (got "
                            f"{self.replicas!r})")
        # a set of types, not a test per rank: a stage of 100,000 replicas is built often
        if self.ranks and ({type(r) for r in self.ranks} != {int} or min(self.ranks) < 0):
            raise PlanError(f"a stage's ranks must be integers from 0 (got {list(self.ranks)!r})")
        if len(self.ranks) != self.replicas:
            raise PlanError(f"a stage with {self.replicas} replicas needs as many ranks, got "
                            f"ranks {list(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise PlanError(f"a stage's ranks must differ, each replica on its own worker (got "
                            f"ranks {list(self.ranks)})")
        if self.shares and (len(self.shares) != len(self.ranks) or not all(
                _is_count(n) and n >= 1 for n in self.shares)):
            raise PlanError(f"a stage's shares give each of its {len(self.ranks)} replicas a "
                            f"positive count of microbatches per round (got {list(self.shares)})")
        if not _is_count(self.in_flight) or self.in_flight < 0:
            raise PlanError(f"a stage keeps a positive number of minibatches in flight, or 0 for "
                            f"its schedule's default (got in_flight {self.in_flight!r})")
        if not isinstance(self.recompute, bool):
            raise PlanError(f"a stage's recompute must be true or false (got "
                            f"{self.recompute!r})")

    @property
    def round_size(self) -> int:
        """Microbatches per round of the replicas: the sum of the shares, or the replicas."""
        return sum(self.shares) if self.shares else self.replicas

    def rank_of(self, microbatch: int) -> int:
        """The rank (replica) that takes `microbatch` (`Schedule.rank_of`)."""
        if not self.shares:
            return self.ranks[microbatch % self.replicas]
        return self.ranks[replica_of(self.shares, microbatch)]

    def share_counts(self) -> tuple[int, ...]:
        """The shares, one per replica (ones under round robin)."""
        return self.shares or (1,) * self.replicas


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order plus what the planner predicted and how it got there.

    `schedule` and `microbatches` are the schedule the plan was priced for (the planner may
    choose them: `schedule="auto"`); `time_per_minibatch` is the predicted time per minibatch
    under it, `dp_time` that of plain data parallelism on the same workers.
    """

    stages: tuple[Stage, ...]
    time_per_minibatch: float
    dp_time: float
    workers: int
    cost_model: str = "native"
    planner: str = "dp"
    status: str = "OPTIMAL"
    bound: float | None = None
    solve_seconds: float = 0.0
    cluster: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schedule: str = "1f1b"
    microbatches: int = 1

    def __post_init__(self) -> None:
        if not _is_count(self.microbatches) or self.microbatches < 1:
            raise PlanError(f"a plan's microbatches must be a positive integer (got "
                            f"{self.microbatches!r})")
        if self.schedule not in KINDS:
            raise PlanError(f"a plan's schedule: {unknown(self.schedule)}")
        if not self.stages:
            raise PlanError("a plan needs at least one stage (its stages are empty)")
        if not all(isinstance(s, Stage) for s in self.stages):
            raise PlanError(f"a plan's stages must be Stage objects (got "
                            f"{sorted({type(s).__name__ for s in self.stages})})")
        seen: dict[str, int] = {}
        for index, stage in enumerate(self.stages):
            for node in stage.nodes:
                if node in seen:
                    raise PlanError(f"node {node!r} is in the nodes of stages {seen[node]} and "
                                    f"{index}; each node belongs to one stage")
                seen[node] = index
        ranks = [r for stage in self.stages for r in stage.ranks]
        held = Counter(ranks)  # not ranks.count per rank: quadratic, minutes at 100,000 ranks
        self._check_workers(held)
        shared = sorted(r for r, times in held.items() if times > 1)
        replicated = [i for i, s in enumerate(self.stages)
                      if s.replicas > 1 and set(s.ranks) & set(shared)]
        if replicated:  # several chunks per rank (interleaved) only for unreplicated stages
            raise PlanError(f"a rank serves two stages: {ranks}; a rank may hold several "
                            f"stages (chunks of an interleaved pipeline) only when none of "
                            f"them is replicated (stages {replicated} are)")

    def _check_workers(self, held: Counter[int]) -> None:
        """Every rank of the stages is one of the plan's `workers` (ranks 0 to workers - 1; a
        rank may hold no stage: the mixed planner leaves a slow device out)."""
        if not _is_count(self.workers) or self.workers < 1:
            raise PlanError(f"a plan's workers must be a positive integer (got "
                            f"{self.workers!r})")
        beyond = max(held)
        if beyond >= self.workers:
            where = next(i for i, s in enumerate(self.stages) if beyond in s.ranks)
            raise PlanError(f"stage {where}'s ranks use rank {beyond}, but the plan has workers "
                            f"{self.workers} (ranks 0 to {self.workers - 1}); give workers "
                            f"{beyond + 1} or renumber the ranks")

    # ----------------------------------------------------------------------------- views
    def shares(self) -> list[list[int]] | None:
        """Per stage the replicas' shares of each round, or None where all take turns."""
        if not any(s.shares for s in self.stages):
            return None
        return [list(s.share_counts()) for s in self.stages]

    @property
    def config(self) -> str:
        """PipeDream's notation: "15-1" (replicas per stage), "straight", or "16" (data
        parallel)."""
        replicas = [s.replicas for s in self.stages]
        if len(replicas) > 1 and all(r == 1 for r in replicas):
            return "straight"
        return "-".join(str(r) for r in replicas)

    @property
    def speedup_over_dp(self) -> float:
        """Predicted data-parallel time per minibatch over ours, on the same cluster and model."""
        if self.time_per_minibatch <= 0:
            return float("inf")
        return self.dp_time / self.time_per_minibatch

    def versus_data_parallel(self) -> str:
        """The speed-up over data parallelism as a reader should see it: none where plain data
        parallelism does not fit the memory (there is nothing to compare with)."""
        if self.extra.get("dp_fits") is False:
            return (f"plain data parallelism does not fit the memory "
                    f"(it would take {format_seconds(self.dp_time)} per minibatch)")
        return f"{self.speedup_over_dp:.2f}x over data parallel ({format_seconds(self.dp_time)})"

    @property
    def gap(self) -> float | None:
        """Relative gap between the plan's time and the solver's lower bound (None if no bound)."""
        if self.bound is None or self.time_per_minibatch <= 0:
            return None
        return max(0.0, (self.time_per_minibatch - self.bound) / self.time_per_minibatch)

    def warmup(self) -> list[int] | None:
        """Warm-up depth per stage (in flight - 1) when the planner chose them, else None (the
        schedule's default)."""
        if not any(s.in_flight for s in self.stages):
            return None
        return [max(0, s.in_flight - 1) for s in self.stages]

    def stage_of(self) -> dict[str, int]:
        """Map node name -> stage index."""
        return {node: i for i, stage in enumerate(self.stages) for node in stage.nodes}

    def rank_to_stage(self) -> dict[int, int]:
        """Map rank -> stage index."""
        return {rank: i for i, stage in enumerate(self.stages) for rank in stage.ranks}

    def expanded(self, mapping: dict[str, list[str]]) -> Plan:
        """The same plan with fused blocks replaced by their member nodes (see
        costgraph.coarsen)."""
        stages = tuple(
            replace(s, nodes=tuple(m for node in s.nodes for m in mapping.get(node, [node])))
            for s in self.stages
        )
        return replace(self, stages=stages)

    # ----------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain data; `config` and `speedup_over_dp` included for readers of the file."""
        data = asdict(self)
        data["stages"] = [_stage_dict(s) for s in self.stages]
        return {"format": PLAN_FORMAT, **data, "config": self.config,
                "speedup_over_dp": self.speedup_over_dp}

    def to_json(self, indent: int | None = 1) -> str:
        """JSON text; `Plan.from_json(plan.to_json()) == plan`."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of `to_dict`; data of another shape raises PlanError naming the field that
        is wrong (every field's type is checked here, so that a bad one stops at load, not deep
        in a run)."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanError(f"not a plan (format {found!r}, want {PLAN_FORMAT!r})")
        given = _checked_fields(data, cls, "the plan", ignored=DERIVED)
        stages = given["stages"]
        if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
            raise PlanError(f"the plan's stages must be a list of objects (got "
                            f"{_shown(stages)})")
        built = []
        for index, stage in enumerate(stages):
            where = f"stage {index} (stages[{index}])"
            checked = _checked_fields(stage, Stage, where)
            try:
                built.append(Stage(**checked | {
                    "nodes": tuple(checked["nodes"]), "ranks": tuple(checked["ranks"]),
                    "shares": tuple(checked.get("shares", ()))}))
            except PlanError as err:
                raise PlanError(f"{where}: {err}") from None
        return cls(**given | {"stages": tuple(built)})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of `to_json`."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as err:  # RecursionError: nested past json's depth
            raise PlanError(f"plan JSON is malformed: {err}") from None
        return cls.from_dict(data)

    # ----------------------------------------------------------------------------- report
    def summary(self) -> str:
        """A readable table: one row per stage, then the predicted totals."""
        header = (f"{'stage':>5} {'nodes':>6} {'first .. last':<34} {'replicas':>8} {'ranks':<12} "
                  f"{'compute':>10} {'sync':>10} {'comm':>10} {'time':>10} {'memory':>10}")
        lines = [header, "-" * len(header)]
        for i, s in enumerate(self.stages):
            span = f"{s.nodes[0]} .. {s.nodes[-1]}" if s.nodes else "-"
            ranks = ",".join(str(r) for r in s.ranks)
            lines.append(
                f"{i:>5} {len(s.nodes):>6} {span[:34]:<34} {s.replicas:>8} {ranks[:12]:<12} "
                f"{format_seconds(s.compute):>10} {format_seconds(s.sync):>10} "
                f"{format_seconds(s.comm):>10} {format_seconds(s.time):>10} "
                f"{format_bytes(s.memory):>10}"
            )
        status = self.status + (f", gap {self.gap:.1%}" if self.gap is not None else "")
        lines.append("")
        lines.append(
            f"config {self.config} on {self.workers} workers, {self.schedule_text()}; predicted "
            f"{format_seconds(self.time_per_minibatch)} per minibatch, "
            f"{self.versus_data_parallel()}; planner {self.planner} ({status}, "
            f"{self.solve_seconds:.2f} s), cost model {self.cost_model}"
        )
        shared = [f"stage {i} {'/'.join(map(str, s.shares))}" for i, s in enumerate(self.stages)
                  if s.shares]
        if shared:
            lines.append("replicas take shares of each round by speed (ranks in order): "
                         + ", ".join(shared))
        idle = self.extra.get("idle_workers")
        if isinstance(idle, str):  # the planner left workers idle: how many, and why
            lines.append(idle)
        why = self.prediction_text()
        if why:
            lines.append(why)
        return "\n".join(lines)

    def schedule_text(self) -> str:
        """"1f1b" or "1f1b-flush x8 microbatches", with the planner's in-flight counts."""
        text = self.schedule
        if self.microbatches > 1:
            text += f" x{self.microbatches} microbatches"
        if any(s.in_flight for s in self.stages):
            text += " (in flight per stage " + "/".join(str(s.in_flight) for s in self.stages) \
                + ")"
        return text

    def prediction_text(self) -> str:
        """Where the predicted time comes from, in one line ("" for a plan not priced)."""
        closed = self.extra.get("closed_form_time_per_minibatch")
        simulated = self.extra.get("simulated_time_per_minibatch")
        if closed is None:
            return ""
        if simulated is not None:
            return (f"prediction: the simulator's steady state of this plan; the closed form the "
                    f"planner ranks with says {format_seconds(closed)} "
                    f"(bound: {self.extra.get('bound', '?')})")
        return (f"prediction: the planner's closed form (bound: {self.extra.get('bound', '?')}); "
                "too large to simulate cheaply")


# What each field of a plan file holds: (test, words for the message). Numbers are
# non-negative and not NaN (a time may be infinite: a plan that does not fit).
def _number(value: Any) -> bool:
    return _is_number(value) and not math.isnan(value) and value >= 0


def _count_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_count(v) for v in value)


_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "nodes": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
              "a list of node names"),
    "replicas": (_is_count, "an integer"),
    "ranks": (_count_list, "a list of integers"),
    "shares": (_count_list, "a list of integers"),
    "in_flight": (_is_count, "an integer"),
    "recompute": (lambda v: isinstance(v, bool), "true or false"),
    "stages": (lambda v: isinstance(v, list), "a list of stages"),
    "workers": (_is_count, "an integer"),
    "microbatches": (_is_count, "an integer"),
    "cost_model": (lambda v: isinstance(v, str), "a string"),
    "planner": (lambda v: isinstance(v, str), "a string"),
    "status": (lambda v: isinstance(v, str), "a string"),
    "schedule": (lambda v: isinstance(v, str), "a schedule name"),
    "bound": (lambda v: v is None or _number(v), "null or a number >= 0"),
    "cluster": (lambda v: v is None or isinstance(v, dict), "null or a cluster object"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
}
# the keys of `extra` that pdcompile reads back (the rest is free-form)
_EXTRA_TYPES: dict[str, tuple[Any, str]] = {
    "closed_form_time_per_minibatch": (lambda v: v is None or _number(v), "a number >= 0"),
    "simulated_time_per_minibatch": (lambda v: v is None or _number(v), "a number >= 0"),
    "dp_fits": (lambda v: isinstance(v, bool), "true or false"),
    "fits": (lambda v: isinstance(v, bool), "true or false"),
}


def _shown(value: Any) -> str:
    """A value for a message, cut short."""
    text = json.dumps(value) if not isinstance(value, tuple) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_fields(data: dict[str, Any], cls: type, where: str,
                    ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """`data`'s fields of dataclass `cls`, each of its type; a missing required field, an
    unknown one or one of another type raises PlanError naming it."""
    known = {f.name: f for f in fields(cls)}
    unknown_keys = [k for k in data if k not in known and k not in ignored]
    if unknown_keys:
        raise PlanError(f"{where} has the field {str(unknown_keys[0])!r}, which a plan does not "
                        f"have (its fields: {', '.join(known)})")
    missing = [name for name, f in known.items() if name not in data
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise PlanError(f"{where} lacks the field {missing[0]!r}")
    out = {k: v for k, v in data.items() if k in known}
    for name, value in out.items():
        test, words = _FIELD_TYPES.get(name, (_number, "a number >= 0"))
        if not test(value):
            raise PlanError(f"{where}'s {name} must be {words} (got {_shown(value)})")
    for name, (test, words) in _EXTRA_TYPES.items():
        if name in out.get("extra", {}) and not test(out["extra"][name]):
            raise PlanError(f"{where}'s extra.{name} must be {words} (got "
                            f"{_shown(out['extra'][name])})")
    return out
