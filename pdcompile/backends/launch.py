"""Starting worker processes and noticing when one of them dies (fault detection).

`launch(fn, nprocs)` spawns `nprocs` processes on this machine, hosts the rendezvous TCPStore in
the parent (so it outlives any worker), initialises a process group in each child and calls
`fn(worker, *args)`. Every run is bounded: a hard `timeout` for the whole run and a
`fault_timeout` within which the survivors of a dead worker stop.

Fault detection (`FaultMonitor`, one per worker, also used under torchrun) works over the store:

- each worker registers its host and pid and bumps a heartbeat counter from a daemon thread;
- the first party that learns of a failure writes one record, `fault`, with the dead rank and the
  reason (compare-and-set: the first cause wins, later echoes do not overwrite it). Writers: a
  worker whose code raised, the launcher when a child exits without reporting, a monitor that sees
  a same-host pid vanish or a heartbeat stop for `fault_timeout` seconds;
- communication waits call `FaultMonitor.check()` before blocking and turn a transport error
  (gloo: "Connection closed by peer") into `PeerFailure` naming the dead rank from the record;
- a worker blocked in a wait that no transport error will ever end (a peer that hangs rather than
  dies) is stopped by its monitor thread: it reports the `PeerFailure` and exits the process;
- a peer on this host whose heartbeat stopped (frozen: SIGSTOP, a debugger) is killed by the
  worker that names it, so that the launcher waiting for it can end.

No worker outlives its launcher (`end_with_launcher`): each asks the kernel for SIGKILL when its
parent dies (Linux), and a thread ends it when the launcher's pid is gone (`LAUNCHER_ENV`, set by
`pdcompile run` above torchrun; `launch` passes its own pid).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pickle
import queue as queue_mod
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdcompile.backends.listen import open_store
from pdcompile.errors import DistributedError

DEFAULT_FAULT_TIMEOUT = 8.0
_PREFIX = "pdcompile"
# the pid of the process that launched the workers (`pdcompile run`); workers end without it
LAUNCHER_ENV = "PDCOMPILE_LAUNCHER_PID"
# the run's secret key prefix (`run_token`), passed by the launcher to its workers
TOKEN_ENV = "PDCOMPILE_RUN_TOKEN"
# a file where the first cause of a failure is written (set by `pdcompile run` for its last line)
CAUSE_ENV = "PDCOMPILE_FAULT_CAUSE"
_PR_SET_PDEATHSIG = 1


class PeerFailure(DistributedError):
    """This worker stops because another one (`dead_rank`) died or failed."""

    def __init__(self, message: str, *, dead_rank: int, reason: str) -> None:
        super().__init__(message)
        self.dead_rank = dead_rank
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_peer_failure, (str(self), self.dead_rank, self.reason))


def _rebuild_peer_failure(message: str, dead_rank: int, reason: str) -> PeerFailure:
    return PeerFailure(message, dead_rank=dead_rank, reason=reason)


def backend_for(device: Any) -> str:
    """The torch.distributed backend for a device: NCCL for CUDA, gloo otherwise."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return "nccl" if kind == "cuda" else "gloo"


def open_master_store(addr: str, port: int, *, timeout: float = 60.0) -> tuple[Any, Any]:
    """Host the rendezvous TCPStore on `addr:port` only (0 picks a free port; backends/listen):
    the store and its listening socket (keep both while the run lasts)."""
    return open_store(addr, port, timeout=timeout)


def run_token() -> str:
    """The secret part of a run's key names (`TOKEN_ENV`), new for each run: the store has no
    authentication, so a program that did not start the run cannot guess where to write a
    fault record that would stop it."""
    return secrets.token_hex(16)


