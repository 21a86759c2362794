"""The distributed backend: generated rank code run over torch.distributed (gloo or NCCL).

Each process runs the same generated generator `run_rank(rt)` as the local backend, to
exhaustion, with a `DistributedTransport`: point-to-point `isend`/`irecv` whose shapes are known
ahead (no size handshake), receives posted ahead of need where the schedule says what comes next
(so transfers overlap compute), and gradient all-reduce over one process group per replicated
stage. Failures of other workers surface as `PeerFailure` (see backends/launch.py).

gloo's point-to-point works cannot be polled (`is_completed()` stays False until `wait()`), so
`Pending.ready()` is only True once waited; when the generator yields, the driver blocks on the
operation the rank last found not ready (or the one it yielded), which is exactly the wait the
schedule asks for.
"""

from __future__ import annotations

import math
import os
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pdcompile.backends.launch import (
    FaultMonitor,
    PeerFailure,
    backend_for,
)
from pdcompile.errors import DistributedError, PdcompileError, PipelineInputError
from pdcompile.runtime.checkpoint import Checkpointer, module_state, restore_module_state
from pdcompile.runtime.transport import Pending, Tag, TensorSpec, Transport
from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.kinds import kind as schedule_kind
from pdcompile.timeline import Recorder, Timeline

_KIND_CODE = {"act": 0, "grad": 1, "target": 2}
_MAX_OPEN_SENDS = 64
# runs (minibatches, under flush schedules) the first reader reads ahead and announces in one
# broadcast: fewer collectives between minibatches, at the price of that many prepared in memory
ANNOUNCE_AHEAD = 4


def wire_tag(tag: Tag, index: int) -> int:
    """The integer tag of tensor `index` of a message: equal on both sides, distinct in a window.

    Layout (30 bits): 2 bits kind, 6 bits edge, 8 bits name and index, 14 bits microbatch (the
    microbatch wraps at 16384, far more than are ever in flight at once). Tags only need to be
    distinct between one pair of ranks, which always run the same pair of stages.
    """
    kind = _KIND_CODE.get(tag.kind, 3)
    edge = ((tag.src_stage & 7) << 3) | (tag.dst_stage & 7)
    name = (zlib.crc32(tag.name.encode()) + index) & 0xFF
    return (kind << 28) | (edge << 22) | (name << 14) | (tag.microbatch & 0x3FFF)


class DistPending(Pending):
    """Started works of one message or one all-reduce; `wait()` blocks and names dead peers."""

    def __init__(self, transport: DistributedTransport, works: list[Any], *, peer: int,
                 what: str, result: list[torch.Tensor],
                 after: Callable[[], None] | None = None) -> None:
        self._transport = transport
        self._works = works
        self._peer = peer
        self._what = what
        self._result = result
        self._after = after
        self._done = not works

    def ready(self) -> bool:
        if self._done:
            return True
        if self._transport.pollable and all(w.is_completed() for w in self._works):
            self.wait()
            return True
        self._transport.awaited = self
        return False

    def wait(self) -> list[torch.Tensor]:
        if not self._done:
            self._transport.wait_works(self._works, peer=self._peer, what=self._what)
            self._done = True
            if self._after is not None:
                self._after()
            if self._transport.awaited is self:
                self._transport.awaited = None
        return self._result


