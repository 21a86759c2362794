"""Timelines: what ran where and when, one `Event(rank, action, start, end)` per executed action.

The simulator writes them, and so do measured runs (local and distributed backends, through a
`Recorder` per rank), in one JSON format, so the same pictures and the same figures (time per
minibatch, bubble fraction; per stage, `stage_figures`) come out of both and can be compared.
Times are seconds; `action` is the schedule IR's text ("1F3", "0SEND_F3->1", "2STEP0").

File format (`Timeline.to_json`)::

    {"format": "pdcompile.timeline/1", "source": "simulated", "meta": {...},
     "events": [[rank, "1F3", start, end], ...]}
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcompile.errors import PdcompileError
from pdcompile.schedule.ir import Action, Kind, Schedule, parse_action
from pdcompile.schedule.kinds import KINDS
from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal
from pdcompile.util.manifest import MAX_JSON_BYTES

TIMELINE_FORMAT = "pdcompile.timeline/1"
COMPUTE_KINDS = (Kind.F, Kind.B, Kind.W)
MAX_TIMELINE_BYTES = MAX_JSON_BYTES
"""The largest timeline file read (256 MiB, as any JSON file pdcompile reads whole): at the 57
bytes an event takes (a simulated run of vgg16 on 16 workers: 1,155 events in 65,514 bytes),
some 4.7 million events. A FIFO named as one blocked the reader forever, a sparse file of
gigabytes filled memory."""
_EVENT_BYTES = 57


class TimelineError(PdcompileError, ValueError):
    """A timeline file or event that cannot be read."""


@dataclass(frozen=True, slots=True)
class Event:
    """One action on one rank, from `start` to `end` (seconds)."""

    rank: int
    action: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        """Seconds the action took (for a receive: the time spent waiting for the data)."""
        return self.end - self.start

    def parsed(self) -> Action:
        """The IR action this event ran."""
        return parse_action(self.action)


@dataclass
class Timeline:
    """Events of all ranks plus where they came from (`source`) and facts about the run (`meta`).

    `meta` keys read by the figures: "schedule" (its name), "microbatches_per_minibatch",
    "minibatches" (minibatches the run covers; flush schedules).
    """

    events: list[Event]
    source: str = "simulated"
    meta: dict[str, Any] = field(default_factory=dict)
    _compute: tuple[int, list[tuple[Event, Action]]] | None = field(
        default=None, init=False, repr=False, compare=False)

    @classmethod
    def with_compute(cls, events: list[Event], compute: list[tuple[Event, Action]],
                     source: str = "simulated", meta: dict[str, Any] | None = None) -> Timeline:
        """A timeline whose compute events (the F/B/W ones, with their parsed actions) are
        already known, so they are not parsed again from text (the simulator's fast path)."""
        line = cls(events, source, dict(meta or {}))
        line._compute = (len(events), list(compute))
        return line

    # ------------------------------------------------------------------------- views
    @property
    def ranks(self) -> list[int]:
        """Ranks that have events, sorted."""
        return sorted({e.rank for e in self.events})

    def by_rank(self) -> dict[int, list[Event]]:
        """Each rank's events in start order."""
        out: dict[int, list[Event]] = {}
        for event in sorted(self.events, key=lambda e: (e.rank, e.start)):
            out.setdefault(event.rank, []).append(event)
        return out

    @property
    def start(self) -> float:
        """Earliest start."""
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        """Latest end."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """From the first start to the last end."""
        return self.end - self.start

    def compute_events(self) -> list[tuple[Event, Action]]:
        """The F/B/W events with their parsed actions (cached while `events` keeps its length)."""
        if self._compute is not None and self._compute[0] == len(self.events):
            return self._compute[1]
        out = []
        for event in self.events:
            if "SEND" in event.action or "RECV" in event.action:
                continue
            action = parse_action(event.action)
            if action.kind in COMPUTE_KINDS:
                out.append((event, action))
        self._compute = (len(self.events), out)
        return out

    def check_schedule(self, schedule: Schedule) -> None:
        """Raise TimelineError unless every rank ran exactly its schedule's actions, in order.

        Events are ordered per rank by start time (ties keep recording order), so a measured
        run's timeline can be checked against the lowered schedule it executed.
        """
        runs = self.by_rank()
        for rank in sorted(set(schedule.actions) | set(runs)):
            want = [str(a) for a in schedule.actions.get(rank, ())]
            got = [e.action for e in runs.get(rank, [])]
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                          min(len(got), len(want)))
                raise TimelineError(
                    f"rank {rank}: the timeline has {len(got)} events, the schedule "
                    f"{len(want)} actions; first difference at step {at}: ran "
                    f"{got[at] if at < len(got) else 'nothing'}, schedule says "
                    f"{want[at] if at < len(want) else 'nothing'}")

    # ------------------------------------------------------------------------- figures
    def completions(self) -> list[float]:
        """When each microbatch left the pipeline: the end of its last backward (sorted)."""
        done: dict[int, float] = {}
        for event, action in self.compute_events():
            if action.kind == Kind.B:
                done[action.microbatch] = max(done.get(action.microbatch, 0.0), event.end)
        return sorted(done.values())

    def period(self) -> int:
        """Microbatches after which a round-robin schedule repeats: the least common multiple of
        the stages' replica counts (ranks running each stage's forwards; meta "round" where the
        replicas take unequal shares of rounds), times the microbatches per minibatch. 1 for a
        straight pipeline."""
        per = max(1, int(self.meta.get("microbatches_per_minibatch", 1)))
        if "round" in self.meta:
            return int(self.meta["round"]) * per
        ranks_of: dict[int, set[int]] = {}
        for event, action in self.compute_events():
            if action.kind == Kind.F:
                ranks_of.setdefault(action.stage, set()).add(event.rank)
        replicas = math.lcm(*(len(r) for r in ranks_of.values())) if ranks_of else 1
        return replicas * per

    def steady_window(self) -> tuple[float, float, int]:
        """(t0, t1, n): about the middle half of the microbatch completions and how many fell in
        it, spanning whole periods (`period`): replicated stages finish their minibatches in
        bursts, one per round, and a window cutting a burst would count part of a round.

        Warm-up and drain are outside the window. With fewer than 4 microbatches the whole run.
        """
        done = self.completions()
        if len(done) < 4:
            return self.start, self.end, max(1, len(done))
        lo, hi = len(done) // 4, (3 * len(done)) // 4
        period = self.period()
        if hi - lo >= period:
            hi = lo + (hi - lo) // period * period
        elif len(done) - 1 - lo >= period:  # a short run: one whole period from lo
            hi = lo + period
        if done[hi] <= done[lo]:
            return self.start, self.end, len(done)
        return done[lo], done[hi], hi - lo

    def time_per_minibatch(self) -> float:
        """Seconds per minibatch: steady state when streaming, else makespan / minibatches."""
        per_minibatch = int(self.meta.get("microbatches_per_minibatch", 1))
        row = KINDS.get(str(self.meta.get("schedule")))
        if row is not None and row.asynchronous:
            t0, t1, n = self.steady_window()
            return (t1 - t0) / n * per_minibatch
        return self.makespan / max(1, int(self.meta.get("minibatches", 1)))

    def bubble_fraction(self, window: tuple[float, float] | None = None) -> float:
        """Share of rank-time not spent in compute (F, B, W) over the run or `window`."""
        t0, t1 = window if window is not None else (self.start, self.end)
        ranks = self.ranks
        if t1 <= t0 or not ranks:
            return 0.0
        busy = sum(max(0.0, min(e.end, t1) - max(e.start, t0)) for e, _ in self.compute_events())
        return max(0.0, 1.0 - busy / (len(ranks) * (t1 - t0)))

    def steady_bubble_fraction(self) -> float:
        """Bubble fraction inside `steady_window` (0 for a full asynchronous pipeline)."""
        t0, t1, _ = self.steady_window()
        return self.bubble_fraction((t0, t1))

    # ------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain data (see module docstring)."""
        return {"format": TIMELINE_FORMAT, "source": self.source, "meta": self.meta,
                "events": [[e.rank, e.action, e.start, e.end] for e in self.events]}

    def to_json(self) -> str:
        """JSON text; `Timeline.from_json(t.to_json()) == t`."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """Inverse of `to_dict`."""
        if not isinstance(data, dict) or data.get("format") != TIMELINE_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise TimelineError(f"not a timeline (format {found!r}, want {TIMELINE_FORMAT!r})")
        events = []
        for i, item in enumerate(data.get("events", [])):
            try:
                rank, action, start, end = item
                events.append(Event(int(rank), str(action), float(start), float(end)))
            except (TypeError, ValueError):
                raise TimelineError(f"timeline event {i} is {item!r}; events are "
                                    "[rank, action, start, end]") from None
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise TimelineError(f"a timeline's meta is an object, not {type(meta).__name__}")
        return cls(events, str(data.get("source", "simulated")), dict(meta))

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """Inverse of `to_json`."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as err:  # RecursionError: nested past json's depth
            raise TimelineError(f"timeline JSON is malformed: {err}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write `to_json()` to a file."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        """Read a file written by `save`: a plain file of at most MAX_TIMELINE_BYTES, refused
        before a byte of it is read otherwise (a folder, a FIFO, a device, a larger file)."""
        try:
            text = read_plain_file(Path(path), MAX_TIMELINE_BYTES).decode()
        except NotPlainFile as why:
            raise TimelineError(refusal(
                why, path, role="timeline", limit=MAX_TIMELINE_BYTES,
                because=f"{MAX_TIMELINE_BYTES // _EVENT_BYTES / 1e6:.1f} million events take",
                fix="give the timeline.json a run recorded (`pdcompile run --timeline FILE`) "
                    "or `pdcompile simulate --out` wrote")) from None
        except (OSError, UnicodeDecodeError) as err:
            raise TimelineError(f"cannot read timeline {path}: {err}") from None
        try:
            return cls.from_json(text)
        except TimelineError as err:
            raise TimelineError(f"timeline {path}: {err}") from None

    @classmethod
    def merge(cls, parts: Iterable[Timeline], *, source: str | None = None) -> Timeline:
        """One timeline from per-rank ones (e.g. one per process), times shifted to start at 0.

        Clocks: when every part carries a clock reference for each of its ranks
        (`meta["clock_reference"]`, written by `Recorder.set_reference` just after a barrier
        that all ranks leave together), each rank's events are taken relative to its own
        reference, so processes whose clocks disagree (other machines) line up to within the
        barrier's skew. Otherwise all parts are assumed to read one clock (time.time on one
        machine). Either way the earliest start becomes 0.
        """
        parts = list(parts)
        references: dict[int, float] = {}
        aligned = bool(parts)
        for p in parts:
            refs = p.clock_references()
            if not refs or any(e.rank not in refs for e in p.events):
                aligned = False
            references.update(refs)
        shifted = [Event(e.rank, e.action, e.start - references[e.rank],
                         e.end - references[e.rank]) if aligned else e
                   for p in parts for e in p.events]
        t0 = min((e.start for e in shifted), default=0.0)
        meta: dict[str, Any] = {}
        for p in parts:
            meta.update({k: v for k, v in p.meta.items() if k != "clock_reference"})
        meta["clock"] = "barrier" if aligned else "shared"
        return cls([Event(e.rank, e.action, e.start - t0, e.end - t0) for e in shifted],
                   source or (parts[0].source if parts else "measured"), meta)

    def clock_references(self) -> dict[int, float]:
        """Rank -> the clock reading its `Recorder.set_reference` took (empty if none)."""
        raw = self.meta.get("clock_reference") or {}
        try:
            return {int(rank): float(t) for rank, t in dict(raw).items()}
        except (TypeError, ValueError):
            raise TimelineError(f"timeline meta clock_reference is {raw!r}; want "
                                "{rank: seconds}") from None

    def stage_of_ranks(self) -> dict[int, int]:
        """Rank -> the stage its compute events belong to (ranks without compute left out)."""
        return {event.rank: action.stage for event, action in self.compute_events()}


class Recorder:
    """Records the actions one rank really runs: `with recorder.record("1F3"): ...`.

    `clock` defaults to `time.time` (comparable across processes on one machine); times are
    stored as read. Across machines, call `set_reference()` on every rank right after a common
    barrier: `Timeline.merge` then aligns each rank's events to its own reference.
    """

    def __init__(self, rank: int, *, clock: Callable[[], float] = time.time) -> None:
        self.rank = rank
        self.clock = clock
        self.events: list[Event] = []
        self.reference: float | None = None

    def set_reference(self, at: float | None = None) -> float:
        """Take this rank's clock reading now (or `at`) as the common time origin; returns it."""
        self.reference = self.clock() if at is None else float(at)
        return self.reference

    @contextmanager
    def record(self, action: str | Action) -> Iterator[None]:
        """Time the block as one event."""
        start = self.clock()
        try:
            yield
        finally:
            self.events.append(Event(self.rank, str(action), start, self.clock()))

    def add(self, action: str | Action, start: float, end: float) -> None:
        """Add an event timed elsewhere."""
        self.events.append(Event(self.rank, str(action), start, end))

    def timeline(self, **meta: Any) -> Timeline:
        """This rank's events as a measured Timeline (with its clock reference, if set)."""
        data = dict(meta)
        if self.reference is not None:
            data["clock_reference"] = {str(self.rank): self.reference}
        return Timeline(list(self.events), "measured", data)


def stage_figures(timeline: Timeline) -> dict[int, dict[str, float]]:
    """Per stage, from the events that start in the steady window (means over the stage's
    workers and its microbatches there; a stage none of whose forwards, backwards or steps
    starts there, as in short runs, gets the mean of all of that kind):

    - "fwd", "bwd": seconds per forward / backward of one microbatch;
    - "step": seconds per optimizer step; "send": seconds per microbatch spent posting sends;
    - "wait": seconds per microbatch spent waiting in receives;
    - "busy": share of the steady window spent computing (F, B, W);
    - "unrecorded": share of the steady window inside no event at all (the generated loop's
      own work between actions: zero in a simulation).
    """
    stage_of = timeline.stage_of_ranks()
    t0, t1, _ = timeline.steady_window()
    total: dict[int, dict[str, float]] = {}
    count: dict[int, dict[str, int]] = {}
    inside: dict[int, dict[str, float]] = {}
    names = {Kind.F: "fwd", Kind.B: "bwd", Kind.STEP: "step"}
    # means over the actions that start in the steady window (warm-up outliers such as the
    # first call's allocations and connection set-up stay out), unless none does; a stage
    # whose actions of one kind all start outside it (short runs) gets the mean of all of them
    use_all = not any(t0 <= e.start < t1 for e in timeline.events)
    every: dict[int, dict[str, float]] = {}
    every_count: dict[int, dict[str, int]] = {}
    for event in timeline.events:
        stage = stage_of.get(event.rank)
        if stage is None:
            continue
        text = event.action
        if "RECV" in text:
            key = "wait"
        elif "SEND" in text:
            key = "send"
        else:
            kind = event.parsed().kind
            key = names.get(kind, "compute" if kind.is_compute else "other")
        every.setdefault(stage, {}).setdefault(key, 0.0)
        every[stage][key] += event.duration
        every_count.setdefault(stage, {}).setdefault(key, 0)
        every_count[stage][key] += 1
        if use_all or t0 <= event.start < t1:
            total.setdefault(stage, {}).setdefault(key, 0.0)
            total[stage][key] += event.duration
            count.setdefault(stage, {}).setdefault(key, 0)
            count[stage][key] += 1
        if t1 > t0:
            part = max(0.0, min(event.end, t1) - max(event.start, t0))
            where = "busy" if key in ("fwd", "bwd", "compute") else "recorded"
            inside.setdefault(stage, {}).setdefault(where, 0.0)
            inside[stage][where] += part
    workers: dict[int, int] = {}
    for stage in stage_of.values():
        workers[stage] = workers.get(stage, 0) + 1
    out: dict[int, dict[str, float]] = {}
    for stage in sorted(every):
        got, n = dict(total.get(stage, {})), dict(count.get(stage, {}))
        forwards = max(1, n.get("fwd", 0))  # sends and waits: per forward in the window
        for key in ("fwd", "bwd", "step"):
            if not n.get(key) and every_count[stage].get(key):
                got[key], n[key] = every[stage][key], every_count[stage][key]
        span = workers[stage] * (t1 - t0)
        busy = inside.get(stage, {}).get("busy", 0.0)
        recorded = busy + inside.get(stage, {}).get("recorded", 0.0)
        out[stage] = {
            "fwd": got.get("fwd", 0.0) / max(1, n.get("fwd", 0)),
            "bwd": got.get("bwd", 0.0) / max(1, n.get("bwd", 0)),
            "step": got.get("step", 0.0) / max(1, n.get("step", 0)),
            "send": got.get("send", 0.0) / forwards,
            "wait": got.get("wait", 0.0) / forwards,
            "busy": busy / span if span > 0 else 0.0,
            "unrecorded": max(0.0, 1.0 - recorded / span) if span > 0 else 0.0,
        }
    return out