def connect_store(addr: str, port: int, *, timeout: float = 60.0) -> Any:
    """A client of the rendezvous TCPStore at `addr:port`, with a clear error if unreachable."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout))
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DistributedError(
            f"cannot reach the master at {addr}:{port} within {timeout:g} s ({first}); check "
            "that the master (rank 0 / torchrun --master-addr) is running and reachable from this "
            "machine, and that MASTER_ADDR/MASTER_PORT (or --master-addr/--master-port) are "
            "right") from None


# ----------------------------------------------------------------------------------------------
# Worker side: fault monitor


@dataclass
class FaultMonitor:
    """Watches the other workers of one run through the store (see module docstring)."""

    store: Any
    rank: int
    world_size: int
    fault_timeout: float = DEFAULT_FAULT_TIMEOUT
    namespace: str = "0"
    on_hard_stop: Callable[[DistributedError], None] | None = None
    _fault: tuple[int, str] | None = field(default=None, init=False)
    _blocked_since: float | None = field(default=None, init=False)
    # the main thread's progress (backends/watchdog.py): a count it bumps, and what it does
    _ticks: int = field(default=0, init=False)
    _doing: str | Callable[[], str] = field(default="", init=False)
    _waiting: str | Callable[[], str] = field(default="", init=False)
    _busy: bool = field(default=False, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def _key(self, *parts: object) -> str:
        return "/".join([_PREFIX, self.namespace, *map(str, parts)])

    @property
    def period(self) -> float:
        """Seconds between two heartbeats (and two looks at the others)."""
        return max(0.02, min(0.25, self.fault_timeout / 8))

    def start(self) -> FaultMonitor:
        """Register this worker and start the heartbeat thread."""
        self.store.set(self._key("pid", self.rank), f"{socket.gethostname()}:{os.getpid()}")
        self.store.add(self._key("hb", self.rank), 1)
        self._thread = threading.Thread(target=self._loop, name=f"pdcompile-monitor-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, *, done: bool = True) -> None:
        """Stop the heartbeat; `done` tells the others this worker finished on purpose."""
        if done:
            try:
                self.store.set(self._key("done", self.rank), "1")
            except Exception:  # the store is gone: nothing left to tell
                pass
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 1)

    # -- fault records ------------------------------------------------------------------------

    def report(self, dead_rank: int, reason: str) -> tuple[int, str]:
        """Record a failure (the first record wins); returns the record in force."""
        record = json.dumps({"rank": dead_rank, "reason": reason})
        try:
            current = self.store.compare_set(self._key("fault"), "", record)
        except Exception:
            current = None
        self._fault = self._parse(current) or self._fault or (dead_rank, reason)
        if self._fault == (dead_rank, reason):
            write_cause(dead_rank, reason)
        return self._fault

    def _read_fault(self) -> tuple[int, str] | None:
        key = self._key("fault")
        if not self.store.check([key]):
            return None
        return self._parse(self.store.get(key))

    def _parse(self, value: Any) -> tuple[int, str] | None:
        """A fault record, or None for anything that is not one of this run's (malformed,
        or naming a rank the run does not have): such a record is ignored, never trusted."""
        try:
            data = json.loads(value.decode() if isinstance(value, bytes) else value)
            rank, reason = data["rank"], data["reason"]
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            return None
        if type(rank) is not int or not 0 <= rank < self.world_size or \
                not isinstance(reason, str):
            return None
        return rank, reason[:2000]

    def error(self) -> PeerFailure | None:
        """The failure this worker must stop for, if any is known."""
        if self._fault is None or self._fault[0] == self.rank:
            return None
        dead, reason = self._fault
        return PeerFailure(f"rank {self.rank} stops: rank {dead} died or failed ({reason})",
                           dead_rank=dead, reason=reason)

    def check(self) -> None:
        """Raise `PeerFailure` if another worker is known to have died (called around every
        message: the usual case, no fault known, reads one attribute)."""
        if self._fault is None:
            return
        err = self.error()
        if err is not None:
            raise err

    def explain(self, peer: int, err: BaseException, *, what: str) -> PeerFailure:
        """Turn a transport error while talking to `peer` into the `PeerFailure` to raise.

        Waits up to `fault_timeout` for the record of the root cause (the launcher or the dead
        worker's own report); if none comes, blames `peer`.
        """
        deadline = time.monotonic() + self.fault_timeout
        while time.monotonic() < deadline:
            if self._fault is None:
                try:
                    self._fault = self._read_fault()
                except Exception:  # the store died with its host: blame the peer below
                    break
            if self._fault is not None:
                break
            time.sleep(self.period / 2)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if self._fault is None or self._fault[0] == self.rank:
            self.report(peer, f"lost the connection during {what}: {first}")
        failure = self.error()
        if failure is None:  # the record in force names this rank: the loss is the news
            failure = PeerFailure(f"rank {self.rank} stops: lost the connection to rank {peer} "
                                  f"during {what} ({first})", dead_rank=peer,
                                  reason=f"lost the connection during {what}: {first}")
        return failure

    def _waiting_text(self) -> str:
        what = self._waiting
        return what if isinstance(what, str) else what()

    def blocking(self, what: str | Callable[[], str] = "") -> _Blocking:
        """Mark a blocking wait (on other ranks, `what`: words, or a function that gives them,
        called only when the wait is reported), so that the monitor can stop a worker stuck in
        it; time spent waiting for others is not this rank's lack of progress."""
        return _Blocking(self, what)

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Mark work of this rank that takes long without a tick (saving a checkpoint): not a
        lack of progress, and not a wait for others either."""
        before = self._doing
        self._busy = True
        self._doing = what
        try:
            yield
        finally:
            self._busy = False
            self._doing = before
            if self._ticks:
                self._ticks += 1

    def disarm(self) -> None:
        """Stop watching this rank's progress (its training ended; `progress` arms again)."""
        self._ticks = 0

    def progress(self, doing: str | Callable[[], str] | None = None) -> None:
        """Mark progress of this rank's main thread (and, if given, what it does next): a rank
        that is neither waiting for others nor progressing for `fault_timeout` seconds names
        itself and stops (blocked in the data function, the model, or a hang)."""
        self._ticks += 1
        if doing is not None:
            self._doing = doing

    def activity(self) -> str | Callable[[], str]:
        """What `progress` was last told this rank does."""
        return self._doing

    # -- the thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        fault_seen_at: float | None = None
        store_lost_at: float | None = None
        host = socket.gethostname()
        ticks = (self._ticks, time.monotonic())
        while not self._stop.wait(self.period):
            now = time.monotonic()
            if self._ticks != ticks[0] or self._blocked_since is not None or self._busy:
                ticks = (self._ticks, now)
            blocked = self._blocked_since
            waited = now - blocked if blocked is not None else 0.0
            try:
                self.store.add(self._key("hb", self.rank), 1)
                waiting = f"{waited:.1f}|{self._waiting_text()}" if blocked is not None else ""
                self.store.set(self._key("wait", self.rank), waiting)
                if self._fault is None:
                    self._fault = self._read_fault()
                if self._fault is None and self._ticks and now - ticks[1] > self.fault_timeout:
                    self._stuck(now - ticks[1])
                if self._fault is None and waited > self.fault_timeout:
                    self._deadlock(waited)
                if self._fault is None:
                    self._look_at_peers(seen, now, host)
                store_lost_at = None
            except Exception:
                store_lost_at = store_lost_at or now
                if now - store_lost_at > self.fault_timeout and self._fault is None:
                    self._fault = (0, "the rendezvous store (master) stopped answering")
            if self._fault is not None:
                fault_seen_at = fault_seen_at or now
                blocked = self._blocked_since
                stuck = blocked is not None and now - max(blocked, fault_seen_at)
                if stuck and stuck > self.fault_timeout / 2:
                    self._hard_stop()

    def _stuck(self, seconds: float) -> None:
        """This rank's main thread made no progress for `seconds` while not waiting for any
        other rank: name it (it is the cause) and end the process, whose main thread is stuck."""
        try:
            what = self._doing() if callable(self._doing) else self._doing
        except Exception:  # read from another thread: best effort
            what = ""
        doing = f" while {what}" if what else ""
        reason = f"made no progress for {seconds:.1f} s{doing} (--fault-timeout " \
                 f"{self.fault_timeout:g})"
        record = self.report(self.rank, reason)
        if record[0] != self.rank:
            return  # another cause was recorded first: the usual stop follows
        failure = DistributedError(f"rank {self.rank} {reason}; it was stopped")
        if self.on_hard_stop is not None:
            try:
                self.on_hard_stop(failure)
            except Exception:
                pass
        os.write(2, f"pdcompile: {failure}\n".encode())
        os._exit(1)

    def _look_at_peers(self, seen: dict[int, tuple[int, float]], now: float, host: str) -> None:
        for peer in range(self.world_size):
            if peer == self.rank or self.store.check([self._key("done", peer)]):
                continue
            beats = int(self.store.add(self._key("hb", peer), 0))
            last = seen.get(peer)
            if last is None or beats != last[0]:
                seen[peer] = (beats, now)
            elif now - last[1] > self.fault_timeout:
                silent = now - last[1]
                same_host = self._host_of(peer) == host
                reason = f"stopped responding for {silent:.1f} s" + (
                    " and was killed" if same_host else "")
                record = self.report(peer, reason)
                if record[0] == peer and same_host:
                    self._kill_frozen(peer, host)
                return
            pid_key = self._key("pid", peer)
            if beats and self.store.check([pid_key]):
                peer_host, _, pid = self.store.get(pid_key).decode().rpartition(":")
                if peer_host == host and not _pid_alive(int(pid)):
                    if not self.store.check([self._key("done", peer)]):
                        self.report(peer, f"process {pid} is gone")
                        return

    def _host_of(self, peer: int) -> str | None:
        try:
            return str(self.store.get(self._key("pid", peer)).decode().rpartition(":")[0])
        except Exception:
            return None

    def _kill_frozen(self, peer: int, host: str) -> None:
        """A peer on this host that stopped beating is frozen (or stuck in the kernel): kill
        it, so that its launcher sees it end (it is already declared failed)."""
        try:
            peer_host, _, pid = self.store.get(self._key("pid", peer)).decode().rpartition(":")
            if peer_host == host and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, RuntimeError):
            pass

    def _deadlock(self, waited: float) -> None:
        """Every live rank has waited for another for most of `fault_timeout`: none can make
        progress (generated loops that disagree, a missed collective). Name the lowest one."""
        waits: dict[int, str] = {}
        for peer in range(self.world_size):
            if peer != self.rank and self.store.check([self._key("done", peer)]):
                continue
            if peer == self.rank:
                waits[peer] = self._waiting_text()
                continue
            text = self.store.get(self._key("wait", peer)).decode() \
                if self.store.check([self._key("wait", peer)]) else ""
            seconds, _, what = text.partition("|")
            try:
                if not text or float(seconds) < self.fault_timeout / 2:
                    return  # that rank is working (or was, a moment ago)
            except ValueError:
                return
            waits[peer] = what
        first = min(waits)
        detail = "; ".join(f"rank {r} waits for {w or 'a collective'}" for r, w in
                           sorted(waits.items()))
        self.report(first, f"made no progress for {waited:.1f} s: every rank is waiting for "
                           f"another ({detail})")

    def _hard_stop(self) -> None:
        failure: DistributedError | None = self.error()
        if failure is None and self._fault is not None:  # the record names this rank
            failure = DistributedError(f"rank {self.rank} {self._fault[1]}; it was stopped")
        if failure is None:
            return
        if self.on_hard_stop is not None:
            try:
                self.on_hard_stop(failure)
            except Exception:
                pass
        else:
            print(f"pdcompile: {failure}", flush=True)
        os._exit(1)


