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

`run_distributed` trains one rank of a RunProgram (backends/program.py): it checks the group
and options, finds the resume point (distributed_checkpoint.py), learns each run from the first
reader's announcements (distributed_announce.py) and runs them in its run loop (`_run_loop`).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pdcompile.backends.distributed_announce import (
    ANNOUNCE_AHEAD,
    Announcements,
    Header,
    TargetLayout,
)
from pdcompile.backends.distributed_checkpoint import Resume, resume_point, save_checkpoint
from pdcompile.backends.distributed_guard import guarded
from pdcompile.backends.launch import (
    FaultMonitor,
    PeerFailure,
    backend_for,
)
from pdcompile.backends.packed_message import empty_packed, pack, packs, spec_of, unpack
from pdcompile.backends.posting_thread import PostingThread, off_thread
from pdcompile.backends.program import ProgramSource, RunInput, RunProgram, as_program
from pdcompile.backends.target_rides import TargetRides
from pdcompile.backends.watchdog import model_activity, model_failure, watched_batches
from pdcompile.errors import DistributedError, PipelineInputError
from pdcompile.plan import Plan
from pdcompile.runtime.finite_loss import LossGuard, guard_runtime
from pdcompile.runtime.message_specs import MessageTable, spec_function
from pdcompile.runtime.rank_state import RankState
from pdcompile.runtime.stream_window import WINDOW
from pdcompile.runtime.transport import Pending, Tag, TensorSpec, Transport
from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.kinds import kind as schedule_kind
from pdcompile.timeline import Recorder, Timeline

_KIND_CODE = {"act": 0, "grad": 1, "target": 2}
Description = str | Callable[[], str]  # what an operation is, for its error message
_MAX_OPEN_SENDS = 64
# the receive lists of this many run shapes are kept (runs of one stream share one or two)
_RUN_SHAPES_KEPT = 4


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


def _described(what: Description) -> str:
    return what if isinstance(what, str) else what()


