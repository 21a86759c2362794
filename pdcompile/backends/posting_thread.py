"""gloo's point-to-point calls issued from a thread of their own, in the order the rank made them.

gloo's `isend` writes a message's data into the socket from the calling thread when the receiver
has already posted its receive (which the transport's preposting arranges), and `irecv` writes
the ready-to-receive notice the same way. On the rank that sets the pace of asynchronous 1F1B
(the last stage), the 1 MB gradient's write, the notice and torch.distributed's Python wrappers
took about 0.4 ms of the main thread a minibatch (docs/runtime-profile.md, eighth round). Issued
here, those system calls run beside the rank's compute, on a core the peer leaves idle while it
waits for that very message; the main thread only queues them, and packs a message's tensors
here too (`pack`'s copy). One thread per transport, first in, first out: the calls reach gloo in
the order the rank made them, as they did inline.

Only messages of at least OFF_THREAD_BYTES go there. Handing a message over costs a wake-up of
the thread and its share of the GIL; for the 128 KB microbatch messages of the flush,
interleaved and V schedules, whose inline write costs about 20 us, that cost more CPU than it
saved: the whole process spent about 3 ms a minibatch more under interleaved 1F1B while its
main thread spent 2-4 ms less, and there both ranks' main threads keep both cores busy
(docs/runtime-profile.md, eighth round). Messages of different tags match in gloo whatever the
order they are issued in, so issuing some inline and some here changes nothing else.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

Issue = Callable[[], tuple[list[Any], Any]]  # issues the calls: (their works, what to keep)
# messages this large or larger are issued on the thread (module docstring); the benchmark's
# asynchronous 1F1B sends 1 MB activations and gradients, its microbatched schedules 128 KB
OFF_THREAD_BYTES = 512 << 10


def off_thread(nbytes: int) -> bool:
    """Whether a message of `nbytes` goes to the posting thread."""
    return nbytes >= OFF_THREAD_BYTES


class Posting:
    """One message's calls: a work for `DistPending`, whose `wait()` first waits until the
    thread has issued them (done long before, almost always: the rank waits for a message
    well after it asked for it), then for gloo's works. An error raised while issuing is
    raised here, where the rank waits."""

    __slots__ = ("_issue", "_posted", "error", "keep", "works")

    def __init__(self, issue: Issue, posted: threading.Condition) -> None:
        self._issue: Issue | None = issue
        self._posted = posted
        self.works: list[Any] | None = None
        self.keep: Any = None  # a packed send buffer: alive until its send is waited
        self.error: BaseException | None = None

    def run(self) -> None:
        """Issue the calls (on the posting thread)."""
        issue, self._issue = self._issue, None
        try:
            works, self.keep = issue()  # type: ignore[misc]
        except Exception as err:  # a dead peer: raised where the rank waits
            self.error = err
            works = []
        with self._posted:
            self.works = works
            self._posted.notify_all()

    def wait(self) -> None:
        if self.works is None:
            with self._posted:
                while self.works is None:
                    self._posted.wait()
        if self.error is not None:  # as if raised inline: gloo's errors are RuntimeErrors,
            raise self.error  # which the transport explains (a dead peer named)
        for work in self.works:  # type: ignore[union-attr]
            work.wait()

    def is_completed(self) -> bool:
        return False  # gloo's point-to-point works cannot be polled (backends/distributed.py)


class PostingThread:
    """The thread that issues a transport's gloo calls (started at the first, stopped by
    `close`, or when the transport that owns it is collected)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Posting | None] = queue.SimpleQueue()
        self._posted = threading.Condition()
        self._thread: threading.Thread | None = None

    def post(self, issue: Issue) -> Posting:
        """Queue `issue` (it runs on the thread, after every call queued before it)."""
        job = Posting(issue, self._posted)
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs,),
                                            name="pdcompile-posting", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._jobs.put, None)  # an owner never closed: stop anyway
        self._jobs.put(job)
        return job

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread once it has issued what was queued."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)


def _serve(jobs: queue.SimpleQueue[Posting | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()


__all__ = ["OFF_THREAD_BYTES", "Posting", "PostingThread", "off_thread"]