def write_cause(rank: int, reason: str) -> None:
    """Leave the first cause of a failure where the launcher reads it (`CAUSE_ENV`), once."""
    path = os.environ.get(CAUSE_ENV)
    if not path or os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as out:
            out.write(json.dumps({"rank": rank, "reason": reason}))
        os.replace(tmp, path)
    except OSError:
        pass


def describe_cause(rank: int, reason: str) -> str:
    """'rank 1 stopped responding for 8.0 s and was killed', from a fault record."""
    if reason.startswith(f"rank {rank} "):
        return reason
    words = ("made ", "stopped ", "lost ", "no ", "process ", "exited ", "was ", "killed ")
    return f"rank {rank} {reason}" if reason.startswith(words) else f"rank {rank} failed: {reason}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is dead for our purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


# ----------------------------------------------------------------------------------------------
# Worker side: no worker outlives its launcher


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux' prctl
    PR_SET_PDEATHSIG; False where it is not available)."""
    if os.uname().sysname != "Linux":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def parent_death_preexec(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen that gives the child `sig` when this process dies
    (Linux; None elsewhere). libc is looked up here, not in the forked child."""
    if os.uname().sysname != "Linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec


def end_with_launcher(launcher_pid: int | None, *, what: str = "this worker",
                      period: float = 0.2) -> None:
    """End this process (exit status 1, one line on stderr) once the launcher is gone.

    Two guards: the kernel's SIGKILL when the direct parent dies (Linux), and a daemon thread
    that checks every `period` seconds that `launcher_pid` (the process the user started,
    which may be the parent's parent, as `pdcompile run` is torchrun's) still exists. Either
    way no worker keeps running, or holding a port or memory, after its launcher was killed.
    """
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    watched = [pid for pid in (launcher_pid, parent) if pid and pid > 1]
    if os.getppid() != parent or not all(_pid_alive(pid) for pid in watched):
        _gone(what, launcher_pid or parent)  # the launcher died before the guard was set

    def watch() -> None:
        while True:
            time.sleep(period)
            for pid in watched:
                if not _pid_alive(pid):
                    _gone(what, pid)

    threading.Thread(target=watch, name="pdcompile-launcher-watch", daemon=True).start()


