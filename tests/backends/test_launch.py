"""Launcher, transport over gloo and fault detection, on tiny hand-written programs."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from pdcompile.backends.distributed import DistributedTransport, drive, wire_tag
from pdcompile.backends.launch import (
    LaunchError,
    PeerFailure,
    Worker,
    backend_for,
    connect_store,
    launch,
    open_master_store,
)
from pdcompile.errors import DistributedError
from pdcompile.runtime.transport import Tag, TensorSpec

pytestmark = pytest.mark.timeout(120)

SPEC = (TensorSpec((2, 3), torch.float32), TensorSpec((4,), torch.int64))


def _ring(worker: Worker) -> list[float]:
    """Rank r sends two tensors to r+1 and receives from r-1; receives are preposted."""
    transport = DistributedTransport(monitor=worker.monitor)
    rank, world = worker.rank, worker.world_size
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    transport.expect([(SPEC, prev, Tag("act", prev, rank, m)) for m in range(3)])
    got = []
    for m in range(3):
        payload = [torch.full((2, 3), float(rank * 10 + m)), torch.arange(4) + rank]
        transport.send(payload, nxt, Tag("act", rank, nxt, m))
        a, b = transport.recv(SPEC, prev, Tag("act", prev, rank, m)).wait()
        got.append(float(a[0, 0]) + float(b.sum()))
    transport.flush()
    return got


def _replica_allreduce(worker: Worker) -> list[float]:
    """Stages (0,), (1, 2): ranks 1 and 2 sum two tensors; rank 0 takes no part."""
    transport = DistributedTransport(stage_ranks=[(0,), (1, 2)], monitor=worker.monitor)
    if worker.rank == 0:
        return []
    grads = [torch.full((3,), float(worker.rank)), torch.full((2, 2), 10.0 * worker.rank)]
    transport.all_reduce(grads, [1, 2]).wait()
    return [float(g.sum()) for g in grads]


def _rounds_of_allreduce(worker: Worker) -> tuple[list[list[float]], int, bool]:
    """Two ranks all-reduce the same two tensors for three rounds, and in the last round a
    second pair of as many elements at the same time (as a step's buffer syncs start every
    collective before waiting on any): the sums, how many flat buffers were ever made, and
    whether the first round's buffer served the next rounds."""
    transport = DistributedTransport(monitor=worker.monitor)
    scale = float(worker.rank + 1)
    sums, made, first = [], set(), None
    for round_ in range(3):
        grads = [torch.full((3,), scale * (round_ + 1)), torch.full((2, 2), 10.0 * scale)]
        others = [torch.full((3,), 100.0 * scale), torch.full((2, 2), scale)]
        pending = [transport.all_reduce(grads, [0, 1])]
        if round_ == 2:
            pending.append(transport.all_reduce(others, [0, 1]))
        for p in pending:
            p.wait()
        buffers = [b for free in transport._flat_free.values() for b in free]
        made.update(b.data_ptr() for b in buffers)
        first = buffers[0].data_ptr() if first is None else first
        sums.append([float(g.sum()) for g in grads + (others if round_ == 2 else [])])
    return sums, len(made), first in made


def _generator_program(worker: Worker) -> float:
    """A rank generator in the style of generated code: yields while a receive is not ready."""
    transport = DistributedTransport(monitor=worker.monitor)

    def run_rank() -> object:
        if worker.rank == 0:
            time.sleep(0.2)
            transport.send([torch.ones(5)], 1, Tag("act", 0, 1, 0))
            pending = transport.recv([TensorSpec((5,), torch.float32)], 1, Tag("grad", 1, 0, 0))
        else:
            pending = transport.recv([TensorSpec((5,), torch.float32)], 0, Tag("act", 0, 1, 0))
        while not pending.ready():
            yield
        (value,) = pending.wait()
        if worker.rank == 1:
            transport.send([value * 3], 0, Tag("grad", 1, 0, 0))
        return float(value.sum())

    return float(drive(run_rank(), transport))


@pytest.mark.slow
def test_ring_send_recv_with_preposted_receives() -> None:
    values = launch(_ring, 3, timeout=60)
    for rank, got in enumerate(values):
        prev = (rank - 1) % 3
        assert got == [prev * 10 + m + float((torch.arange(4) + prev).sum()) for m in range(3)]


def _targets_ride_along(worker: Worker) -> tuple[list[list[str]], list[float]]:
    """Rank 0 sends 4 microbatches' activations and targets; rank 1 receives them with the
    default depth (2), noting what is posted ahead before each take."""
    transport = DistributedTransport(monitor=worker.monitor)
    act, target = [TensorSpec((3,), torch.float32)], [TensorSpec((1,), torch.int64)]
    if worker.rank == 0:
        for m in range(4):
            transport.send([torch.full((3,), float(m))], 1, Tag("act", 0, 1, m))
            transport.send([torch.tensor([10 + m])], 1, Tag("target", 0, 1, m))
        transport.flush()
        return [], []
    order = [(act, 0, Tag("act", 0, 1, m)) if kind == "act" else (target, 0, Tag("target", 0, 1, m))
             for m in range(4) for kind in ("act", "target")]
    transport.expect(order)
    ahead, got = [], []
    for specs, src, tag in order:
        ahead.append([f"{t.kind}{t.microbatch}" for t in transport.posted_ahead(src)])
        got.append(float(transport.recv(specs, src, tag).wait()[0].sum()))
    return ahead, got