class DistPending(Pending):
    """Started works of one message or one all-reduce; `wait()` blocks and names dead peers."""

    def __init__(self, transport: DistributedTransport, works: list[Any], *, peer: int,
                 what: Description, result: list[torch.Tensor],
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
        # gloo on CPU: the isend / irecv of large messages issued off the rank's thread
        # (backends/posting_thread.py); NCCL's are launches on a stream, which stay on the
        # thread that orders them
        self._poster = PostingThread() if not self.pollable and self.device.type == "cpu" \
            else None
        self.prepost_depth = max(0, prepost_depth)
        self.awaited: DistPending | None = None
        # the run's targets that ride in stage 0's activation messages to the last stage
        self.rides: TargetRides | None = None
        self._groups: dict[tuple[int, ...], Any] = {}
        for ranks in [*stage_ranks, *groups]:
            key = tuple(sorted(int(r) for r in ranks))
            if len(key) > 1 and key not in self._groups:
                self._groups[key] = dist.new_group(list(key))
        self._open_sends: deque[DistPending] = deque()
        self._preposted: dict[int, dict[Tag, DistPending]] = {}  # source -> posted receives
        self._expected: dict[int, deque[tuple[tuple[TensorSpec, ...], Tag]]] = {}
        # messages between two chunks of this rank (the tip of a V): handed over in memory
        self._loopback: dict[Tag, list[torch.Tensor]] = {}
        # flat all-reduce buffers not in use, by (elements, dtype, device): reused every round
        self._flat_free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    # -- waiting ---------------------------------------------------------------------------------

    def wait_works(self, works: Sequence[Any], *, peer: int, what: Description) -> None:
        """Block on `works`; a transport error becomes a `PeerFailure` naming the dead rank.
        `what` may be a function that describes the operation (only called on an error)."""
        if self.monitor is None:
            try:
                for work in works:
                    work.wait()
            except RuntimeError as err:
                raise DistributedError(f"rank {self.rank}: {_described(what)} with rank {peer} "
                                       f"failed: {str(err).splitlines()[0]}") from None
            return
        with self.monitor.blocking(what):
            try:
                for work in works:
                    work.wait()
            except RuntimeError as err:
                raise self.monitor.explain(peer, err, what=_described(what)) from None

    def check(self) -> None:
        """Raise now if another worker is known to be dead (called before starting work)."""
        if self.monitor is not None:
            self.monitor.check()

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensors: Sequence[torch.Tensor], dst_rank: int, tag: Tag) -> Pending:
        self.check()
        if dst_rank == self.rank:  # the receiver decodes a detached copy before it computes
            self._loopback[tag] = [t.detach() for t in tensors]
            return DistPending(self, [], peer=dst_rank, what=f"hand-over of {tag}", result=[])
        payload = [t.detach().contiguous() for t in tensors]
        if self.rides is not None:
            payload += self.rides.outgoing(tag, dst_rank)
        specs = [spec_of(t) for t in payload]
        issue = functools.partial(_issue_send, dist.isend, payload, specs, dst_rank, tag)
        # described only on an error: formatting the tag costs more than the send's bookkeeping
        what = functools.partial(_describe, "send of", tag, "to", dst_rank)
        if self._poster is not None and off_thread(_bytes(payload)):  # packed there too
            pending = DistPending(self, [self._poster.post(issue)], peer=dst_rank, what=what,
                                  result=[])
        else:
            works, kept = issue()
            pending = DistPending(self, works, peer=dst_rank, what=what, result=[])
            pending.payload = kept  # type: ignore[attr-defined]  # keep alive until sent
        self._open_sends.append(pending)
        while len(self._open_sends) > _MAX_OPEN_SENDS:
            self._open_sends.popleft().wait()
        return pending

    def _post_recv(self, specs: Sequence[TensorSpec], src_rank: int, tag: Tag) -> DistPending:
        rides = self.rides
        riding = rides.incoming(tag) if rides is not None else []
        every = [*specs, *riding]
        if packs(every):
            buffers = [empty_packed(every, self.device)]
            tensors = unpack(buffers[0], every)
        else:
            buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                       for spec in every]
            tensors = buffers
        issue = functools.partial(_issue_recv, dist.irecv, buffers, src_rank, tag)
        works = [self._poster.post(issue)] if self._poster is not None and off_thread(
            _bytes(buffers)) else issue()[0]
        after: Callable[[], None] | None = None
        if riding and rides is not None:  # the target is read once its activations arrived
            after = functools.partial(rides.deliver, tag, tensors[len(specs):])
        return DistPending(self, works, peer=src_rank,
                           what=functools.partial(_describe, "receive of", tag, "from",
                                                  src_rank),
                           result=tensors[:len(specs)], after=after)

    def recv(self, specs: Sequence[TensorSpec], src_rank: int, tag: Tag) -> Pending:
        self.check()
        if src_rank == self.rank:
            try:
                handed = self._loopback.pop(tag)
            except KeyError:
                raise DistributedError(f"rank {self.rank} receives {tag} from one of its own "
                                       "chunks before that chunk sent it; the schedule's order "
                                       "is broken (validate it)") from None
            return DistPending(self, [], peer=src_rank, what=f"hand-over of {tag}",
                               result=handed)
        pending = self._preposted.get(src_rank, {}).pop(tag, None)
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
            if src_rank == self.rank:  # handed over in memory (`send`), never posted
                continue
            self._expected.setdefault(src_rank, deque()).append((tuple(specs), tag))
        for src_rank in list(self._expected):
            self._refill(src_rank)

    def posted_ahead(self, src_rank: int) -> list[Tag]:
        """The receives from `src_rank` posted ahead and not yet taken, in posting order."""
        return list(self._preposted.get(src_rank, {}))

    def _refill(self, src_rank: int) -> None:
        queue = self._expected.get(src_rank)
        if not queue:
            return
        posted = self._preposted.setdefault(src_rank, {})
        # the depth counts microbatches' messages, not tensors' or targets': a target rides
        # with its microbatch's activations (`_with_targets`), and counted on its own it would
        # halve how far ahead the last stage receives. Measured (docs/runtime-profile.md, third
        # round): receiving one microbatch ahead instead of two cost the last stage of
        # 1F1B-flush 14-21 ms of gloo's loop-thread CPU a minibatch against 6 ms, on cores
        # that its compute shares
        ahead = 0
        for tag in posted:  # a loop, not sum() of a generator: this runs for every receive
            if tag.kind != "target":
                ahead += 1
        while queue and (ahead < self.prepost_depth or queue[0][1].kind == "target"):
            specs, tag = queue.popleft()
            if tag not in posted:
                posted[tag] = self._post_recv(specs, src_rank, tag)
                ahead += tag.kind != "target"

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
        flat = self._flat_buffer(tensors) if len(tensors) > 1 else None
        if flat is not None:
            torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)
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
            self._flat_free[(flat.numel(), flat.dtype, flat.device)].append(flat)

        peer = next(r for r in key if r != self.rank)
        return DistPending(self, [work], peer=peer, what=f"all-reduce over ranks {list(key)}",
                           result=[], after=scatter_back)

    def _flat_buffer(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A flat buffer for the all-reduce of `tensors`, one left free by an earlier
        all-reduce of as many elements where there is one (it returns when its all-reduce is
        waited). Why: a replicated stage all-reduces the same gradients every round, and a
        fresh buffer beyond malloc's mmap threshold (32 MiB, runtime/allocator.py) faults in
        and zeroes every page again: 20 ms of a 33.6 MB buffer on the 2-core development VM,
        as long as gloo's all-reduce itself (docs/cost-model.md)."""
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))  # as cat's
        key = (sum(t.numel() for t in tensors), dtype, tensors[0].device)
        free = self._flat_free.setdefault(key, [])
        return free.pop() if free else torch.empty(key[0], dtype=dtype, device=key[2])

    # -- end ---------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every send still open (call before leaving the process group)."""
        while self._open_sends:
            self._open_sends.popleft().wait()
        self.awaited = None

    def close(self) -> None:
        """Stop the posting thread once it has issued what was queued (the transport's last
        call, after `flush` or a failure; a transport never closed stops its thread when it is
        collected)."""
        if self._poster is not None:
            self._poster.close()