def _gone(what: str, pid: int) -> None:
    try:
        os.write(2, f"pdcompile: {what} stops: its launcher (pid {pid}) is gone\n".encode())
    finally:
        os._exit(1)


def launcher_from_env() -> int | None:
    """The launcher's pid that `pdcompile run` passes its workers (None: not started by it)."""
    text = os.environ.get(LAUNCHER_ENV, "")
    return int(text) if text.isdigit() else None


class _Blocking:
    """`FaultMonitor.blocking`'s context: a class, not a generator-based context, because every
    message a rank sends or receives enters one (a generator-based context costs about 5
    Python calls more each time; docs/runtime-profile.md, seventh round)."""

    __slots__ = ("_monitor", "_what")

    def __init__(self, monitor: FaultMonitor, what: str | Callable[[], str]) -> None:
        self._monitor = monitor
        self._what = what

    def __enter__(self) -> None:
        monitor = self._monitor
        monitor.check()
        monitor._blocked_since = time.monotonic()
        monitor._waiting = self._what

    def __exit__(self, *exc: object) -> None:
        monitor = self._monitor
        monitor._blocked_since = None
        if monitor._ticks:  # progress, once the watchdog is armed
            monitor._ticks += 1


# ----------------------------------------------------------------------------------------------
# Worker side: process-group set-up


