"""run_distributed reproduces the local backend (Pipeline.train) across processes.

Same seeds and one thread per process: the losses and the final weights of every schedule
('1f1b' with stashing, '1f1b-flush', 'gpipe', '2bw'), on 2, 3 and 4 processes, with and without
replicated stages and with a parameter tied across stages, equal those of the local backend on an
identical pipeline to float rounding. Several configurations share one launch (one world size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.backends.launch import Worker, launch
from pdcompile.timeline import Timeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WIDTH, BATCH = 12, 8


@dataclass(frozen=True)
class Case:
    """One pipeline configuration trained for `steps` minibatches."""

    schedule: str
    replicas: tuple[int, ...]
    steps: int
    micro: int | None = None
    model: str = "mlp"
    record: bool = False
    vertical_sync: bool = False


class Tied(nn.Module):
    """An embedding whose weight the output layer reuses: the tie spans the first and last
    stage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, WIDTH)
        self.mid = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                                 nn.Tanh())
        self.head = nn.Linear(WIDTH, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(idx).mean(1)))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "tied":
        return Tied()
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 3))


def _batches(kind: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    if kind == "tied":
        return [(torch.randint(0, 20, (BATCH, 3), generator=gen),
                 torch.randint(0, 20, (BATCH,), generator=gen)) for _ in range(steps)]
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(steps)]


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _pipeline(case: Case) -> Any:
    example = _batches(case.model, 1)[0]
    return pdcompile.compile(_model(case.model), example_inputs=(example[0],),
                             example_target=example[1], loss_fn=nn.functional.cross_entropy,
                             optimizer=momentum, schedule=case.schedule, microbatches=case.micro,
                             stages=list(case.replicas), vertical_sync=case.vertical_sync)


def _weights(pipe: Any, rank: int) -> dict[str, torch.Tensor]:
    """A rank's parameters under the model's names."""
    state = pipe.ranks[rank]
    program = pipe.parts.stages[state.stage]
    return {original: p.detach().clone()
            for name, p in state.module.named_parameters(remove_duplicate=False)
            for original in program.param_names.get(name, (name,))}


def _train(worker: Worker, cases: list[Case]) -> list[dict[str, Any]]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    out = []
    for case in cases:
        pipe = _pipeline(case)
        seen: list[tuple[int, float]] = []
        # only stage 0 reads the data: the last stage gets its targets over the wire
        batches = iter(_batches(case.model, case.steps)) if reads_data(pipe, worker.rank) \
            else None
        # the public entry point: Pipeline.run_distributed delegates to the backend
        train = pipe.run_distributed if case.record else functools.partial(run_distributed, pipe)
        run = train(batches,
                              monitor=worker.monitor, record=case.record,
                              progress=lambda step, loss, seen=seen: seen.append((step, loss)))
        out.append({"losses": run.losses, "weights": _weights(pipe, worker.rank),
                    "progress": seen, "stage": run.stage, "samples": run.samples,
                    "timeline": run.timeline, "steps": run.steps})
    return out


def _check(cases: list[Case], nproc: int) -> list[list[dict[str, Any]]]:
    results = launch(_train, nproc, args=(cases,), timeout=240)
    for index, case in enumerate(cases):
        pipe = _pipeline(case)
        want = pipe.train(_batches(case.model, case.steps))
        state = {k: v.detach() for k, v in pipe.named_parameters().items()}
        runs = [results[rank][index] for rank in range(nproc)]
        for run in runs:  # every rank returns the same losses: those of the local backend
            assert run["losses"] == runs[0]["losses"]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want),
                                       msg=lambda m, c=case: f"{c}: {m}")
            assert run["samples"] == BATCH * case.steps and run["steps"] == case.steps
        weights: dict[str, torch.Tensor] = {}
        for run in runs:
            for name, value in run["weights"].items():
                if name in weights:  # replicas (and tied copies) hold identical weights
                    torch.testing.assert_close(value, weights[name],
                                               msg=lambda m, c=case, n=name: f"{c} {n}: {m}")
                weights.setdefault(name, value)
        assert sorted(weights) == sorted(state), case
        for name, value in state.items():
            torch.testing.assert_close(weights[name], value,
                                       msg=lambda m, c=case, n=name: f"{c} {n}: {m}")
        reporter = pipe.plan.stages[-1].ranks[0]
        assert [s for s, _ in runs[reporter]["progress"]] == list(range(case.steps))
        assert [v for _, v in runs[reporter]["progress"]] == runs[0]["losses"]
        assert all(not r["progress"] for i, r in enumerate(runs) if i != reporter)
    return results