class DistributedTransport(Transport):
    """A Transport over the default torch.distributed process group.

    `stage_ranks` (every stage's ranks, pipeline order) and `groups` (further rank groups that
    all-reduce together, e.g. the stages sharing a tied parameter: `Pipeline.collective_groups()`)
    name the process groups to create here, by every rank in the same order, as
    torch.distributed requires. `device` is where received tensors are allocated.
    """

    def __init__(self, *, stage_ranks: Sequence[Sequence[int]] = (),
                 groups: Sequence[Sequence[int]] = (),
                 monitor: FaultMonitor | None = None, device: torch.device | str = "cpu",
                 prepost_depth: int = 2) -> None:
        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialised; call "
                                   "torch.distributed.init_process_group first, or use "
                                   "pdcompile.backends.launch.launch / `pdcompile run`")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device)
        self.monitor = monitor
        self.pollable = dist.get_backend() != "gloo"
        self.prepost_depth = max(0, prepost_depth)
        self.awaited: DistPending | None = None
        self._groups: dict[tuple[int, ...], Any] = {}
        for ranks in [*stage_ranks, *groups]:
            key = tuple(sorted(int(r) for r in ranks))
            if len(key) > 1 and key not in self._groups:
                self._groups[key] = dist.new_group(list(key))
        self._open_sends: deque[DistPending] = deque()
        self._preposted: dict[tuple[int, Tag], DistPending] = {}
        self._expected: dict[int, deque[tuple[tuple[TensorSpec, ...], Tag]]] = {}

    # -- waiting ---------------------------------------------------------------------------------

    def wait_works(self, works: Sequence[Any], *, peer: int, what: str) -> None:
        """Block on `works`; a transport error becomes a `PeerFailure` naming the dead rank."""
        if self.monitor is None:
            try:
                for work in works:
                    work.wait()
            except RuntimeError as err:
                raise DistributedError(f"rank {self.rank}: {what} with rank {peer} failed: "
                                       f"{str(err).splitlines()[0]}") from None
            return
        with self.monitor.blocking():
            try:
                for work in works:
                    work.wait()
            except RuntimeError as err:
                raise self.monitor.explain(peer, err, what=what) from None

    def check(self) -> None:
        """Raise now if another worker is known to be dead (called before starting work)."""
        if self.monitor is not None:
            self.monitor.check()

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensors: Sequence[torch.Tensor], dst_rank: int, tag: Tag) -> Pending:
        self.check()
        payload = [t.detach().contiguous() for t in tensors]
        works = [dist.isend(t, dst_rank, tag=wire_tag(tag, i)) for i, t in enumerate(payload)]
        pending = DistPending(self, works, peer=dst_rank, what=f"send of {tag} to rank {dst_rank}",
                              result=[])
        pending.payload = payload  # type: ignore[attr-defined]  # keep alive until sent
        self._open_sends.append(pending)
        while len(self._open_sends) > _MAX_OPEN_SENDS:
            self._open_sends.popleft().wait()
        return pending

    def _post_recv(self, specs: Sequence[TensorSpec], src_rank: int, tag: Tag) -> DistPending:
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs]
        works = [dist.irecv(b, src_rank, tag=wire_tag(tag, i)) for i, b in enumerate(buffers)]
        return DistPending(self, works, peer=src_rank,
                           what=f"receive of {tag} from rank {src_rank}", result=buffers)

    def recv(self, specs: Sequence[TensorSpec], src_rank: int, tag: Tag) -> Pending:
        self.check()
        pending = self._preposted.pop((src_rank, tag), None)
        if pending is None:
            pending = self._post_recv(specs, src_rank, tag)
            # taken before its turn: it must not be posted again when its turn comes (a stray
            # receive would take the same tag's message of a later run)
            queue = self._expected.get(src_rank)
            for index, (_specs, expected) in enumerate(queue or ()):
                if expected == tag:
                    del queue[index]  # type: ignore[union-attr]
                    break
        self._refill(src_rank)
        return pending

    def expect(self, receives: Iterable[tuple[Sequence[TensorSpec], int, Tag]]) -> None:
        """Announce this rank's future receives in program order; up to `prepost_depth` per
        source are posted ahead, so that the data lands while the rank is still computing."""
        for specs, src_rank, tag in receives:
            self._expected.setdefault(src_rank, deque()).append((tuple(specs), tag))
        for src_rank in list(self._expected):
            self._refill(src_rank)

    def _refill(self, src_rank: int) -> None:
        queue = self._expected.get(src_rank)
        if not queue:
            return
        posted = sum(1 for (src, _tag) in self._preposted if src == src_rank)
        while queue and posted < self.prepost_depth:
            specs, tag = queue.popleft()
            if (src_rank, tag) in self._preposted:
                continue
            self._preposted[(src_rank, tag)] = self._post_recv(specs, src_rank, tag)
            posted += 1

    # -- collectives -------------------------------------------------------------------------------

    def all_reduce(self, tensors: Sequence[torch.Tensor], ranks: Sequence[int]) -> Pending:
        self.check()
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) == 1:
            return DistPending(self, [], peer=self.rank, what="all-reduce", result=[])
        group = self._groups.get(key)
        if group is None:
            if len(key) != self.world_size:
                raise DistributedError(
                    f"rank {self.rank}: no process group for ranks {list(key)}; pass the "
                    "pipeline's stage_ranks and collective_groups() to DistributedTransport so "
                    "that the groups of replicated stages and tied parameters are created on "
                    "every rank")
            group = dist.group.WORLD
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if len(tensors) > 1 else None
        buffer = flat if flat is not None else tensors[0].detach()
        work = dist.all_reduce(buffer, group=group, async_op=True)

        def scatter_back() -> None:
            if flat is None:
                return
            offset = 0
            for t in tensors:
                n = t.numel()
                t.detach().copy_(flat[offset:offset + n].view_as(t))
                offset += n

        peer = next(r for r in key if r != self.rank)
        return DistPending(self, [work], peer=peer, what=f"all-reduce over ranks {list(key)}",
                           result=[], after=scatter_back)

    # -- end ---------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every send still open (call before leaving the process group)."""
        while self._open_sends:
            self._open_sends.popleft().wait()
        self.awaited = None