@dataclass
class Worker:
    """What `fn` receives in each launched process."""

    rank: int
    world_size: int
    monitor: FaultMonitor
    backend: str


def init_worker(*, rank: int, world_size: int, master_addr: str, master_port: int,
                backend: str = "gloo", fault_timeout: float = DEFAULT_FAULT_TIMEOUT,
                connect_timeout: float = 60.0, namespace: str = "0",
                on_hard_stop: Callable[[DistributedError], None] | None = None) -> Worker:
    """Join the rendezvous, initialise the default process group, start the fault monitor."""
    import torch.distributed as dist

    store = connect_store(master_addr, master_port, timeout=connect_timeout)
    pg_store = dist.PrefixStore(f"{_PREFIX}/{namespace}/pg", store)
    dist.init_process_group(backend, store=pg_store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=max(connect_timeout, 60.0)))
    monitor_store = connect_store(master_addr, master_port, timeout=connect_timeout)
    monitor = FaultMonitor(monitor_store, rank, world_size, fault_timeout, namespace,
                           on_hard_stop).start()
    return Worker(rank, world_size, monitor, backend)


def monitor_from_env(*, rank: int, world_size: int,
                     fault_timeout: float = DEFAULT_FAULT_TIMEOUT) -> FaultMonitor | None:
    """A monitor for a process group someone else initialised (torchrun: MASTER_ADDR/PORT)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = connect_store(addr, int(port), timeout=30.0)
    namespace = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    token = os.environ.get(TOKEN_ENV, "")
    namespace = f"{run_id}-{namespace}" if run_id else namespace
    return FaultMonitor(store, rank, world_size, fault_timeout,
                        f"{token}/{namespace}" if token else namespace).start()


def _child(fn: Callable[..., Any], rank: int, world_size: int, master_addr: str,
           master_port: int, backend: str, fault_timeout: float, results: Any,
           args: tuple[Any, ...], launcher: int | None = None, namespace: str = "0") -> None:
    end_with_launcher(launcher, what=f"rank {rank}")
    import torch
    import torch.distributed as dist

    from pdcompile.runtime.allocator import tune_allocator

    torch.set_num_threads(1)
    tune_allocator()

    def hard_stop(failure: DistributedError) -> None:
        results.put((rank, "error", failure, time.time()))
        results.close()
        results.join_thread()

    worker: Worker | None = None
    try:
        worker = init_worker(rank=rank, world_size=world_size, master_addr=master_addr,
                             master_port=master_port, backend=backend,
                             fault_timeout=fault_timeout, on_hard_stop=hard_stop,
                             namespace=namespace)
        value = fn(worker, *args)
        worker.monitor.stop(done=True)
        # plain pickle: tensors travel by value, not as shared-memory handles that die with us
        results.put((rank, "ok", pickle.dumps(value), time.time()))
    except PeerFailure as err:
        results.put((rank, "error", err, time.time()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which re-raises
        reason = f"{type(err).__name__}: {err}"
        if worker is not None:
            worker.monitor.report(rank, reason)
        detail = traceback.format_exc()
        if isinstance(err, DistributedError):
            exc: BaseException = DistributedError(str(err))
        else:
            exc = DistributedError(f"rank {rank} raised {reason}\n{detail}")
        results.put((rank, "error", exc, time.time()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        if worker is not None:
            worker.monitor.stop(done=False)
        results.close()
        results.join_thread()


# ----------------------------------------------------------------------------------------------
# Parent side


@dataclass
class RankOutcome:
    """How one worker ended: its return value or its error, and when (time.time())."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    finished_at: float | None = None
    exitcode: int | None = None