@pytest.mark.slow
def test_prepost_depth_counts_microbatches_not_their_targets() -> None:
    """A target rides with its activations: depth 2 posts two microbatches ahead, targets
    included (counted on their own, the last stage received one microbatch ahead)."""
    ahead, got = launch(_targets_ride_along, 2, timeout=60)[1]
    assert ahead[0] == ["act0", "target0", "act1", "target1"]
    assert ahead[2] == ["act1", "target1", "act2", "target2"]  # refilled as each is taken
    assert got == [0.0, 10.0, 3.0, 11.0, 6.0, 12.0, 9.0, 13.0]


@pytest.mark.slow
def test_all_reduce_over_replica_group_and_generator_driver() -> None:
    assert launch(_replica_allreduce, 3, timeout=60) == [[], [9.0, 120.0], [9.0, 120.0]]
    assert launch(_generator_program, 2, timeout=60) == [15.0, 5.0]


@pytest.mark.slow
def test_all_reduce_reuses_its_flat_buffer_round_after_round() -> None:
    """A replicated stage's gradients all-reduce through one flat buffer kept between rounds
    (a fresh one beyond malloc's mmap threshold faulted in every page each round), and two
    all-reduces in flight at once never share one."""
    for sums, made, reused in launch(_rounds_of_allreduce, 2, timeout=60):
        assert sums == [[9.0, 120.0], [18.0, 120.0], [27.0, 120.0, 900.0, 12.0]]
        assert made == 2 and reused


def _killed_mid_run(worker: Worker) -> None:
    """Rank 1 dies by SIGKILL; rank 0 waits on it directly, rank 2 waits on rank 0."""
    transport = DistributedTransport(monitor=worker.monitor)
    spec = [TensorSpec((1,), torch.float32)]
    if worker.rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    elif worker.rank == 0:
        transport.recv(spec, 1, Tag("act", 1, 0, 0)).wait()
    else:
        transport.recv(spec, 0, Tag("act", 0, 2, 0)).wait()


def _raises(worker: Worker) -> None:
    transport = DistributedTransport(monitor=worker.monitor)
    if worker.rank == 1:
        time.sleep(0.3)
        raise ValueError("bad things in stage 1")
    transport.recv([TensorSpec((1,), torch.float32)], 1, Tag("act", 1, 0, 0)).wait()


def _hangs(worker: Worker) -> None:
    """Rank 1 stops (SIGSTOP) without dying: only heartbeats can tell."""
    transport = DistributedTransport(monitor=worker.monitor)
    if worker.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSTOP)
    transport.recv([TensorSpec((1,), torch.float32)], 1, Tag("act", 1, 0, 0)).wait()


@pytest.mark.slow
@pytest.mark.parametrize("program", [_killed_mid_run, _raises])
def test_dead_worker_stops_the_others_naming_it(program: object) -> None:
    bound = 3.0
    with pytest.raises(LaunchError) as info:
        launch(program, 3, timeout=60, fault_timeout=bound)  # type: ignore[arg-type]
    err = info.value
    assert "rank 1" in str(err).splitlines()[0]
    died_at = err.died_at or err.outcomes[1].finished_at
    assert died_at is not None
    for outcome in err.outcomes:
        if outcome.rank == 1:
            continue
        assert isinstance(outcome.error, PeerFailure), outcome.error
        assert outcome.error.dead_rank == 1
        assert "rank 1 died" in str(outcome.error)
        assert outcome.finished_at is not None and outcome.finished_at - died_at < bound + 1.0


@pytest.mark.slow
def test_hung_worker_is_detected_by_heartbeat() -> None:
    bound = 2.0
    start = time.time()
    with pytest.raises(LaunchError) as info:
        launch(_hangs, 2, timeout=60, fault_timeout=bound)
    survivor = info.value.outcomes[0]
    assert isinstance(survivor.error, PeerFailure) and survivor.error.dead_rank == 1
    assert "stopped responding for" in str(survivor.error)
    assert time.time() - start < 30


def _sleeps(worker: Worker) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_whole_run_timeout_kills_every_process() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within 4 s") as info:
        launch(_sleeps, 2, timeout=4)
    assert time.monotonic() - start < 20
    assert all(o.exitcode is not None for o in info.value.outcomes)


def test_port_in_use_and_unreachable_master_have_clear_messages() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedError, match=f"port {port} on 127.0.0.1 is already in use"):
            open_master_store("127.0.0.1", port)
        with pytest.raises(DistributedError, match="already in use"):
            launch(_sleeps, 2, master_port=port, timeout=5)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    with pytest.raises(DistributedError, match=f"cannot reach the master at 127.0.0.1:{closed}"):
        connect_store("127.0.0.1", closed, timeout=1.0)


def test_backend_follows_the_device_and_wire_tags_are_distinct() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for("cuda:0") == "nccl"
    tags = {wire_tag(Tag(kind, s, s + 1, m, name), i)
            for kind in ("act", "grad", "target") for s in range(4) for m in range(64)
            for name in ("x", "h") for i in range(2)}
    assert len(tags) == 3 * 4 * 64 * 2 * 2
    assert all(0 <= t < 2**31 for t in tags)
