"""The compute orders of the V-shaped schedules: ZB-V and DualPipeV, one rank at a time.

Both run on a V (`schedule.placement`): rank r holds chunk 0 (stage r, on the way down) and
chunk 1 (stage 2p - 1 - r, on the way back up), so rank 0 both reads the data and computes the
loss. Both split the backward into B (input gradients) and W (weight gradients) as zero bubble
does; a backward that is not split is written "B W", the two back to back. An order is a list
of (kind, local chunk, microbatch); `generators` turns local chunks into stages.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6, and "Pipeline
Parallelism with Controllable Memory", 2024): rank r first runs 2 (p - r) - 1 forwards of chunk
0, then r pairs (F of chunk 1, F of chunk 0), then p - r triples (F, B, W of chunk 1), which is
where the first microbatch turns round; then, steadily, F B W of chunk 0 and F B W of chunk 1;
then the drain runs the B's first (r pairs B0 B1, then p - r pairs B0 W0) and the W's it
deferred last. Every rank keeps at most 2p microbatch-chunks of activations, the peak of 1F1B's
first stage on the same model (DualPipeV: 2p + 1). Microbatches count as at least 2p - 1 (the
pipeline full once); with fewer, the actions of the missing ones are left out. Two ranks, 4
microbatches (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2)::

    rank 0:  0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3
             0B2 0W2 0B3 0W3
    rank 1:  1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3
             1B3 1W2 2W3 1W3

DualPipeV (DeepSeek-V3 technical report, 2024, and DeepSeek's DualPipe repository): DualPipe's
bidirectional schedule folded onto p ranks. Rank r runs 2 (p - r - 1) forwards of chunk 0, then
r + 1 pairs F0 F1, then p - r - 1 times (B1, a deferred W, F1); then its main phase, m - 2p +
r + 1 times the two overlapped pairs (F0 with the full backward of chunk 1) and (F1 with the
full backward of chunk 0); then p - r - 1 times a full B1 and the pair (F1, full B0); then r + 1
pairs B1 B0 whose second half splits off its W's; then p - r - 1 times (a deferred W, B0); then
the last r + 1 deferred W's. DualPipe runs a pair's forward and backward at once on two
streams so that one's transfers hide under the other's compute; one CPU process runs them one
after the other, so here a pair is two consecutive actions (the forward first). It needs at
least 2p microbatches. Two ranks, 4 microbatches::

    rank 0:  0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 3W3
             0B2 0W2 0B3 0W3
    rank 1:  1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2
             2B3 1B3 2W3 1W3

(rank 0's main phase is its two overlapped pairs "0F3 3B1 3W1" and "3F2 0B0 0W0").
"""

from __future__ import annotations

from collections import deque

from pdcompile.errors import ScheduleError
from pdcompile.schedule.ir import Kind

Order = list[tuple[Kind, int, int]]  # (kind, local chunk 0 or 1, microbatch)


class _Writer:
    """An order being written: the next microbatch of each (kind, chunk) and the W's that wait.

    `full=True` on a backward writes its W right after it; otherwise the W is deferred and
    `deferred()` writes the oldest waiting one."""

    def __init__(self) -> None:
        self.order: Order = []
        self.next: dict[tuple[Kind, int], int] = {}
        self.waiting: deque[tuple[int, int]] = deque()

    def _take(self, kind: Kind, chunk: int) -> int:
        microbatch = self.next.get((kind, chunk), 0)
        self.next[kind, chunk] = microbatch + 1
        return microbatch

    def forward(self, chunk: int) -> None:
        self.order.append((Kind.F, chunk, self._take(Kind.F, chunk)))

    def backward(self, chunk: int, *, full: bool) -> None:
        microbatch = self._take(Kind.B, chunk)
        self.order.append((Kind.B, chunk, microbatch))
        if full:
            self.order.append((Kind.W, chunk, microbatch))
        else:
            self.waiting.append((chunk, microbatch))

    def deferred(self, chunk: int | None = None) -> None:
        """The oldest waiting W (of `chunk`, when given), if any waits."""
        for index, (owner, microbatch) in enumerate(self.waiting):
            if chunk is None or owner == chunk:
                del self.waiting[index]
                self.order.append((Kind.W, owner, microbatch))
                return

    def count(self, kind: Kind, chunk: int) -> int:
        return self.next.get((kind, chunk), 0)


def zbv_order(rank: int, ranks: int, microbatches: int) -> Order:
    """Rank `rank`'s ZB-V order (module docstring) of `microbatches` microbatches."""
    p, r = ranks, rank
    filled = max(microbatches, 2 * p - 1)  # the order of a full pipeline, trimmed below
    out = _Writer()
    for _ in range(2 * (p - r) - 1):
        out.forward(0)
    for _ in range(r):
        out.forward(1)
        out.forward(0)
    for _ in range(p - r):
        out.forward(1)
        out.backward(1, full=True)
    while out.count(Kind.F, 0) < filled or out.count(Kind.F, 1) < out.count(Kind.F, 0):
        if out.count(Kind.F, 0) < filled:
            out.forward(0)
        out.backward(0, full=True)
        out.forward(1)
        out.backward(1, full=True)
    for _ in range(r):
        out.backward(0, full=False)
        out.backward(1, full=False)
    for _ in range(p - r):
        out.backward(0, full=False)
        out.deferred(0)
    while out.waiting:
        out.deferred(1 if any(c == 1 for c, _ in out.waiting) else 0)
    return [(kind, chunk, m) for kind, chunk, m in out.order if m < microbatches]


def dualpipev_order(rank: int, ranks: int, microbatches: int) -> Order:
    """Rank `rank`'s DualPipeV order (module docstring) of `microbatches` >= 2p microbatches."""
    p, r, m = ranks, rank, microbatches
    if m < 2 * p:
        raise ScheduleError(f"'dualpipev' needs at least 2p = {2 * p} microbatches on {p} ranks "
                            f"(got {m}): every rank's main phase overlaps a forward of one "
                            f"chunk with a backward of the other; use microbatches={2 * p}")
    out = _Writer()
    for _ in range(2 * (p - r - 1)):
        out.forward(0)
    for _ in range(r + 1):
        out.forward(0)
        out.forward(1)
    for _ in range(p - r - 1):
        out.backward(1, full=False)
        out.deferred()
        out.forward(1)
    for _ in range(m - 2 * p + r + 1):  # main phase: two overlapped pairs
        out.forward(0)
        out.backward(1, full=True)
        out.forward(1)
        out.backward(0, full=True)
    for _ in range(p - r - 1):
        out.backward(1, full=True)
        out.forward(1)
        out.backward(0, full=True)
    split = False  # the second half of these pairs defers its W's to the drain
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        out.backward(1, full=not split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        out.backward(0, full=not split)
    for _ in range(p - r - 1):
        out.deferred()
        out.backward(0, full=not split)
    while out.waiting:
        out.deferred()
    return out.order


# the order of each V-shaped schedule, by the name of its row in schedule.kinds
V_ORDERS = {"zb-v": zbv_order, "dualpipev": dualpipev_order}

__all__ = ["V_ORDERS", "Order", "dualpipev_order", "zbv_order"]
