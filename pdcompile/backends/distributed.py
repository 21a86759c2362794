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

import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.backends.launch import FaultMonitor, PeerFailure, backend_for
from pdcompile.errors import DistributedError
from pdcompile.ir import Kind, Schedule
from pdcompile.runtime.transport import Pending, Tag, TensorSpec, Transport

_KIND_CODE = {"act": 0, "grad": 1, "target": 2}
_MAX_OPEN_SENDS = 64


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

    `stage_ranks` (every stage's ranks, pipeline order) is needed when any stage is replicated:
    the process groups of replicated stages are created here, by every rank in the same order,
    as torch.distributed requires. `device` is where received tensors are allocated.
    """

    def __init__(self, *, stage_ranks: Sequence[Sequence[int]] = (),
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
        for ranks in stage_ranks:
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
                    "pipeline's stage_ranks to DistributedTransport so that the groups of "
                    "replicated stages are created on every rank")
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


def expect_schedule(transport: DistributedTransport, schedule: Schedule, rank: int,
                    specs: Callable[[Tag], Sequence[TensorSpec]]) -> None:
    """Announce every receive of `rank` in a lowered schedule to the transport (preposting).

    Tags are those the stage runtime uses: ("act", src, dst, m) and ("grad", src, dst, m).
    """
    stage = schedule.stage_of_rank(rank)
    receives = []
    for action in schedule.actions.get(rank, ()):
        if action.kind not in (Kind.RECV_F, Kind.RECV_B) or action.peer is None:
            continue
        kind = "act" if action.kind is Kind.RECV_F else "grad"
        tag = Tag(kind, action.peer, stage, action.microbatch)
        receives.append((specs(tag), schedule.rank_of(action.peer, action.microbatch), tag))
    transport.expect(receives)


def drive(program: Generator[Any, Any, Any], transport: DistributedTransport) -> Any:
    """Run a rank's generator to exhaustion; each yield blocks on what the rank waits for.

    The value a rank yields may be the `Pending` it waits for; otherwise the transport knows the
    last operation the rank found not ready. Returns the generator's return value.
    """
    try:
        value = next(program)
        while True:
            target = value if isinstance(value, Pending) else transport.awaited
            if target is not None and not (isinstance(target, DistPending) and target._done):
                target.wait()
            transport.awaited = None
            value = program.send(None)
    except StopIteration as stop:
        transport.flush()
        return stop.value


__all__ = ["DistributedTransport", "DistPending", "PeerFailure", "backend_for", "drive",
           "expect_schedule", "wire_tag"]