class LaunchError(DistributedError):
    """A launched run failed; `outcomes` has every rank's result or error."""

    def __init__(self, message: str, outcomes: Sequence[RankOutcome], *,
                 dead_rank: int | None, died_at: float | None) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)
        self.dead_rank = dead_rank
        self.died_at = died_at


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def launch(fn: Callable[..., Any], nprocs: int, *, args: tuple[Any, ...] = (),
           backend: str = "gloo", timeout: float = 300.0,
           fault_timeout: float = DEFAULT_FAULT_TIMEOUT, master_addr: str = "127.0.0.1",
           master_port: int = 0) -> list[Any]:
    """Run `fn(worker, *args)` in `nprocs` new processes; returns their values by rank.

    `fn` must be importable (a module-level function). Raises `LaunchError` (a
    DistributedError) if any worker fails, with the root cause first; all processes are gone
    when this returns or raises, at most `timeout` seconds after the start (plus a few seconds
    to reap them).
    """
    if nprocs < 1:
        raise DistributedError(f"nprocs must be a positive integer ({nprocs} < 1)")
    store, listener = open_master_store(master_addr, master_port)
    port = int(store.port)
    namespace = run_token()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, name=f"pdcompile-rank-{rank}", daemon=True,
                         args=(fn, rank, nprocs, master_addr, port, backend, fault_timeout,
                               results, args, os.getpid(), namespace))
             for rank in range(nprocs)]
    outcomes = [RankOutcome(rank) for rank in range(nprocs)]
    start = time.monotonic()
    dead_rank: int | None = None
    died_at: float | None = None
    for proc in procs:
        proc.start()
    try:
        pending = set(range(nprocs))
        gone_since: dict[int, float] = {}
        fault_at: float | None = None
        while pending:
            if fault_at is None and any(o.error is not None for o in outcomes):
                fault_at = time.monotonic()
            if fault_at is not None and time.monotonic() - fault_at > fault_timeout + 2.0:
                for rank in sorted(pending):
                    procs[rank].kill()
                    outcomes[rank].error = DistributedError(
                        f"rank {rank} did not stop within {fault_timeout + 2.0:g} s after the "
                        "failure (it was killed)")
                    outcomes[rank].finished_at = time.time()
                break
            if time.monotonic() - start > timeout:
                for proc in procs:
                    proc.kill()
                raise LaunchError(
                    f"the run did not finish within {timeout:g} s; ranks still running: "
                    f"{sorted(pending)} (they were stopped)", outcomes,
                    dead_rank=dead_rank, died_at=died_at)
            try:
                rank, status, payload, when = results.get(timeout=0.05)
                outcome = outcomes[rank]
                outcome.finished_at = when
                if status == "ok":
                    outcome.value = pickle.loads(payload)
                else:
                    outcome.error = payload
                pending.discard(rank)
                continue
            except queue_mod.Empty:
                pass
            for rank in sorted(pending):
                code = procs[rank].exitcode
                if code is None:
                    continue
                # exited without a result: give its queue writes a moment to arrive first
                first = gone_since.setdefault(rank, time.monotonic())
                if time.monotonic() - first < 0.5:
                    continue
                pending.discard(rank)
                outcomes[rank].exitcode = code
                outcomes[rank].finished_at = time.time()
                outcomes[rank].error = DistributedError(f"rank {rank} {_describe_exit(code)}")
                if dead_rank is None:
                    dead_rank, died_at = rank, time.time()
                    _record_fault(store, namespace, rank, _describe_exit(code))
    finally:
        _reap(procs)
        results.close()
        listener.close()
        for proc, outcome in zip(procs, outcomes, strict=True):
            outcome.exitcode = proc.exitcode
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        raise LaunchError(_summary(failed, dead_rank), outcomes, dead_rank=dead_rank,
                          died_at=died_at)
    return [o.value for o in outcomes]


def _record_fault(store: Any, namespace: str, rank: int, reason: str) -> None:
    record = json.dumps({"rank": rank, "reason": reason})
    try:
        store.compare_set(f"{_PREFIX}/{namespace}/fault", "", record)
    except Exception:
        pass


def _summary(failed: list[RankOutcome], dead_rank: int | None) -> str:
    roots = [o for o in failed if not isinstance(o.error, PeerFailure)]
    if dead_rank is not None:
        roots.sort(key=lambda o: o.rank != dead_rank)
    lines = [f"rank {o.rank}: {o.error}" for o in roots + [o for o in failed if o not in roots]]
    head = roots[0] if roots else failed[0]
    return (f"distributed run failed: rank {head.rank} failed first "
            f"({str(head.error).splitlines()[0]})\n" + "\n".join(lines))


def _reap(procs: Sequence[Any]) -> None:
    """Join every process, terminating then killing any that linger."""
    deadline = time.monotonic() + 3.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