def test_two_processes_every_schedule_and_a_tied_parameter() -> None:
    _check([Case("1f1b", (1, 1), 6, record=True), Case("1f1b-flush", (1, 1), 3, micro=4),
            Case("gpipe", (1, 1), 2, micro=2), Case("2bw", (1, 1), 4, micro=2),
            Case("1f1b", (1, 1), 4, model="tied"), Case("2bw", (1, 1), 3, micro=2,
                                                         model="tied")], 2)


def test_three_processes_straight_and_replicated() -> None:
    results = _check([Case("1f1b", (1, 1, 1), 6, record=True), Case("gpipe", (1, 1, 1), 2,
                                                                    micro=4),
                      Case("1f1b-flush", (2, 1), 2, micro=4), Case("1f1b", (1, 2), 4),
                      Case("2bw", (1, 2), 4, micro=2),
                      Case("1f1b-flush", (1, 1, 1), 2, micro=2, model="tied"),
                      Case("1f1b", (1, 1, 1), 5, vertical_sync=True)], 3)
    # rank 0 holds every rank's measured timeline, which ran exactly the lowered schedule
    timeline = results[0][0]["timeline"]
    assert isinstance(timeline, Timeline) and timeline.source == "measured"
    assert timeline.ranks == [0, 1, 2] and timeline.meta["backend"] == "distributed"
    assert timeline.meta["clock"] == "barrier"  # aligned on the barrier before the loop
    timeline.check_schedule(_pipeline(Case("1f1b", (1, 1, 1), 6)).schedule(6, 1))
    assert results[1][0]["timeline"].ranks == [1]


def test_four_processes_replicated_middle_stage_and_tied() -> None:
    _check([Case("1f1b", (1, 2, 1), 4), Case("1f1b-flush", (1, 2, 1), 2, micro=4),
            Case("gpipe", (1, 1, 1, 1), 2, micro=4), Case("2bw", (2, 1, 1), 4, micro=4),
            Case("gpipe", (1, 2, 1), 2, micro=2, model="tied")], 4)


def _announcement_worker(worker: Worker, steps: int) -> tuple[int, list[float]]:
    """Counts the broadcasts that announce runs while a flush schedule trains `steps`
    minibatches (one run each)."""
    from pdcompile.backends import distributed

    calls = [0]
    broadcast = distributed.dist.broadcast_object_list

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return broadcast(*args, **kwargs)

    distributed.dist.broadcast_object_list = counting  # type: ignore[assignment]
    try:
        case = Case("1f1b-flush", (1, 1), steps, micro=2)
        run = distributed.run_distributed(_pipeline(case), _batches("mlp", steps),
                                          monitor=worker.monitor)
    finally:
        distributed.dist.broadcast_object_list = broadcast  # type: ignore[assignment]
    return calls[0], run.losses


def test_flush_runs_are_announced_several_at_a_time() -> None:
    from pdcompile.backends.distributed import ANNOUNCE_AHEAD

    steps = 2 * ANNOUNCE_AHEAD + 1
    results = launch(_announcement_worker, 2, args=(steps,), timeout=120, fault_timeout=10)
    # runs 0..steps-1 and the end of the data, ANNOUNCE_AHEAD per broadcast (not one each)
    assert [calls for calls, _ in results] == [3, 3]
    want = _pipeline(Case("1f1b-flush", (1, 1), steps, micro=2)).train(_batches("mlp", steps))
    torch.testing.assert_close(torch.tensor(results[0][1]), torch.tensor(want))


def _counting_worker(worker: Worker, cases: list[Case], pack_limit: int | None = None
                     ) -> list[tuple[dict[int, int], list[float]]]:
    """Trains each case, counting the point-to-point sends this rank starts, by destination
    (`pack_limit`: the largest message packed into one buffer, if not the default)."""
    from pdcompile.backends import distributed, packed_message

    if pack_limit is not None:
        packed_message.PACK_LIMIT = pack_limit
    out = []
    isend = distributed.dist.isend
    for case in cases:
        sent: dict[int, int] = {}

        def counting(tensor: torch.Tensor, dst: int, *args: Any, sent: dict[int, int] = sent,
                     **kwargs: Any) -> Any:
            sent[dst] = sent.get(dst, 0) + 1
            return isend(tensor, dst, *args, **kwargs)

        pipe = _pipeline(case)
        batches = _batches(case.model, case.steps) if distributed.reads_data(pipe, worker.rank) \
            else None
        distributed.dist.isend = counting  # type: ignore[assignment]
        try:
            run = distributed.run_distributed(pipe, batches, monitor=worker.monitor)
        finally:
            distributed.dist.isend = isend  # type: ignore[assignment]
        out.append((sent, run.losses))
    return out