def _issue_send(isend: Callable[..., Any], payload: list[torch.Tensor],
                specs: list[TensorSpec], dst_rank: int,
                tag: Tag) -> tuple[list[Any], list[torch.Tensor]]:
    """A message's `isend`s, its tensors packed into one buffer where they pack; the works
    and the tensors to keep alive until they are waited."""
    if packs(specs):  # one transfer, not one per tensor
        payload = [pack(payload, specs)]
    return [isend(t, dst_rank, tag=wire_tag(tag, i)) for i, t in enumerate(payload)], payload


def _bytes(tensors: list[torch.Tensor]) -> int:
    """A message's bytes (a loop over `nbytes`: no Python call per tensor)."""
    total = 0
    for t in tensors:
        total += t.nbytes
    return total


def _issue_recv(irecv: Callable[..., Any], buffers: list[torch.Tensor], src_rank: int,
                tag: Tag) -> tuple[list[Any], None]:
    return [irecv(b, src_rank, tag=wire_tag(tag, i)) for i, b in enumerate(buffers)], None


def _describe(what: str, tag: Tag, direction: str, peer: int) -> str:
    return f"{what} {tag} {direction} rank {peer}"


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
    monitor = transport.monitor
    try:
        value = next(program)
        while True:
            if monitor is not None:
                monitor.progress()  # the watchdog's tick (backends/watchdog.py)
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


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _gather_losses(local: dict[int, torch.Tensor],
                   monitor: FaultMonitor | None) -> dict[int, torch.Tensor]:
    """Every rank's microbatch losses, merged (an all-gather: every rank calls it)."""
    parts: list[Any] = [None] * dist.get_world_size()
    with guarded(monitor, "the gathering of the losses"):
        dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in local.items()})
    merged: dict[int, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def _mean(values: list[torch.Tensor]) -> float:
    """A minibatch's loss from its microbatches' (as Pipeline.train computes it)."""
    return float(torch.stack(values).mean())


class _Losses:
    """A rank's losses: its microbatches', numbered globally (`micro`), and every minibatch's
    once all ranks' are gathered (`losses`, resumed ones included); `progress` (the reporting
    rank's) hears of each minibatch as soon as its loss is known here."""

    def __init__(self, losses: list[float],
                 progress: Callable[[int, float], None] | None) -> None:
        self.losses = losses
        self.progress = progress
        self.micro: dict[int, torch.Tensor] = {}
        self.group_of: dict[int, tuple[int, ...]] = {}  # minibatch -> its microbatches
        self.reported = len(losses)

    def add_run(self, first: int, base: int, groups: Iterable[Iterable[int]]) -> None:
        """A run's minibatches from `first` on, whose microbatches are numbered from `base`."""
        for j, group in enumerate(groups):
            self.group_of[first + j] = tuple(base + i for i in group)

    def report(self, known: dict[int, torch.Tensor]) -> None:
        """Report every next minibatch whose microbatches' losses are all `known`."""
        if self.progress is None:
            return
        while True:
            parts = [known.get(i) for i in self.group_of.get(self.reported, (-1,))]
            if any(p is None for p in parts):
                return
            self.progress(self.reported, _mean([p for p in parts if p is not None]))
            self.reported += 1

    def settle(self, done: int, monitor: FaultMonitor | None, *,
               forget_before: int | None = None) -> None:
        """The losses of the minibatches up to `done` from every rank's (every rank calls it);
        `forget_before`: drop this rank's microbatch losses numbered below it."""
        merged = _gather_losses(self.micro, monitor)
        self.losses.extend(_mean([merged[i] for i in self.group_of[k]])
                           for k in range(len(self.losses), done))
        self.report(merged)
        if forget_before is not None:
            for k in [k for k in self.micro if k < forget_before]:
                del self.micro[k]
            for k in [k for k in self.group_of if k < done]:
                del self.group_of[k]


def run_distributed(source: RunProgram | ProgramSource, batches: Iterable[Any] | None, *,
                    steps: int | None = None,
                    checkpoint_dir: str | os.PathLike[str] | None = None,
                    checkpoint_every: int | None = None, monitor: FaultMonitor | None = None,
                    record: bool = False, progress: Callable[[int, float], None] | None = None,
                    prepost_depth: int = 2, keep_checkpoints: int = 2,
                    allow_nonfinite: bool = False,
                    slowdown: Sequence[float] | str | None = None,
                    resume_anyway: bool = False) -> DistributedRun:
    """Train a pipeline (its `RunProgram`, or a Pipeline) on this process's rank of an
    initialised default process group.

    Every rank calls it. `batches` (an iterable of `(inputs, target)` minibatches) is read only
    by the ranks that `reads_data` names (stage 0, and a stage using a model input directly),
    which must all get the same stream; other ranks may pass None. Stage 0 announces each
    run's minibatches to the others (under flush schedules ANNOUNCE_AHEAD runs per broadcast, so
    it reads that many minibatches ahead; backends/distributed_announce.py), and sends each
    microbatch's target to the last stage with its forward. Each rank runs its generated rank
    loop (`program.rank_functions`) over a `DistributedTransport`: flush schedules one run per
    minibatch, asynchronous '1f1b' / '2bw' one stream, exactly as `Pipeline.train` does on the
    local backend (same losses, weights).

    `steps`: minibatches in the whole run (resumed ones included; default: the whole stream).
    The stream is read as the runs need it: an asynchronous stream is trained as runs of at most
    one window of minibatches (runtime/stream_window.py, as `Pipeline.train` cuts it), so a
    worker holds one window whatever the stream's length; an endless stream without `steps`
    trains until stopped.
    `checkpoint_dir` / `checkpoint_every` K: every K minibatches (and at the end) each rank
    saves its weights, optimizer, RNG state and the data position; a later call with the same
    folder resumes from the newest step all ranks saved (backends/distributed_checkpoint.py).
    An asynchronous stream is cut into runs of K minibatches for that (the pipeline drains at
    each checkpoint, so no stash state is in flight; the losses then equal `Pipeline.train`
    called once per K minibatches). A resume is refused where the checkpoint was written by
    another model; `resume_anyway=True` resumes where only its layers' classes, settings or
    operation names differ (a torch upgrade can change them), or it recorded no model
    (backends/distributed_checkpoint.py, `check_same_model`).
    `progress(step, loss)` is called on the first rank of the last stage after each minibatch
    whose loss it knows (`step` indexes `losses`); with a replicated last stage the other
    replicas' minibatches are reported at checkpoints and at the end.
    `monitor`: the fault monitor (launch / torchrun), so that a dead peer, or a rank that
    makes no progress (backends/watchdog.py), is named.
    A NaN or infinite loss stops the run naming its step, rank and stage, unless
    `allow_nonfinite` (runtime/finite_loss.py).
    `slowdown`: per rank, the factor its compute is stretched by, an emulated slower device
    (runtime/slowdown.py; "1,2" or [1, 2]; every rank must pass the same).
    """
    program = as_program(source)
    if slowdown is not None:
        program = program.with_slowdowns(slowdown)
    rank = _check_run(program, steps=steps, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every)
    stages = program.stages_of(rank)
    chunk_states = [program.state(rank, s) for s in stages]  # one per chunk it holds
    for chunk in chunk_states:  # every rank was seeded alike: each stage draws its own stream
        chunk.own_random()  # before a resume restores it
    state = chunk_states[0]  # the rank's first chunk where it holds several
    resume = resume_point(program, chunk_states, checkpoint_dir, every=checkpoint_every,
                          keep=keep_checkpoints, monitor=monitor, resume_anyway=resume_anyway)
    try:
        if steps is not None and resume.done > steps:  # every rank agreed on resume.done
            raise PipelineInputError(
                f"the checkpoints in {checkpoint_dir} already hold {resume.done} minibatches, and "
                f"steps={steps} asks for fewer; ask for {resume.done} or more to train on, or name "
                "another checkpoint folder to start afresh")
        if monitor is not None:  # from here on, a rank that stops progressing is named
            monitor.progress("starting")
            if batches is not None:
                batches = watched_batches(batches, monitor)
        flush = schedule_kind(program.schedule_name).flush
        last = len(program.plan.stages) - 1
        routed = {r for r in program.plan.stages[last].ranks if not program.reads_data(r)}
        # flush schedules run one minibatch at a time: the reader announces several runs in one
        # broadcast, which otherwise sits on the critical path between two minibatches
        announcements = Announcements(program, rank, batches, steps=steps,
                                      segment=1 if flush else checkpoint_every,
                                      ahead=ANNOUNCE_AHEAD if flush else 1, routed=routed,
                                      resume=resume, monitor=monitor,
                                      checkpoint_every=checkpoint_every)
        run, header = announcements.next(resume.done, first=True)  # before any message is sent
        transport = DistributedTransport(stage_ranks=program.stage_ranks,
                                         groups=program.collective_groups(), monitor=monitor,
                                         device=_module_device(state.module),
                                         # each chunk of an interleaved rank receives as far ahead
                                         # as a rank holding one stage
                                         prepost_depth=prepost_depth * len(stages))
        reporter = program.plan.stages[-1].ranks[0] == rank and progress is not None
        losses = _Losses(resume.losses, progress if reporter else None)
        try:
            return _run_loop(program, chunk_states, transport, announcements, (run, header), resume,
                             losses, routed=routed, record=record, monitor=monitor,
                             checkpoint_every=checkpoint_every, allow_nonfinite=allow_nonfinite)
        finally:
            transport.close()
    finally:  # the checkpoint folder's writer lock: a later run, in this process too, may write
        if resume.checkpointer is not None:
            resume.checkpointer.release()


def idle_rank_refusal(plan: Plan) -> str | None:
    """Why the distributed backend cannot run `plan`: ranks that hold no stage (the mixed
    planner may leave a slow device out), where a process would wait on no schedule; None
    where every rank holds a stage."""
    held = {r for stage in plan.stages for r in stage.ranks}
    idle = [r for r in range(plan.workers) if r not in held]
    if not idle:
        return None
    return (f"ranks {idle} of the plan ({plan.config} on {plan.workers} workers) hold no stage, "
            f"and the distributed backend runs a stage on every process; plan for the workers "
            f"that run (a cluster of {len(held)}, ranks renumbered from 0), or train this plan "
            f"with the local backend (Pipeline.train)")


def _check_run(program: RunProgram, *, steps: int | None,
               checkpoint_dir: str | os.PathLike[str] | None,
               checkpoint_every: int | None) -> int:
    """This process's rank, once the process group and the options are known to fit."""
    if not dist.is_initialized():
        raise DistributedError("run_distributed needs an initialised process group; call "
                               "torch.distributed.init_process_group first (torchrun does it "
                               "from its environment), or use train_processes / `pdcompile run`")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = program.plan
    if world > plan.workers and isinstance(plan.extra.get("idle_workers"), str):
        raise DistributedError(
            f"the plan runs on {plan.workers} of the {world} processes started (the planner "
            f"left workers idle: {plan.extra['idle_workers']}); start {plan.workers} (torchrun "
            f"--nproc-per-node={plan.workers}; pdcompile run and train_processes start only "
            "the plan's)")
    if world != plan.workers:
        raise DistributedError(
            f"the pipeline was compiled for {plan.workers} workers (configuration {plan.config}) "
            f"but the process group has {world}; start {plan.workers} processes (torchrun "
            f"--nproc-per-node={plan.workers} / pdcompile run --nproc {plan.workers})")
    idle = idle_rank_refusal(plan)
    if idle is not None:
        raise DistributedError(idle)
    if steps is not None and steps < 0:
        raise PipelineInputError(f"steps must be a non-negative number of minibatches "
                                 f"({steps} < 0)")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise PipelineInputError(f"checkpoint_every must be a positive number of minibatches "
                                 f"({checkpoint_every} < 1)")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise PipelineInputError("checkpoint_every needs checkpoint_dir (the folder to save to)")
    # whole minibatches handed round-robin to the replicas: a run covers whole rounds
    if not schedule_kind(program.schedule_name).microbatched and checkpoint_every is not None:
        lcm = math.lcm(*[s.round_size for s in plan.stages])
        if checkpoint_every % lcm:
            raise PipelineInputError(
                f"'1f1b' with replicated stages ({plan.config}) trains in multiples of {lcm} "
                f"minibatches; use a checkpoint interval that is a multiple of {lcm} "
                f"(not {checkpoint_every})")
    return rank


def _run_loop(program: RunProgram, chunk_states: list[RankState],
              transport: DistributedTransport,
              announcements: Announcements, announced: tuple[RunInput | None, Header],
              resume: Resume, losses: _Losses, *, routed: set[int], record: bool,
              monitor: FaultMonitor | None, checkpoint_every: int | None,
              allow_nonfinite: bool = False) -> DistributedRun:
    """The training of one rank: every announced run through its generated loop, a checkpoint
    where one is due, then the losses (and timelines) gathered from every rank.
    `chunk_states`: what the rank holds, one per chunk (its first runs the rank's data)."""
    state = chunk_states[0]
    rank, stage = state.rank, state.stage
    plan = program.plan
    per = program.per_minibatch
    tables = announcements.tables
    run, header = announced
    recorder = Recorder(rank) if record else None
    renumbered = _Renumbered(recorder) if recorder is not None else None
    if renumbered is not None:
        renumbered.micro_base = resume.done * per
    receives: dict[tuple[int, int, tuple[int, ...]], list[Receive]] = {}
    done = first = resume.done
    micro_base = done * per  # the global number of the next run's first microbatch

    def data_source(run: Any, rides: TargetRides) -> Any:
        """What the stage runtime reads: the run's data, the targets sent to the last stage
        (readers of stage 0) or received from stage 0 (the last stage), or nothing."""
        if run is not None:
            return _SendsTargets(run.data, transport, plan, routed, rides) \
                if stage == 0 and routed else run.data
        if rank in routed:
            return _ReceivesTargets(transport, plan, rides)
        return _NoData(rank, stage)

    samples = 0
    with guarded(monitor, "the barrier before training"):  # all ranks start the clock together
        dist.barrier()
    if recorder is not None:  # the common origin Timeline.merge aligns the ranks' clocks on
        recorder.set_reference()
    start = time.perf_counter()
    while header["count"]:
        count, n, table_of = header["count"], header["microbatches"], header["table_of"]

        def edges_of(m: int, table_of: list[int] = table_of) -> MessageTable:
            return tables[table_of[m]]["edges"]  # type: ignore[no-any-return]

        def layout_of(m: int, table_of: list[int] = table_of) -> TargetLayout | None:
            return tables[table_of[m]]["target"]  # type: ignore[no-any-return]

        specs = spec_function(edges_of, program.vertical_sync)
        rides = TargetRides(last=len(plan.stages) - 1, edges_of=edges_of, layout_of=layout_of,
                            rank_of=lambda s, m: plan.stages[s].rank_of(m), routed=routed,
                            read=run.data.target if run is not None else None)
        transport.rides = rides if routed and (stage == 0 or rank in routed) else None

        key = (n, per, tuple(table_of))
        if key not in receives:
            if len(receives) >= _RUN_SHAPES_KEPT:  # shapes that vary from run to run
                del receives[next(iter(receives))]
            receives[key] = schedule_receives(program.schedule(n, per), rank, specs)
            if rank in routed:
                receives[key] = _with_targets(receives[key], plan, rides)
        transport.expect(receives[key])
        rt = program.runtime(rank, config=program.run_config(per), transport=transport,
                             data=data_source(run, rides), specs=specs,
                             recorder=renumbered)
        base = micro_base
        guard_runtime(rt, None if allow_nonfinite else LossGuard(done, per))
        losses.add_run(done, base, header["groups"])
        seen = [0]

        def after(rt: Any = rt, base: int = base, seen: list[int] = seen) -> None:
            known = rt.losses
            if len(known) != seen[0]:  # only the new ones: the newest are the dict's last
                new = itertools.islice(reversed(known.items()), len(known) - seen[0])
                seen[0] = len(known)
                for m, loss in new:
                    losses.micro.setdefault(base + m, loss)
                losses.report(losses.micro)

        if monitor is not None:
            monitor.progress(model_activity(rt, rank, base=base))
        try:
            drive(program.rank_functions(n, per)[rank](rt), transport,
                  after=after if losses.progress is not None else None)
        except Exception as err:  # the model's own error: one line naming where
            failure = model_failure(err, rt, rank, base=base)
            if failure is err:
                raise
            raise failure from err
        rt.finish()
        for m, loss in rt.losses.items():
            losses.micro[base + m] = loss
        losses.report(losses.micro)
        if renumbered is not None:
            renumbered.next_run(n)
        done += count
        micro_base += n
        samples += sum(header["sizes"])
        run, header = announcements.next(done)
        if resume.checkpointer is not None and (not header["count"] or (
                checkpoint_every is not None and done % checkpoint_every == 0)):
            losses.settle(done, monitor, forget_before=micro_base)
            if monitor is not None:
                with monitor.busy(f"saving the checkpoint after minibatch {done}"):
                    save_checkpoint(resume.checkpointer, program, chunk_states, done,
                                    losses.losses, data_state=announcements.data_state(done))
            else:
                save_checkpoint(resume.checkpointer, program, chunk_states, done,
                                losses.losses, data_state=announcements.data_state(done))
        elif header["count"] and done - len(losses.losses) >= WINDOW:
            losses.settle(done, monitor, forget_before=micro_base)  # keep a window, no more
    seconds = time.perf_counter() - start
    if monitor is not None:
        monitor.disarm()  # trained: gathering and what the caller does next are not watched
    transport.flush()
    if len(losses.losses) < done:
        losses.settle(done, monitor)
    timeline = None
    if recorder is not None:
        timeline = _gathered_timeline(recorder, monitor, {
            "schedule": program.schedule_name, "microbatches_per_minibatch": per,
            "backend": "distributed", "minibatches": done - first})
    return DistributedRun(losses=losses.losses, rank=rank, stage=stage, seconds=seconds,
                          samples=samples, timeline=timeline, resumed_from=resume.resumed,
                          steps=done - first)


def _gathered_timeline(recorder: Recorder, monitor: FaultMonitor | None,
                       meta: dict[str, Any]) -> Timeline:
    """This rank's measured timeline; on rank 0, every rank's merged (every rank calls it)."""
    rank = dist.get_rank()
    timeline = recorder.timeline(**meta)
    parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    with guarded(monitor, "the gathering of the timelines"):
        dist.gather_object(timeline.to_dict(), parts if rank == 0 else None, dst=0)
    if rank == 0:
        timeline = Timeline.merge([Timeline.from_dict(p) for p in parts], source="measured")
        timeline.meta.update(meta)
    return timeline


def reads_data(source: RunProgram | ProgramSource, rank: int) -> bool:
    """Whether `rank` reads the minibatches: stage 0 (the model's inputs), and any stage that
    uses a model input directly. Other ranks may pass `batches=None` to run_distributed; the
    last stage then gets its targets from stage 0 over the wire."""
    return as_program(source).reads_data(rank)


def _target_tag(plan: Any, microbatch: int) -> Tag:
    return Tag("target", 0, len(plan.stages) - 1, microbatch)


def _with_targets(receives: list[Receive], plan: Any, rides: TargetRides) -> list[Receive]:
    """A last-stage rank's receives with the target of each microbatch whose target does not
    ride in its activations (`TargetRides`) where the last stage takes it: right after the
    microbatch's first activations into the last stage (its forward reads the target). Program
    order matters: the transport posts receives in this order, a fixed number ahead (a rank
    holding several chunks receives other chunks' activations between)."""
    last = len(plan.stages) - 1
    out: list[Receive] = []
    seen: set[int] = set()
    for specs, src, tag in receives:
        out.append((specs, src, tag))
        m = tag.microbatch
        if tag.kind == "act" and tag.dst_stage == last and m not in seen:
            seen.add(m)
            layout = rides.layout_of(m)
            if layout is not None and not rides.rides(m):
                out.append((layout[1], plan.stages[0].rank_of(m), _target_tag(plan, m)))
    return out


class _SendsTargets:
    """Stage 0's data: reading microbatch m's inputs also sends its target to the last stage,
    unless it rides in an activation message of m to the last stage's rank (`TargetRides`: the
    transport appends it there)."""

    def __init__(self, data: Any, transport: DistributedTransport, plan: Any,
                 routed: set[int], rides: TargetRides) -> None:
        self.data = data
        self.transport = transport
        self.plan = plan
        self.routed = routed
        self.rides = rides
        self.sent: set[int] = set()

    def inputs(self, microbatch: int) -> Any:
        dst = self.plan.stages[-1].rank_of(microbatch)
        if microbatch not in self.sent and dst in self.routed \
                and not self.rides.rides(microbatch):
            self.sent.add(microbatch)
            leaves = pytree.tree_leaves(self.data.target(microbatch))
            if leaves:
                self.transport.send(leaves, dst, _target_tag(self.plan, microbatch))
        return self.data.inputs(microbatch)

    def target(self, microbatch: int) -> Any:
        return self.data.target(microbatch)


class _ReceivesTargets:
    """The last stage's data when it reads none: targets arrive from stage 0, with the
    activations or on their own (`TargetRides`)."""

    def __init__(self, transport: DistributedTransport, plan: Any, rides: TargetRides) -> None:
        self.transport = transport
        self.plan = plan
        self.rides = rides
        self.got: dict[int, Any] = {}
        self.trees: dict[str, Any] = {}

    def inputs(self, microbatch: int) -> Any:
        raise DistributedError(f"the last stage asked for the model inputs of microbatch "
                               f"{microbatch}, which only stage 0 reads")

    def target(self, microbatch: int) -> Any:
        layout = self.rides.layout_of(microbatch)
        if layout is None:
            return None
        if microbatch not in self.got:
            if self.rides.rides(microbatch):
                leaves = self.rides.take(microbatch)
            else:
                src = self.plan.stages[0].rank_of(microbatch)
                leaves = self.transport.recv(layout[1], src,
                                             _target_tag(self.plan, microbatch)).wait()
            tree = self.trees.get(layout[0])
            if tree is None:  # parsed once per layout, not per microbatch
                tree = self.trees[layout[0]] = pytree.treespec_loads(layout[0])
            self.got[microbatch] = pytree.tree_unflatten(leaves, tree)
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


__all__ = ["ANNOUNCE_AHEAD", "DistributedRun", "DistributedTransport", "DistPending", "PeerFailure",
           "backend_for", "drive", "expect_schedule", "reads_data", "run_distributed",
           "schedule_receives", "wire_tag"]