Receive = tuple[Sequence[TensorSpec], int, Tag]


def expect_schedule(transport: DistributedTransport, schedule: Schedule, rank: int,
                    specs: Callable[[Tag], Sequence[TensorSpec]]) -> None:
    """Announce every receive of `rank` in a lowered schedule to the transport (preposting).

    Tags are those the stage runtime uses: ("act", src, dst, m) and ("grad", src, dst, m).
    """
    transport.expect(schedule_receives(schedule, rank, specs))


def schedule_receives(schedule: Schedule, rank: int,
                      specs: Callable[[Tag], Sequence[TensorSpec]]) -> list[Receive]:
    """Every receive of `rank` in a lowered schedule, in program order: (specs, source, tag)."""
    receives = []
    for action in schedule.actions.get(rank, ()):
        if action.kind not in (Kind.RECV_F, Kind.RECV_B) or action.peer is None:
            continue
        kind = "act" if action.kind is Kind.RECV_F else "grad"
        tag = Tag(kind, action.peer, action.stage, action.microbatch)
        receives.append((specs(tag), schedule.rank_of(action.peer, action.microbatch), tag))
    return receives


def drive(program: Generator[Any, Any, Any], transport: DistributedTransport, *,
          after: Callable[[], None] | None = None) -> Any:
    """Run a rank's generator to exhaustion; each yield blocks on what the rank waits for.

    The value a rank yields may be the `Pending` it waits for; otherwise the transport knows the
    last operation the rank found not ready. `after()` is called whenever the rank is about to
    wait (e.g. to report losses as they become known). Returns the generator's return value.
    """
    try:
        value = next(program)
        while True:
            if after is not None:
                after()
            target = value if isinstance(value, Pending) else transport.awaited
            if target is not None and not (isinstance(target, DistPending) and target._done):
                target.wait()
            transport.awaited = None
            value = program.send(None)
    except StopIteration as stop:
        transport.flush()
        return stop.value


# ----------------------------------------------------------------------------------------------
# Training a Pipeline: one rank of it, in an initialised process group


@dataclass
class DistributedRun:
    """What `run_distributed` returns on each rank (`losses` are the same on every rank).

    `losses`: one per minibatch of the whole run, resumed ones included (index = minibatch);
    `seconds`: wall time of this call's training loop; `samples`: samples trained by this call;
    `timeline`: with `record=True`, this rank's measured timeline, and on rank 0 all ranks'
    merged; `resumed_from`: the checkpoint step this call started from (None: from scratch).
    """

    losses: list[float]
    rank: int
    stage: int
    seconds: float
    samples: int
    timeline: Timeline | None = None
    resumed_from: int | None = None
    steps: int = 0  # minibatches trained by this call

    @property
    def samples_per_second(self) -> float:
        """Training throughput of this call."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class _Renumbered:
    """A recorder proxy that numbers a run's actions after those of the earlier runs, so that a
    timeline of many runs (flush schedules, checkpoint segments) reads as one stream."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.micro_base = 0
        self.update_base = 0
        self._updates = 0

    def next_run(self, microbatches: int) -> None:
        self.micro_base += microbatches
        self.update_base += self._updates
        self._updates = 0

    def add(self, action: Action, start: float, end: float) -> None:
        if action.kind in (Kind.STEP, Kind.ALLREDUCE):
            self._updates = max(self._updates, action.microbatch + 1)
            number = action.microbatch + self.update_base
        else:
            number = action.microbatch + self.micro_base
        self.recorder.add(replace(action, microbatch=number), start, end)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, tuple | list):
        return tuple(_signature(v) for v in value)
    return type(value).__name__


def _minibatch(item: Any, index: int) -> tuple[tuple[Any, ...], Any]:
    try:
        inputs, target = item
    except (TypeError, ValueError):
        raise PipelineInputError(
            f"minibatch {index} is a {type(item).__name__}, not a pair (inputs, target); "
            "yield (x, y) or ((x1, x2), y) from the data") from None
    return (tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)), target


def _batch_size(inputs: tuple[Any, ...]) -> int:
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    return 1


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