def test_the_target_rides_in_the_activation_message_to_the_last_stage() -> None:
    """On 2 stages, stage 0 sends the last stage one message a microbatch, its activations and
    its target packed together (they were two, each several transfers in gloo); with the
    weight version of vertical sync too. Training is unchanged."""
    cases = [Case("1f1b-flush", (1, 1), 3, micro=4), Case("1f1b", (1, 1), 5),
             Case("1f1b", (1, 1), 4, vertical_sync=True)]
    results = launch(_counting_worker, 2, args=(cases,), timeout=120, fault_timeout=10)
    for index, case in enumerate(cases):
        sent, losses = results[0][index]
        per = case.micro or 1
        assert sent == {1: case.steps * per}, case  # one message a microbatch, nothing else
        assert results[1][index][1] == losses
        want = _pipeline(case).train(_batches(case.model, case.steps))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))


def test_a_target_rides_unpacked_in_a_message_too_large_to_pack() -> None:
    """Above the packing limit a message's tensors are sent one by one, the riding target
    among them (two sends a microbatch), and the receiver takes them apart alike."""
    case = Case("1f1b-flush", (1, 1), 2, micro=2)
    results = launch(_counting_worker, 2, args=([case], 0), timeout=120, fault_timeout=10)
    sent, losses = results[0][0]
    assert sent == {1: 2 * case.steps * 2} and results[1][0][1] == losses
    want = _pipeline(case).train(_batches(case.model, case.steps))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))


def _thread_worker(worker: Worker, cases: list[Case], off_thread_bytes: int
                   ) -> list[tuple[int, int, int, list[float]]]:
    """Trains each case, counting the gloo `isend` / `irecv` calls made on the main thread and
    on others, and the posting threads still alive once `run_distributed` returned; messages
    of `off_thread_bytes` or more go to the posting thread."""
    import threading

    from pdcompile.backends import distributed, posting_thread

    posting_thread.OFF_THREAD_BYTES = off_thread_bytes

    out = []
    isend, irecv = distributed.dist.isend, distributed.dist.irecv
    for case in cases:
        where = {"main": 0, "other": 0}

        def counted(call: Any, where: dict[str, int] = where) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                on_main = threading.current_thread() is threading.main_thread()
                where["main" if on_main else "other"] += 1
                return call(*args, **kwargs)
            return wrapped

        pipe = _pipeline(case)
        batches = _batches(case.model, case.steps) if distributed.reads_data(pipe, worker.rank) \
            else None
        distributed.dist.isend, distributed.dist.irecv = counted(isend), counted(irecv)
        try:
            run = distributed.run_distributed(pipe, batches, monitor=worker.monitor)
        finally:
            distributed.dist.isend, distributed.dist.irecv = isend, irecv
        alive = sum(t.name == "pdcompile-posting" for t in threading.enumerate())
        out.append((where["main"], where["other"], alive, run.losses))
    return out


@pytest.mark.parametrize("large", [True, False])
def test_gloo_sends_and_receives_of_large_messages_are_issued_off_the_ranks_thread(
        large: bool) -> None:
    """Every `isend` and `irecv` of a message of at least OFF_THREAD_BYTES goes to gloo from
    the transport's posting thread (the main thread only queues it:
    backends/posting_thread.py), smaller ones from the main thread; the posting thread is gone
    once a call of `run_distributed` returns, and training is the same either way."""
    cases = [Case("1f1b", (1, 1), 5), Case("1f1b-flush", (1, 1), 3, micro=4)]
    results = launch(_thread_worker, 2, args=(cases, 0 if large else 1 << 30), timeout=120,
                     fault_timeout=10)
    for index, case in enumerate(cases):
        want = _pipeline(case).train(_batches(case.model, case.steps))
        for rank in range(2):
            on_main, elsewhere, alive, losses = results[rank][index]
            issued = (elsewhere, on_main) if large else (on_main, elsewhere)
            assert issued[0] >= case.steps * (case.micro or 1) and issued[1] == 0, (case, rank)
            assert alive == 0, (case, rank)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
