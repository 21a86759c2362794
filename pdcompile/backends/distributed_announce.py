"""The announcements of a distributed run: every rank learns each run before it starts.

Only the ranks that read data (`RunProgram.reads_data`) see the minibatches. The first of them
(stage 0's first rank) reads the next runs, cuts them into microbatches and broadcasts a header
for each: how many minibatches and samples, the microbatches of each minibatch, and the message
shapes of each microbatch (a table per shape first seen, so that minibatches may differ in shape)
with the target's layout where targets travel from stage 0 to the last stage. A reader's refusal
(bad data, too few minibatches to resume) travels in the header, so that it reaches every rank at
the same point, before the run it concerns, and none is left waiting.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pdcompile.backends.distributed_checkpoint import Resume
from pdcompile.backends.distributed_guard import guarded
from pdcompile.backends.launch import FaultMonitor
from pdcompile.backends.program import RunInput, RunProgram
from pdcompile.errors import AnnouncedInputError, PdcompileError, PipelineInputError
from pdcompile.runtime.stream_window import (
    resumed_stream,
    take_window,
    window_limit,
    window_rounds,
)
from pdcompile.runtime.transport import TensorSpec
from pdcompile.runtime.value_shapes import describe, signature

# runs (minibatches, under flush schedules) the first reader reads ahead and announces in one
# broadcast: fewer collectives between minibatches, at the price of that many prepared in memory
ANNOUNCE_AHEAD = 4
# message tables every rank keeps for shapes not in the run at hand: a stream whose every
# minibatch has a new shape (another sequence length) would otherwise add one per minibatch
SHAPE_TABLES_KEPT = 64

TargetLayout = tuple[str, list[TensorSpec]]
Header = dict[str, Any]


class Announcements:
    """The runs of one rank's training, in order: `next(index)` gives the next run's data (on
    readers) and its header (on every rank), and keeps its message tables in `tables`.

    `segment`: runs end on multiples of it (1: a run per minibatch, flush schedules; the
    checkpoint interval; None: windows only, runtime/stream_window.py); `ahead`: runs per
    broadcast; `routed`: the last stage's ranks that get their targets from stage 0. A reader
    reads the stream as the runs need it, a window at a time: nothing before a run is kept.
    """

    def __init__(self, program: RunProgram, rank: int, batches: Iterable[Any] | None, *,
                 steps: int | None, segment: int | None, ahead: int, routed: set[int],
                 resume: Resume, monitor: FaultMonitor | None,
                 checkpoint_every: int | None = None) -> None:
        self.program = program
        self.rank = rank
        self.stage = program.stages_of(rank)[0]
        self.reads = program.reads_data(rank)
        self.given = batches is not None
        self.batches = batches if self.reads else None
        self.stream: Iterator[Any] = iter(())  # the reader's, from the resume point (_skip)
        self.every = checkpoint_every
        self.data_states: dict[int, Any] = {}  # a reader's: checkpoint step -> data.state_dict()
        self.steps, self.segment, self.ahead = steps, segment, ahead
        self.routed, self.resume, self.monitor = routed, resume, monitor
        self.source = program.plan.stages[0].ranks[0]  # the reader that tells the others
        # a reader's: microbatch shape -> its table's number, the least recently used first
        self.shapes: OrderedDict[Any, int] = OrderedDict()
        self.numbered = 0  # tables numbered so far (a number is never given twice)
        self.tables: dict[int, dict[str, Any]] = {}  # every rank's: number -> shapes, target
        self._announced: deque[tuple[RunInput | None, Header]] = deque()
        self.multiple, self.least = window_rounds(
            program.schedule_name, [s.replicas for s in program.plan.stages])

    def next(self, index: int, first: bool = False) -> tuple[RunInput | None, Header]:
        """The next run's data (readers; None elsewhere) and its header, from minibatch
        `index` on (`first`: the run's first call, which moves the data to `index`). Headers
        come from the first reader, up to `ahead` runs per broadcast."""
        if not self._announced:
            runs: list[tuple[RunInput | None, Header]] = []
            at = index
            while self.reads and len(runs) < self.ahead:
                run, header = self._read_run(at, first and not runs)
                runs.append((run, header))
                if header["error"] is not None or not header["count"]:
                    break
                at += header["count"]
            headers = [header for _, header in runs]
            if dist.get_world_size() > 1:
                box = [headers]
                with guarded(self.monitor, "the announcement of the next minibatches"):
                    dist.broadcast_object_list(box, src=self.source)
                headers = box[0]
            own = [run for run, _ in runs]
            self._announced.extend((own[i] if i < len(own) else None, header)
                                   for i, header in enumerate(headers))
        run, header = self._announced.popleft()
        if header["error"] is not None:
            if self.rank != self.source:
                raise AnnouncedInputError(header["error"], reader=self.source)
            raise PipelineInputError(header["error"])
        for number in header.get("forget", ()):  # no run from this one on uses them
            self.tables.pop(number, None)
        self.tables.update(header.get("tables", {}))
        return run, header

    def _read_run(self, index: int, first: bool) -> tuple[RunInput | None, Header]:
        """A reader's next run: its data and its header (minibatch count and sizes, the
        microbatches of each minibatch, the message shapes of each microbatch); a refusal
        becomes the header's error."""
        header: Header = {"count": 0, "sizes": [], "error": None}
        run = None
        try:
            if first:
                self._skip(index)
            items = self._take(index)
            if first and not items and index == 0 and self.steps != 0:
                raise PipelineInputError("the data gives no minibatches: it must yield "
                                         "(inputs, target) pairs, at least one")
            end = index + len(items)
            if self.every and items and end % self.every == 0 \
                    and callable(getattr(self.batches, "state_dict", None)):
                self.data_states[end] = self.batches.state_dict()  # type: ignore[union-attr]
            header["count"] = len(items)
            header["sizes"] = [self._samples(inputs) for inputs, _ in items]
            if items:
                run = self.program.prepare(items, first=index)
                header["microbatches"] = run.microbatches
                header["groups"] = [list(g) for g in run.groups]
                header["tables"], header["table_of"], header["forget"] = \
                    self._shape_tables(run)
        except PdcompileError as err:
            header["error"] = str(err)
        return run, header

    def _samples(self, inputs: tuple[Any, ...]) -> int:
        """A minibatch's batch size, along the dimension the pipeline cuts (1 where none)."""
        if self.program.samples is not None:
            return self.program.samples(inputs) or 1
        return _batch_size(inputs)

    def _skip(self, count: int) -> None:
        """A reader's data, moved to the resume point (errors reach every rank, see next)."""
        if self.reads and not self.given:
            raise PipelineInputError(f"rank {self.rank} runs stage {self.stage}, which reads "
                                     "the model's inputs: pass it the minibatches "
                                     "(batches=None only on ranks that do not read data, see "
                                     "reads_data)")
        if self.reads and self.batches is not None:
            self.stream = resumed_stream(self.batches, count, state=self.resume.data_state)
        if self.resume.rng is not None:
            torch.set_rng_state(self.resume.rng)  # as saved, whatever skipping the data drew

    def data_state(self, done: int) -> Any:
        """A reader's data position after `done` minibatches, where the data has a
        `state_dict()` (None otherwise); forgets the older ones."""
        for step in [k for k in self.data_states if k < done]:
            del self.data_states[step]
        return self.data_states.pop(done, None)

    def _take(self, index: int) -> list[tuple[tuple[Any, ...], Any]]:
        limit = window_limit(index, steps=self.steps, segment=self.segment,
                             multiple=self.multiple)
        return take_window(self.stream, limit, convert=_minibatch, first=index,
                           multiple=self.multiple, least=self.least)

    def _shape_tables(self, run: RunInput
                      ) -> tuple[dict[int, dict[str, Any]], list[int], list[int]]:
        """A reader's: the tables of the shapes first seen in `run`, the table of each
        microbatch (minibatches may differ in shape: a short last batch, another length), and
        the tables every rank may forget once the runs before this one are done: the least
        recently used beyond SHAPE_TABLES_KEPT that this run does not use (a shape seen again
        later gets a new number, so a run announced ahead never names a forgotten table)."""
        new: dict[int, dict[str, Any]] = {}
        table_of = []
        for m in range(run.microbatches):
            named, target = run.data.inputs(m), run.data.target(m)
            key = signature((tuple(named.values()), target))
            if key in self.shapes:
                self.shapes.move_to_end(key)
            else:
                self.shapes[key] = self.numbered
                self.numbered += 1
                new[self.shapes[key]] = {
                    "edges": self.program.microbatch_specs(named),
                    "target": target_layout(target) if self.routed else None}
            table_of.append(self.shapes[key])
        used = set(table_of)
        forget = []
        while len(self.shapes) > max(SHAPE_TABLES_KEPT, len(used)):
            oldest, number = next(iter(self.shapes.items()))
            if number in used:  # the least recently used is this run's: keep the rest too
                break
            del self.shapes[oldest]
            forget.append(number)
        return new, table_of, forget


def target_layout(target: Any) -> TargetLayout | None:
    """How a microbatch's target travels: its tree structure and its tensors' shapes."""
    if target is None:
        return None
    leaves, spec = pytree.tree_flatten(target)
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise PipelineInputError(
            f"the target ({describe(target)}) must be a tensor or a tuple of tensors to travel "
            "from stage 0 to the last stage; convert it with torch.as_tensor")
    return pytree.treespec_dumps(spec), [TensorSpec(tuple(t.shape), t.dtype) for t in leaves]


def _minibatch(item: Any, index: int) -> tuple[tuple[Any, ...], Any]:
    try:
        inputs, target = item
    except (TypeError, ValueError):
        raise PipelineInputError(
            f"minibatch {index} is a {type(item).__name__}, not a pair (inputs, target); "
            "yield (x, y) or ((x1, x2), y) from the data") from None
    return (tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)), target


def _batch_size(inputs: tuple[Any, ...]) -> int:
    for value in pytree.tree_leaves(inputs):  # inside a list or dict input too
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    return 1


__all__ = ["ANNOUNCE_AHEAD", "Announcements", "Header", "TargetLayout", "target_layout"]