@contextmanager
def _guarded(monitor: FaultMonitor | None, what: str) -> Iterator[None]:
    """Run a collective of the whole group so that a dead peer is named, not a gloo error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if monitor is None:
        try:
            yield
        except RuntimeError as err:
            raise DistributedError(f"rank {rank}: {what} failed: "
                                   f"{str(err).splitlines()[0] if str(err) else err!r}") from None
        return
    with monitor.blocking():
        try:
            yield
        except RuntimeError as err:
            raise monitor.explain((rank + 1) % world, err, what=what) from None


def _gather_losses(local: dict[int, torch.Tensor],
                   monitor: FaultMonitor | None) -> dict[int, torch.Tensor]:
    """Every rank's microbatch losses, merged (an all-gather: every rank calls it)."""
    parts: list[Any] = [None] * dist.get_world_size()
    with _guarded(monitor, "the gathering of the losses"):
        dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in local.items()})
    merged: dict[int, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def _mean(values: list[torch.Tensor]) -> float:
    """A minibatch's loss from its microbatches' (as Pipeline.train computes it)."""
    return float(torch.stack(values).mean())


def run_distributed(pipeline: Any, batches: Iterable[Any] | None, *, steps: int | None = None,
                    checkpoint_dir: str | os.PathLike[str] | None = None,
                    checkpoint_every: int | None = None, monitor: FaultMonitor | None = None,
                    record: bool = False, progress: Callable[[int, float], None] | None = None,
                    prepost_depth: int = 2, keep_checkpoints: int = 2) -> DistributedRun:
    """Train `pipeline` on this process's rank of an initialised default process group.

    Every rank calls it. `batches` (an iterable of `(inputs, target)` minibatches) is read only
    by the ranks that `reads_data` names (stage 0, and a stage using a model input directly),
    which must all get the same stream; other ranks may pass None. Stage 0 announces each
    run's minibatches to the others (under flush schedules ANNOUNCE_AHEAD runs per broadcast, so
    it reads that many minibatches ahead), and sends each microbatch's target to the last stage
    with its forward. Each rank runs its generated rank loop (`pipeline.rank_function`) over a
    `DistributedTransport`: flush schedules one run per minibatch, asynchronous '1f1b' / '2bw'
    one stream, exactly as `Pipeline.train` does on the local backend (same losses, weights).

    `steps`: minibatches in the whole run (resumed ones included; default: the whole stream).
    An asynchronous stream is one run of the schedule, read whole before it starts; bound the
    memory this takes with `checkpoint_every` (a run per K minibatches).
    `checkpoint_dir` / `checkpoint_every` K: every K minibatches (and at the end) each rank
    saves its weights, optimizer, RNG state and the data position; a later call with the same
    folder resumes from the newest step all ranks saved. An asynchronous stream is cut into
    runs of K minibatches for that (the pipeline drains at each checkpoint, so no stash state
    is in flight; the losses then equal `Pipeline.train` called once per K minibatches).
    `progress(step, loss)` is called on the first rank of the last stage after each minibatch
    whose loss it knows (`step` indexes `losses`); with a replicated last stage the other
    replicas' minibatches are reported at checkpoints and at the end.
    `monitor`: the fault monitor (launch / torchrun), so that a dead peer is named.
    """
    if not dist.is_initialized():
        raise DistributedError("run_distributed needs an initialised process group; call "
                               "torch.distributed.init_process_group first (torchrun does it "
                               "from its environment), or use train_processes / `pdcompile run`")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = pipeline.plan
    if world != plan.workers:
        raise DistributedError(
            f"the pipeline was compiled for {plan.workers} workers (configuration {plan.config}) "
            f"but the process group has {world}; start {plan.workers} processes (torchrun "
            f"--nproc-per-node={plan.workers} / pdcompile run --nproc {plan.workers})")
    if steps is not None and steps < 0:
        raise PipelineInputError(f"steps must be a non-negative number of minibatches "
                                 f"({steps} < 0)")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise PipelineInputError(f"checkpoint_every must be a positive number of minibatches "
                                 f"({checkpoint_every} < 1)")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise PipelineInputError("checkpoint_every needs checkpoint_dir (the folder to save to)")
    name = pipeline.schedule_name
    flush = schedule_kind(name).flush
    # whole minibatches handed round-robin to the replicas: a run covers whole rounds
    if not schedule_kind(name).microbatched and checkpoint_every is not None:
        lcm = math.lcm(*[s.replicas for s in plan.stages])
        if checkpoint_every % lcm:
            raise PipelineInputError(
                f"'1f1b' with replicated stages ({plan.config}) trains in multiples of {lcm} "
                f"minibatches; use a checkpoint interval that is a multiple of {lcm} "
                f"(not {checkpoint_every})")
    stages = pipeline.stages_of(rank)
    stage = stages[0]  # the rank's first chunk where it holds several (interleaved)
    state = pipeline.state(rank, stage)
    if len(stages) > 1 and checkpoint_dir is not None:
        raise PipelineInputError(f"rank {rank} holds stages {list(stages)} (an interleaved "
                                 "pipeline), whose checkpoints are not supported yet; train "
                                 "without checkpoint_dir or with a schedule of one stage per "
                                 "rank")
    reporter = plan.stages[-1].ranks[0] == rank and progress is not None

    # -- resume point: the newest step every rank has saved (agreed over the group) ----------
    ckpt: Checkpointer | None = None
    done = 0
    losses: list[float] = []
    resumed: int | None = None
    saved: dict[str, Any] = {}
    if checkpoint_dir is not None:
        ckpt = Checkpointer(checkpoint_dir, rank=rank, every=checkpoint_every or 1,
                            keep=keep_checkpoints)
        everyone: list[Any] = [None] * world
        with _guarded(monitor, "the agreement on the checkpoint to resume from"):
            dist.all_gather_object(everyone, ckpt.steps())
        common = set.intersection(*(set(steps_of) for steps_of in everyone))
        if common:
            resumed = done = max(common)
            saved = ckpt.load(done)
            if saved.get("pipeline") != _identity(pipeline, stage):
                raise DistributedError(
                    f"the checkpoints in {checkpoint_dir} were written by another pipeline "
                    f"({saved.get('pipeline')}, this one is {_identity(pipeline, stage)}); "
                    "name another checkpoint folder or delete this one")
            restore_module_state(saved, state.module, state.optimizer,
                                 origin=f"the checkpoint of rank {rank} at step {done} in "
                                        f"{checkpoint_dir}")
            losses = [float(v) for v in saved["losses"]]

    reads = reads_data(pipeline, rank)
    source = plan.stages[0].ranks[0]  # the reader that tells the others what comes
    last = len(plan.stages) - 1
    routed = {r for r in plan.stages[last].ranks if not reads_data(pipeline, r)}
    stream = iter(batches if reads and batches is not None else ())

    def skip(count: int) -> None:
        """A reader's data, moved to the resume point (errors reach every rank, see next_run)."""
        if reads and batches is None:
            raise PipelineInputError(f"rank {rank} runs stage {stage}, which reads the model's "
                                     "inputs: pass it the minibatches (batches=None only on "
                                     "ranks that do not read data, see reads_data)")
        for skipped in range(count if reads else 0):
            if next(stream, _END) is _END:
                raise PipelineInputError(f"the data ends after {skipped} minibatches but the "
                                         f"run resumes at minibatch {count} (checkpoint)")
        if resumed is not None and saved.get("rng") is not None:
            torch.set_rng_state(saved["rng"])  # as saved, whatever skipping the data drew
    segment = 1 if flush else checkpoint_every
    shapes: dict[Any, int] = {}  # a reader's: microbatch shape -> its table's number
    tables: dict[int, dict[str, Any]] = {}  # every rank's: number -> message shapes, target

    def shape_tables(run: Any) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """A reader's: the tables of the shapes first seen in `run`, and the table of each
        microbatch (minibatches may differ in shape: a short last batch, another length)."""
        new: dict[int, dict[str, Any]] = {}
        table_of = []
        for m in range(run.microbatches):
            named, target = run.data.inputs(m), run.data.target(m)
            key = _signature((tuple(named.values()), target))
            if key not in shapes:
                shapes[key] = len(shapes)
                new[shapes[key]] = {"edges": pipeline.microbatch_specs(named),
                                    "target": _target_layout(target) if routed else None}
            table_of.append(shapes[key])
        return new, table_of

    def take(index: int) -> list[tuple[tuple[Any, ...], Any]]:
        items: list[tuple[tuple[Any, ...], Any]] = []
        while (segment is None or len(items) < segment) and (
                steps is None or index + len(items) < steps):
            item = next(stream, _END)
            if item is _END:
                break
            items.append(_minibatch(item, index + len(items)))
        return items

    def read_run(index: int, first: bool) -> tuple[Any, dict[str, Any]]:
        """A reader's next run: its data and its header (minibatch count and sizes, the
        microbatches of each minibatch, the message shapes of each microbatch); a refusal
        becomes the header's error."""
        header: dict[str, Any] = {"count": 0, "sizes": [], "error": None}
        run = None
        try:
            if first:
                skip(index)
            items = take(index)
            header["count"] = len(items)
            header["sizes"] = [_batch_size(inputs) for inputs, _ in items]
            if items:
                run = pipeline.prepare(items, first=index)
                header["microbatches"] = run.microbatches
                header["groups"] = [list(g) for g in run.groups]
                header["tables"], header["table_of"] = shape_tables(run)
        except PdcompileError as err:
            header["error"] = str(err)
        return run, header

    # flush schedules run one minibatch at a time: the reader announces several runs in one
    # broadcast, which otherwise sits on the critical path between two minibatches
    ahead = ANNOUNCE_AHEAD if flush else 1
    announced: deque[tuple[Any, dict[str, Any]]] = deque()

    def next_run(index: int, first: bool) -> tuple[Any, dict[str, Any]]:
        """The next run's data (readers) and its header. Headers come from the first reader,
        up to `ahead` runs per broadcast; a reader's refusal reaches every rank at the same
        point, before the run it concerns, so that none is left waiting."""
        if not announced:
            runs: list[tuple[Any, dict[str, Any]]] = []
            at = index
            while reads and len(runs) < ahead:
                run, header = read_run(at, first and not runs)
                runs.append((run, header))
                if header["error"] is not None or not header["count"]:
                    break
                at += header["count"]
            headers = [header for _, header in runs]
            if world > 1:
                box = [headers]
                with _guarded(monitor, "the announcement of the next minibatches"):
                    dist.broadcast_object_list(box, src=source)
                headers = box[0]
            own = [run for run, _ in runs]
            announced.extend((own[i] if i < len(own) else None, header)
                             for i, header in enumerate(headers))
        run, header = announced.popleft()
        if header["error"] is not None:
            raise PipelineInputError(header["error"])
        tables.update(header.get("tables", {}))
        return run, header

    run, header = next_run(done, True)  # checked before any message of the pipeline is sent
    device = _module_device(state.module)
    transport = DistributedTransport(stage_ranks=pipeline.stage_ranks,
                                     groups=pipeline.collective_groups(), monitor=monitor,
                                     device=device,
                                     # each chunk of an interleaved rank receives as far ahead
                                     # as a rank holding one stage
                                     prepost_depth=prepost_depth * len(stages))
    recorder = Recorder(rank) if record else None
    renumbered = _Renumbered(recorder) if recorder is not None else None
    if renumbered is not None:
        renumbered.micro_base = done * pipeline.per_minibatch
    receives: dict[tuple[int, int, tuple[int, ...]], list[Receive]] = {}
    micro: dict[int, torch.Tensor] = {}   # microbatch losses of this rank, numbered globally
    per = pipeline.per_minibatch
    reported = [len(losses)]
    group_of: dict[int, tuple[int, ...]] = {}  # minibatch -> its microbatches, numbered globally
    micro_base = done * per  # the global number of the next run's first microbatch

    def minibatch_loss(k: int, known: dict[int, torch.Tensor]) -> float:
        return _mean([known[i] for i in group_of[k]])

    def report(known: dict[int, torch.Tensor]) -> None:
        while True:
            k = reported[0]
            parts = [known.get(i) for i in group_of.get(k, (-1,))]
            if any(p is None for p in parts):
                return
            assert progress is not None
            progress(k, _mean(parts))  # type: ignore[arg-type]
            reported[0] = k + 1

    def data_source(run: Any, layout_of: Callable[[int], TargetLayout | None]) -> Any:
        """What the stage runtime reads: the run's data, the targets sent to the last stage
        (readers of stage 0) or received from stage 0 (the last stage), or nothing."""
        if run is not None:
            return _SendsTargets(run.data, transport, plan, routed) if stage == 0 and routed \
                else run.data
        if rank in routed:
            return _ReceivesTargets(transport, plan, layout_of)
        return _NoData(rank, stage)

    first = done
    samples = 0
    with _guarded(monitor, "the barrier before training"):  # all ranks start the clock together
        dist.barrier()
    if recorder is not None:  # the common origin Timeline.merge aligns the ranks' clocks on
        recorder.set_reference()
    start = time.perf_counter()
    while header["count"]:
        count, n, table_of = header["count"], header["microbatches"], header["table_of"]
        specs = _spec_function(tables, table_of, pipeline.vertical_sync)

        def layout_of(m: int, table_of: list[int] = table_of) -> TargetLayout | None:
            return tables[table_of[m]]["target"]  # type: ignore[no-any-return]

        key = (n, per, tuple(table_of))
        if key not in receives:
            receives[key] = schedule_receives(pipeline.schedule(n, per), rank, specs)
            if rank in routed:
                receives[key] = _with_targets(receives[key], plan, layout_of)
        transport.expect(receives[key])
        rt = pipeline.runtime(rank, config=pipeline.run_config(per), transport=transport,
                              data=data_source(run, layout_of), specs=specs,
                              recorder=renumbered)
        base = micro_base
        for j, group in enumerate(header["groups"]):
            group_of[done + j] = tuple(base + i for i in group)
        seen = [0]

        def after(rt: Any = rt, base: int = base, seen: list[int] = seen,
                  micro: dict[int, torch.Tensor] = micro) -> None:
            if len(rt.losses) != seen[0]:
                seen[0] = len(rt.losses)
                for m, loss in rt.losses.items():
                    micro.setdefault(base + m, loss)
                report(micro)

        drive(pipeline.rank_function(rank, n, per)(rt), transport,
              after=after if reporter else None)
        rt.finish()
        for m, loss in rt.losses.items():
            micro[base + m] = loss
        if reporter:
            report(micro)
        if renumbered is not None:
            renumbered.next_run(n)
        done += count
        micro_base += n
        samples += sum(header["sizes"])
        run, header = next_run(done, False)
        if ckpt is not None and (not header["count"] or (checkpoint_every is not None
                                                         and done % checkpoint_every == 0)):
            merged = _gather_losses(micro, monitor)
            losses.extend(minibatch_loss(k, merged) for k in range(len(losses), done))
            for k in [k for k in micro if k < micro_base]:
                del micro[k]
            if reporter:
                report(merged)
            ckpt.save(done, module_state(state.module, state.optimizer, losses=list(losses),
                                         data_position=done,
                                         pipeline=_identity(pipeline, stage)))
    seconds = time.perf_counter() - start
    transport.flush()
    if len(losses) < done:
        merged = _gather_losses(micro, monitor)
        losses.extend(minibatch_loss(k, merged) for k in range(len(losses), done))
        if reporter:
            report(merged)
    timeline = None
    if recorder is not None:
        meta = {"schedule": name, "microbatches_per_minibatch": per, "backend": "distributed",
                "minibatches": done - first}
        timeline = recorder.timeline(**meta)
        parts: list[Any] = [None] * world if rank == 0 else []
        with _guarded(monitor, "the gathering of the timelines"):
            dist.gather_object(timeline.to_dict(), parts if rank == 0 else None, dst=0)
        if rank == 0:
            timeline = Timeline.merge([Timeline.from_dict(p) for p in parts], source="measured")
            timeline.meta.update(meta)
    return DistributedRun(losses=losses, rank=rank, stage=stage, seconds=seconds,
                          samples=samples, timeline=timeline, resumed_from=resumed,
                          steps=done - first)


def reads_data(pipeline: Any, rank: int) -> bool:
    """Whether `rank` reads the minibatches: stage 0 (the model's inputs), and any stage that
    uses a model input directly. Other ranks may pass `batches=None` to run_distributed; the
    last stage then gets its targets from stage 0 over the wire."""
    stages = pipeline.stages_of(rank)  # several where the rank holds chunks (interleaved)
    if 0 in stages or any(ref.stage is None for stage in stages
                          for ref in pipeline.parts.stages[stage].inputs):
        return True
    last = len(pipeline.plan.stages) - 1 in stages
    return last and any(ref.stage is None for ref in pipeline.parts.output_refs)


def _spec_function(tables: dict[int, dict[str, Any]], table_of: Sequence[int],
                   vertical_sync: bool) -> Callable[[Tag], list[TensorSpec]]:
    """Tag -> message shapes of one run: microbatch m's from table `table_of[m]` (as
    Pipeline.spec_function; vertical sync adds the version number to activations)."""
    version = [TensorSpec((), torch.int64)] if vertical_sync else []

    def specs(tag: Tag) -> list[TensorSpec]:
        edges = tables[table_of[tag.microbatch]]["edges"]
        found: list[TensorSpec] = edges[Tag(tag.kind, tag.src_stage, tag.dst_stage, 0)]
        return found + version if tag.kind == "act" else found

    return specs


TargetLayout = tuple[str, list[TensorSpec]]


def _target_layout(target: Any) -> TargetLayout | None:
    """How a microbatch's target travels: its tree structure and its tensors' shapes."""
    if target is None:
        return None
    leaves, spec = pytree.tree_flatten(target)
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise PipelineInputError(
            f"the target ({_describe(target)}) must be a tensor or a tuple of tensors to travel "
            "from stage 0 to the last stage; convert it with torch.as_tensor")
    return pytree.treespec_dumps(spec), [TensorSpec(tuple(t.shape), t.dtype) for t in leaves]


def _target_tag(plan: Any, microbatch: int) -> Tag:
    return Tag("target", 0, len(plan.stages) - 1, microbatch)


def _with_targets(receives: list[Receive], plan: Any,
                  layout_of: Callable[[int], TargetLayout | None]) -> list[Receive]:
    """A last-stage rank's receives with each microbatch's target where the last stage takes
    it: right after the microbatch's first activations into the last stage (its forward reads
    the target). Program order matters: the transport posts receives in this order, a fixed
    number ahead (a rank holding several chunks receives other chunks' activations between).
    `layout_of(m)`: the target's layout for microbatch m's run (None: it has no target)."""
    first = plan.stages[0].ranks
    last = len(plan.stages) - 1
    out: list[Receive] = []
    seen: set[int] = set()
    for specs, src, tag in receives:
        out.append((specs, src, tag))
        layout = layout_of(tag.microbatch)
        if tag.kind == "act" and tag.dst_stage == last and tag.microbatch not in seen \
                and layout is not None:
            seen.add(tag.microbatch)
            out.append((layout[1], first[tag.microbatch % len(first)],
                        _target_tag(plan, tag.microbatch)))
    return out


class _SendsTargets:
    """Stage 0's data: reading microbatch m's inputs also sends its target to the last stage."""

    def __init__(self, data: Any, transport: DistributedTransport, plan: Any,
                 routed: set[int]) -> None:
        self.data = data
        self.transport = transport
        self.plan = plan
        self.routed = routed
        self.last = plan.stages[-1].ranks
        self.sent: set[int] = set()

    def inputs(self, microbatch: int) -> Any:
        dst = self.last[microbatch % len(self.last)]
        if microbatch not in self.sent and dst in self.routed:
            self.sent.add(microbatch)
            leaves = pytree.tree_leaves(self.data.target(microbatch))
            if leaves:
                self.transport.send(leaves, dst, _target_tag(self.plan, microbatch))
        return self.data.inputs(microbatch)

    def target(self, microbatch: int) -> Any:
        return self.data.target(microbatch)


class _ReceivesTargets:
    """The last stage's data when it reads none: targets arrive from stage 0."""

    def __init__(self, transport: DistributedTransport, plan: Any,
                 layout_of: Callable[[int], TargetLayout | None]) -> None:
        self.transport = transport
        self.plan = plan
        self.layout_of = layout_of
        self.first = plan.stages[0].ranks
        self.got: dict[int, Any] = {}

    def inputs(self, microbatch: int) -> Any:
        raise DistributedError(f"the last stage asked for the model inputs of microbatch "
                               f"{microbatch}, which only stage 0 reads")

    def target(self, microbatch: int) -> Any:
        layout = self.layout_of(microbatch)
        if layout is None:
            return None
        if microbatch not in self.got:
            src = self.first[microbatch % len(self.first)]
            leaves = self.transport.recv(layout[1], src,
                                         _target_tag(self.plan, microbatch)).wait()
            self.got[microbatch] = pytree.tree_unflatten(leaves, pytree.treespec_loads(layout[0]))
        return self.got[microbatch]


class _NoData:
    """The data of a stage that reads none."""

    def __init__(self, rank: int, stage: int) -> None:
        self.rank, self.stage = rank, stage

    def inputs(self, microbatch: int) -> Any:
        raise DistributedError(f"rank {self.rank} (stage {self.stage}) reads no data, but asked "
                               f"for the inputs of microbatch {microbatch}")

    def target(self, microbatch: int) -> Any:
        raise DistributedError(f"rank {self.rank} (stage {self.stage}) reads no data, but asked "
                               f"for the target of microbatch {microbatch}")


_END = object()


def _identity(pipeline: Any, stage: int) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by a pipeline's rank."""
    return {"config": pipeline.plan.config, "schedule": pipeline.schedule_name,
            "stage": stage, "microbatches": pipeline.microbatches}


__all__ = ["DistributedRun", "DistributedTransport", "DistPending", "PeerFailure",
           "backend_for", "drive", "expect_schedule", "reads_data", "run_distributed",
           "schedule_receives", "wire_tag"]

