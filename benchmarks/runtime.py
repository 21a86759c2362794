"""Training throughput of our distributed pipeline against its peers, side by side in one run.

Model: 8 blocks of Linear(1024, 1024) + ReLU and a Linear(1024, 10) head, cross-entropy, SGD,
minibatch 256; the two-stage split is 4 blocks | 4 blocks + head. One thread per process.

    (a) single     one process, one thread, plain training (the reference for ratios)
    (a') single-8  one process, the same 8 x 32 microbatching (what microbatching alone costs)
    (b) ddp        DistributedDataParallel on 2 processes (128 samples each)
    (c) pp-1f1b    torch.distributed.pipelining Schedule1F1B, 2 stages, 8 microbatches of 32
    (c) pp-gpipe   torch.distributed.pipelining ScheduleGPipe, same
    (d) ours-1f1b  our asynchronous 1F1B (PipeDream): whole minibatches stream through, no flush
    (d') ours-1f1b-steady  the same in its steady state: the round's minibatches timed in the
        middle of a longer stream (as PipeDream trains an epoch; see `_steady_worker`)
    (e) ours-flush our 1F1B-flush (PipeDream-Flush), 8 microbatches of 32
    (e') ours-flush-plain  the same without fused weight-gradient accumulation (passes/fuse.py)
    (f) pp-interleaved  torch.distributed.pipelining ScheduleInterleaved1F1B: 4 chunks of 2 blocks
        (the last with the head), chunks 0 and 2 on rank 0, 1 and 3 on rank 1; 8 microbatches
    (f) ours-interleaved  our interleaved-1f1b on the same chunks and microbatching
    (g) pp-zb      torch.distributed.pipelining ScheduleInterleavedZeroBubble with one stage per
        rank (its ZB1P order, which is ZB-H1; the 4 | 4 + head split), 8 microbatches of 32
    (g) ours-zb    our zb-h1 (B/W split: Linear weight gradients deferred to W), same split
    (g') pp-izb / ours-izb  interleaved zero bubble (ScheduleInterleavedZeroBubble with 2 chunks
        per rank / our interleaved-zb) on the chunks of (f)
    (h) pp-zbv / ours-zbv  ZB-V (ScheduleZBVZeroBubble / our zb-v) on the chunks of (f) in a V:
        chunks 0 and 3 on rank 0, 1 and 2 on rank 1; 8 microbatches of 32
    (h) pp-dualpipev / ours-dualpipev  DualPipeV (ScheduleDualPipeV / our dualpipev), the same

Each configuration runs `--rounds` rounds of `--steps` minibatches, each round in processes of
its own (one for (a), two for the others) after `--warmup` minibatches; a pass runs one round of
every configuration in turn, so that a load from elsewhere on the machine hits them alike, and
`--warmup-passes` passes run first and are not counted. The table shows each configuration's
median samples/s with the range of its rounds, and each ratio as the median (and range) of the
ratios within a pass: a round set against the reference's round of the same pass, minutes apart
at most, so a drift of the machine over the run moves both sides of a ratio alike. Under the
table, (a)'s CPU seconds per round against its wall seconds: on a quiet machine they agree, and a
round whose CPU time is as high as its wall time but above the other rounds' ran on a slower
core (frequency, a busy hyper-thread sibling), not behind other processes.

    python benchmarks/runtime.py [--rounds 6] [--steps 8] [--warmup-passes 1] [--only single,...]
        [--md FILE]

`--bubbles` measures instead the bubble of real runs (1f1b-flush, zb-h1, interleaved-1f1b,
interleaved-zb, zb-v, dualpipev; `run_distributed(record=True)`, --steps minibatches, the first
--warmup left out): per minibatch, each rank's idle time is the minibatch's span (first compute
start to last compute end, both ranks) minus the rank's F, B and W time; the closed form
(cost/bubble.py) gets the run's own measured f, b, w per microbatch and rank (chunks together,
averaged over the ranks; where the schedule does not split the backward, w is half the recorded
B, the share of it the simulator computes after the input-gradient send, and the last column
prices that backward as one block instead) with free transfers, so it is what the schedule's
shape predicts from the measured compute, and the difference is what transfers, steps and
imbalance add.

    python benchmarks/runtime.py --bubbles mlp|sleep [--sleep-ms 10] [--steps 10] [--warmup 2]

On this shared 2-core machine the MLP's compute is slowed by whatever else runs; `sleep`
replaces every stage by one that sleeps f = b = w (a sleep leaves the cores to others), so that
the schedule's own shape shows, with the runtime's transfers and overheads.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pdcompile.backends.launch import Worker, launch
from pdcompile.runtime.allocator import tune_allocator

WIDTH, BLOCKS, CLASSES, MINIBATCH, MICRO = 1024, 8, 10, 256, 8
LR = 0.01


def build_model(seed: int = 0) -> nn.Sequential:
    """The benchmark MLP (same weights for every configuration)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def split_model(model: nn.Sequential) -> tuple[nn.Sequential, nn.Sequential]:
    """4 blocks | 4 blocks + head."""
    cut = 2 * BLOCKS // 2
    return model[:cut], model[cut:]


CHUNKS = 4  # interleaved: 4 chunks of 2 blocks (the last with the head) on 2 ranks


def chunk_of(index: int) -> int:
    """The interleaved chunk of layer `index` of the Sequential (2 blocks, 4 layers, each)."""
    return min(index // (2 * BLOCKS // CHUNKS), CHUNKS - 1)


def chunk_model(model: nn.Sequential) -> list[nn.Sequential]:
    """The 4 chunks of `chunk_of`, in pipeline order."""
    return [nn.Sequential(*[m for i, m in enumerate(model) if chunk_of(i) == c])
            for c in range(CHUNKS)]


def make_data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` minibatches (cycled over 4 distinct ones, to keep memory small)."""
    gen = torch.Generator().manual_seed(seed)
    distinct = [(torch.randn(MINIBATCH, WIDTH, generator=gen),
                 torch.randint(0, CLASSES, (MINIBATCH,), generator=gen)) for _ in range(4)]
    return [distinct[i % 4] for i in range(steps)]


def _rounds(step: Callable[[int], None], *, rounds: int, steps: int, warmup: int,
            sync: Callable[[], None] = lambda: None, cpu: list[float] | None = None
            ) -> list[float]:
    """Seconds per round of `steps` steps, after `warmup` steps (and this process's CPU seconds
    per round appended to `cpu`, if given)."""
    for i in range(warmup):
        step(i)
    sync()
    times = []
    for _ in range(rounds):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            step(i)
        sync()
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.process_time() - start_cpu)
    return times


# -- (a) one process ----


def run_single(*, rounds: int, steps: int, warmup: int, micro: int = 1,
               cpu: list[float] | None = None) -> list[float]:
    """Plain training in this process with one thread (`micro` > 1: gradient accumulation)."""
    torch.set_num_threads(1)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = make_data(steps + warmup)
    loss_fn = nn.CrossEntropyLoss()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            (loss_fn(model(xs), ys) / micro).backward()
        opt.step()

    return _rounds(step, rounds=rounds, steps=steps, warmup=warmup, cpu=cpu)


def _single_worker(worker: Worker, rounds: int, steps: int, warmup: int,
                   micro: int) -> list[float]:
    """`run_single` in a process of its own (launched like the others' workers, so that every
    configuration's rounds start from the same fresh process), its rounds' wall seconds followed
    by their CPU seconds."""
    cpu: list[float] = []
    times = run_single(rounds=rounds, steps=steps, warmup=warmup, micro=micro, cpu=cpu)
    return times + cpu


# -- (b) DDP ----


def _ddp_worker(worker: Worker, rounds: int, steps: int, warmup: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = make_data(steps + warmup)
    loss_fn = nn.CrossEntropyLoss()
    half = MINIBATCH // worker.world_size

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        lo = worker.rank * half
        opt.zero_grad()
        loss_fn(model(x[lo:lo + half]), y[lo:lo + half]).backward()
        opt.step()

    return _rounds(step, rounds=rounds, steps=steps, warmup=warmup, sync=dist.barrier)


# -- (c) torch.distributed.pipelining ----


def _pp_worker(worker: Worker, schedule_name: str, rounds: int, steps: int,
               warmup: int) -> list[float]:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    model = build_model()
    loss_fn = nn.CrossEntropyLoss()
    schedule: Any
    if schedule_name in ("zbv", "dualpipev"):  # a V: chunks r and 3 - r on rank r
        indices = [worker.rank, CHUNKS - 1 - worker.rank]
        parts = chunk_model(model)
        chunks = [parts[i] for i in indices]
        stages_v: list[Any] = [PipelineStage(c, i, CHUNKS, torch.device("cpu"))
                               for c, i in zip(chunks, indices, strict=True)]
        v_class = ScheduleZBVZeroBubble if schedule_name == "zbv" else ScheduleDualPipeV
        schedule = v_class(stages_v, MICRO, loss_fn=loss_fn)
        params = [p for c in chunks for p in c.parameters()]
    elif schedule_name in ("interleaved", "izb"):  # chunks c and c + 2 on rank c
        indices = [worker.rank, worker.rank + 2]
        parts = chunk_model(model)
        chunks = [parts[i] for i in indices]
        stages: list[Any] = [PipelineStage(c, i, CHUNKS, torch.device("cpu"))
                             for c, i in zip(chunks, indices, strict=True)]
        if schedule_name == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn)
        else:
            schedule = ScheduleInterleavedZeroBubble(stages, MICRO, loss_fn=loss_fn)
        params = [p for c in chunks for p in c.parameters()]
    else:
        part = split_model(model)[worker.rank]
        stage: Any = PipelineStage(part, worker.rank, 2, torch.device("cpu"))
        if schedule_name == "zb":  # ZB1P with one stage per rank: ZB-H1
            schedule = ScheduleInterleavedZeroBubble([stage], MICRO, loss_fn=loss_fn)
        elif schedule_name == "1f1b":
            schedule = Schedule1F1B(stage, MICRO, loss_fn=loss_fn)
        else:
            schedule = ScheduleGPipe(stage, MICRO, loss_fn=loss_fn)
        params = list(part.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    data = make_data(steps + warmup)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad()
        if schedule_name in ("zbv", "dualpipev"):  # rank 0 holds the first and the last chunk
            if worker.rank == 0:
                schedule.step(x, target=y, losses=[])
            else:
                schedule.step()
        elif worker.rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()

    return _rounds(step, rounds=rounds, steps=steps, warmup=warmup, sync=dist.barrier)


# -- (d), (e) ours ----


def ours_plan(gm: Any, schedule_name: str) -> Any:
    """Our plan of the benchmark MLP's traced graph for a schedule: the chunks of `chunk_of` in
    a V (r and 3 - r on rank r) or interleaved (chunk c on rank c % 2), else 4 | 4 + head."""
    from pdcompile.passes.split import manual_plan
    from pdcompile.planner.interleave import fold_v, interleave
    from pdcompile.schedule.kinds import kind

    chunked = manual_plan(gm, lambda node: chunk_of(int(str(node.target)))
                          if node.op == "call_module" else 0)
    if kind(schedule_name).v_shape:
        return fold_v(chunked)
    if schedule_name.startswith("interleaved"):
        return interleave(chunked, 2)
    return manual_plan(gm, lambda node: int(
        node.op == "call_module" and int(str(node.target)) >= BLOCKS))


def ours_pipeline(schedule_name: str, steps: int, *, fuse: bool = True
                  ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Our pipeline of the benchmark's model under `schedule_name` (`ours_plan`), and `steps`
    minibatches of data."""
    import pdcompile
    from pdcompile.passes.trace import trace

    model = build_model()
    plan = ours_plan(trace(model), schedule_name)
    data = make_data(steps)
    flush = schedule_name != "1f1b"
    pipe = pdcompile.compile(model, example_inputs=(data[0][0],), example_target=data[0][1],
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                             schedule=schedule_name, microbatches=MICRO if flush else None,
                             plan=plan, fuse=fuse)
    return pipe, data


def _ours_worker(worker: Worker, schedule_name: str, rounds: int, steps: int,
                 warmup: int, fuse: bool = True) -> list[float]:
    """Our pipeline as a user runs it: `pdcompile.compile` with the 4 | 4 + head plan, then
    `run_distributed` (the generated rank loop over DistributedTransport) once per round; a
    round's time is the training loop's wall time (`DistributedRun.seconds`, the ranks start it
    together after a barrier; the slower rank's counts). `fuse=False` compiles without the fused
    weight-gradient accumulation (passes/fuse.py), to show what it contributes."""
    from pdcompile.backends.distributed import run_distributed

    pipe, data = ours_pipeline(schedule_name, max(steps, warmup, 4), fuse=fuse)
    times = []
    if warmup:
        run_distributed(pipe, data[:warmup], monitor=worker.monitor)
    for _ in range(rounds):
        # asynchronous 1F1B: the round's minibatches stream through one run of the loop
        run = run_distributed(pipe, data[:steps], monitor=worker.monitor)
        mine = torch.tensor([run.seconds])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        times.append(float(mine))
    return times


def _steady_worker(worker: Worker, rounds: int, steps: int, warmup: int) -> list[float]:
    """Asynchronous 1F1B in its steady state, as PipeDream trains an epoch: each round streams
    `steps` minibatches with STEADY_EDGE more before and after them through one run of the loop,
    and its time is that of the `steps` in the middle, between the last stage's losses of
    minibatches STEADY_EDGE - 1 and STEADY_EDGE + steps - 1 (`run_distributed`'s `progress`, on
    the rank that reports them; the other rank returns 0). The pipeline's fill and drain, which
    cap a round of 8 minibatches at 2 x 8 / 9 = 1.78x one process, are outside the window."""
    from pdcompile.backends.distributed import run_distributed

    stream = STEADY_EDGE + steps + STEADY_EDGE
    pipe, data = ours_pipeline("1f1b", max(stream, warmup, 4))
    if warmup:
        run_distributed(pipe, data[:warmup], monitor=worker.monitor)
    times = []
    for _ in range(rounds):
        heard: dict[int, float] = {}
        run_distributed(pipe, data[:stream], monitor=worker.monitor,
                        progress=lambda step, _loss: heard.setdefault(step, time.perf_counter()))
        window = (heard[STEADY_EDGE + steps - 1] - heard[STEADY_EDGE - 1]) if heard else 0.0
        mine = torch.tensor([window])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        times.append(float(mine))
    return times


STEADY_EDGE = 4  # minibatches streamed before and after the timed ones (ours-1f1b-steady)


# -- bubbles of real runs (--bubbles) ----


BUBBLE_SCHEDULES = [("1f1b-flush", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2),
                    ("zb-v", 2), ("dualpipev", 2)]


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps f, whose backward sleeps b (input gradients) and then w
    (weight gradients) or, under a B/W split, leaves the w to W
    (runtime/linear_grads.weight_grad_queue). Sleeping leaves the cores to others: the schedule's
    shape shows whatever else runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float, w: float) -> torch.Tensor:
        from pdcompile.runtime.linear_grads import weight_grad_queue

        time.sleep(f)
        ctx.times, ctx.queue = (b, w), weight_grad_queue()
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        b, w = ctx.times
        time.sleep(b)
        if ctx.queue is not None and not torch.is_grad_enabled():
            ctx.queue.append(lambda: time.sleep(w))
        else:
            time.sleep(w)
        return grad, None, None, None


class Sleeper(nn.Module):
    """A small Linear (so that the stage has weights) and a sleep of f / b / w seconds."""

    def __init__(self, f: float, b: float, w: float) -> None:
        super().__init__()
        self.linear, self.times = nn.Linear(8, 8), (f, b, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), *self.times)  # type: ignore[no-untyped-call]


def _bubble_worker(worker: Worker, schedule: str, chunks: int, steps: int,
                   sleep: float) -> Any:
    import pdcompile
    from pdcompile.backends.distributed import run_distributed
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace
    from pdcompile.planner.interleave import fold_v, interleave
    from pdcompile.schedule.kinds import kind

    leaves: list[type[nn.Module]] = []
    if sleep > 0:  # 2 x chunks sleeping stages, f = b = w = sleep per rank (chunks together)
        torch.manual_seed(0)
        share = sleep / chunks
        model: nn.Module = nn.Sequential(*[Sleeper(share, share, share)
                                           for _ in range(2 * chunks)])
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randn(MICRO, 8, generator=gen),
                 torch.randint(0, 8, (MICRO,), generator=gen))] * steps
        leaves = [Sleeper]
        gm = trace(model, leaf_modules=leaves)
        plan = manual_plan(gm, lambda node: int(str(node.target))
                           if node.op == "call_module" else 0)
    else:
        model = build_model()
        data = make_data(steps)
        gm = trace(model)
        if chunks > 1:
            plan = manual_plan(gm, lambda node: chunk_of(int(str(node.target)))
                               if node.op == "call_module" else 0)
        else:
            plan = manual_plan(gm, lambda node: int(
                node.op == "call_module" and int(str(node.target)) >= BLOCKS))
    if chunks > 1:
        plan = fold_v(plan) if kind(schedule).v_shape else interleave(plan, 2)
    pipe = pdcompile.compile(model, example_inputs=(data[0][0],), example_target=data[0][1],
                             loss_fn=torch.nn.functional.cross_entropy,
                             optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                             schedule=schedule, microbatches=MICRO, plan=plan,
                             leaf_modules=leaves)
    run = run_distributed(pipe, data, monitor=worker.monitor, record=True)
    return None if run.timeline is None else run.timeline.to_dict()


def measure_bubble(schedule: str, chunks: int, steps: int, skip: int,
                   sleep: float = 0.0) -> dict[str, float]:
    """Measured idle per rank and minibatch, and the closed form from the measured times
    (`sleep` > 0: stages that sleep f = b = w = `sleep` seconds per rank and microbatch)."""
    from pdcompile.cost.bubble import flush_time
    from pdcompile.schedule.ir import Kind
    from pdcompile.schedule.kinds import KINDS, WGRAD_SHARE
    from pdcompile.timeline import Timeline

    timeline = Timeline.from_dict(launch(_bubble_worker, 2,
                                         args=(schedule, chunks, steps, sleep),
                                         timeout=900, fault_timeout=60)[0])
    runs: dict[int, list[Any]] = {}
    for event, action in timeline.compute_events():
        runs.setdefault(action.microbatch // MICRO, []).append((event, action))
    idle, spans = [], []
    seconds: dict[Kind, list[float]] = {Kind.F: [], Kind.B: [], Kind.W: []}
    for k in sorted(runs)[skip:]:
        events = runs[k]
        span = max(e.end for e, _ in events) - min(e.start for e, _ in events)
        spans.append(span)
        for rank in (0, 1):
            idle.append(span - sum(e.duration for e, _ in events if e.rank == rank))
        for kind, values in seconds.items():  # per microbatch and rank, chunks together
            total = sum(e.duration for e, a in events if a.kind == kind)
            values.append(total / (2 * MICRO))
    f, b, w = (statistics.mean(seconds[k]) for k in (Kind.F, Kind.B, Kind.W))
    # where B and W are not split, the recorded B holds both; the stage that sends gradients
    # back computes its weight gradients after the send, priced as the simulator prices them
    deferred = w if KINDS[schedule].split_backward else WGRAD_SHARE * b
    closed = flush_time(schedule, ranks=2, microbatches=MICRO, chunks=chunks, fwd=f, bwd=b + w,
                        wgrad=deferred)
    block = flush_time(schedule, ranks=2, microbatches=MICRO, chunks=chunks, fwd=f, bwd=b + w,
                       wgrad=w)  # non-split: the backward priced as one block before its send
    span = statistics.median(spans)
    return {"f": f, "b": b, "w": w, "idle": statistics.median(idle), "span": span,
            "closed_idle": closed.idle, "closed_span": closed.makespan,
            "block_span": block.makespan}


# -- driver ----


def _dist(fn: Callable[..., list[float]], *args: Any) -> list[float]:
    values = launch(fn, 2, args=args, timeout=1800, fault_timeout=60)
    return [max(a, b) for a, b in zip(values[0], values[1], strict=True)]


def _single(rounds: int, steps: int, warmup: int, micro: int = 1) -> list[float]:
    """`run_single`'s rounds in a launched process of their own: their wall seconds, then
    their CPU seconds (`main` splits them: WITH_CPU)."""
    values: list[float] = launch(_single_worker, 1, args=(rounds, steps, warmup, micro),
                                 timeout=1800, fault_timeout=60)[0]
    return values


CONFIGS: dict[str, tuple[str, Callable[[int, int, int], list[float]]]] = {
    "single": ("(a) one process, one thread", lambda r, s, w: _single(r, s, w)),
    "single-8": ("(a') one process, 8x32 microbatches", lambda r, s, w: _single(
        r, s, w, MICRO)),
    "ddp": ("(b) DDP, 2 processes", lambda r, s, w: _dist(_ddp_worker, r, s, w)),
    "pp-1f1b": ("(c) pipelining Schedule1F1B, 8x32", lambda r, s, w: _dist(
        _pp_worker, "1f1b", r, s, w)),
    "pp-gpipe": ("(c) pipelining ScheduleGPipe, 8x32", lambda r, s, w: _dist(
        _pp_worker, "gpipe", r, s, w)),
    "ours-1f1b": ("(d) ours, async 1F1B, whole minibatches", lambda r, s, w: _dist(
        _ours_worker, "1f1b", r, s, w)),
    "ours-1f1b-steady": ("(d') ours, async 1F1B, steady state (fill and drain outside the window)",
                         lambda r, s, w: _dist(_steady_worker, r, s, w)),
    "ours-flush": ("(e) ours, 1F1B-flush, 8x32", lambda r, s, w: _dist(
        _ours_worker, "1f1b-flush", r, s, w)),
    "ours-flush-plain": ("(e') ours, 1F1B-flush, 8x32, plain autograd accumulation",
                         lambda r, s, w: _dist(_ours_worker, "1f1b-flush", r, s, w, False)),
    "pp-interleaved": ("(f) pipelining ScheduleInterleaved1F1B, 2x2 chunks, 8x32",
                       lambda r, s, w: _dist(_pp_worker, "interleaved", r, s, w)),
    "ours-interleaved": ("(f) ours, interleaved-1f1b, 2x2 chunks, 8x32", lambda r, s, w: _dist(
        _ours_worker, "interleaved-1f1b", r, s, w)),
    "pp-zb": ("(g) pipelining ScheduleInterleavedZeroBubble (1 stage/rank: ZB-H1), 8x32",
              lambda r, s, w: _dist(_pp_worker, "zb", r, s, w)),
    "ours-zb": ("(g) ours, zb-h1, 8x32", lambda r, s, w: _dist(_ours_worker, "zb-h1", r, s, w)),
    "pp-izb": ("(g') pipelining ScheduleInterleavedZeroBubble, 2x2 chunks, 8x32",
               lambda r, s, w: _dist(_pp_worker, "izb", r, s, w)),
    "ours-izb": ("(g') ours, interleaved-zb, 2x2 chunks, 8x32", lambda r, s, w: _dist(
        _ours_worker, "interleaved-zb", r, s, w)),
    "pp-zbv": ("(h) pipelining ScheduleZBVZeroBubble, 2x2 chunks in a V, 8x32",
               lambda r, s, w: _dist(_pp_worker, "zbv", r, s, w)),
    "ours-zbv": ("(h) ours, zb-v, 2x2 chunks in a V, 8x32", lambda r, s, w: _dist(
        _ours_worker, "zb-v", r, s, w)),
    "pp-dualpipev": ("(h) pipelining ScheduleDualPipeV, 2x2 chunks in a V, 8x32",
                     lambda r, s, w: _dist(_pp_worker, "dualpipev", r, s, w)),
    "ours-dualpipev": ("(h) ours, dualpipev, 2x2 chunks in a V, 8x32", lambda r, s, w: _dist(
        _ours_worker, "dualpipev", r, s, w)),
}
# configurations that return their rounds' wall seconds followed by their CPU seconds
WITH_CPU = frozenset({"single", "single-8"})
# pairs measured against each other (ours / torch's), printed under the table
PAIRS = [("ours-flush", "pp-1f1b"), ("ours-interleaved", "pp-interleaved"),
         ("ours-zb", "pp-zb"), ("ours-izb", "pp-izb"), ("ours-zbv", "pp-zbv"),
         ("ours-dualpipev", "pp-dualpipev")]


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print the table (and write it as Markdown with --md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="minibatches per round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="minibatches before each round's timing")
    parser.add_argument("--warmup-passes", type=int, default=1,
                        help="passes over every configuration run first and not counted")
    parser.add_argument("--only", default="", help="comma-separated subset of: "
                        + ", ".join(CONFIGS))
    parser.add_argument("--md", default="", help="also write the table to this Markdown file")
    parser.add_argument("--bubbles", choices=("mlp", "sleep"), default="",
                        help="instead: the measured bubble of 1f1b-flush, zb-h1, "
                        "interleaved-1f1b, interleaved-zb, zb-v and dualpipev against the "
                        "closed forms "
                        "(cost/bubble.py), --steps minibatches each, the first --warmup left "
                        "out; on the MLP, or on stages that sleep --sleep-ms (f = b = w)")
    parser.add_argument("--sleep-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # every configuration runs with the allocator pdcompile's workers use (backends/launch.py
    # tunes its workers'; this process's for --bubbles); PDCOMPILE_ALLOCATOR=system for none
    tune_allocator()
    if args.bubbles:
        sleep = args.sleep_ms / 1e3 if args.bubbles == "sleep" else 0.0
        return bubbles(args.steps, args.warmup, args.md, sleep)
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from "
                     + ", ".join(CONFIGS))
    times, cpu = measure(names, args.rounds, args.steps, args.warmup, args.warmup_passes)
    text = table(names, times, cpu, args.rounds, args.steps, args.warmup_passes)
    print(text)
    if args.md:
        with open(args.md, "w") as out:
            out.write(text + "\n")
    return 0


def measure(names: list[str], rounds: int, steps: int, warmup: int, warmup_passes: int
            ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall seconds of each configuration's rounds, one round of each per pass (in the order of
    `names`), after `warmup_passes` uncounted passes; and the CPU seconds of WITH_CPU's rounds."""
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names if name in WITH_CPU}
    for number in range(warmup_passes + rounds):
        for name in names:
            got = CONFIGS[name][1](1, steps, warmup)
            if number >= warmup_passes:
                times[name] += got[:1]
                if name in cpu:
                    cpu[name] += got[1:]
    return times, cpu


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max)'."""
    return (fmt.format(statistics.median(values)) + " (" + fmt.format(min(values)) + "-"
            + fmt.format(max(values)) + ")")


def _pass_ratios(times: dict[str, list[float]], name: str, reference: str) -> list[float]:
    """`name`'s samples/s over `reference`'s, pass by pass (times are seconds of equal work)."""
    return [r / n for n, r in zip(times[name], times[reference], strict=True) if n > 0]


def table(names: list[str], times: dict[str, list[float]], cpu: dict[str, list[float]],
          rounds: int, steps: int, warmup_passes: int) -> str:
    """The Markdown table: medians and ranges of samples/s, ratios pass by pass."""
    rates = {name: [steps * MINIBATCH / t for t in times[name] if t > 0] or [0.0]
             for name in names}
    for name in names:
        print(f"{name:<11} {statistics.median(rates[name]):8.1f} samples/s  "
              f"rounds: {' '.join(f'{r:.0f}' for r in rates[name])}", file=sys.stderr,
              flush=True)
    lines = [f"machine: {platform.node()} ({platform.machine()}, "
             f"{torch.get_num_threads()} thread per process), torch {torch.__version__}, "
             f"{rounds} rounds x {steps} minibatches of {MINIBATCH} after {warmup_passes} "
             "uncounted pass(es); medians (range) over the rounds; ratios pass by pass", "",
             "| configuration | samples/s | ratio to (a) |", "|---|---:|---:|"]
    for name in names:
        ratio = (_spread(_pass_ratios(times, name, "single"), "{:.2f}x") if "single" in names
                 else "-")
        lines.append(f"| {CONFIGS[name][0]} | {_spread(rates[name], '{:.1f}')} | {ratio} |")
    pairs = [(a, b) for a, b in PAIRS if a in names and b in names]
    if pairs:
        lines += ["", "| ours / torch, same schedule and microbatching | ratio |", "|---|---:|"]
        lines += [f"| {a} / {b} | {_spread(_pass_ratios(times, a, b), '{:.2f}x')} |"
                  for a, b in pairs]
    for name, seconds in cpu.items():
        lines += ["", f"{name}, CPU / wall seconds per round, in the order run: "
                  + ", ".join(f"{c:.2f} / {w:.2f}" for c, w in
                              zip(seconds, times[name], strict=True))]
    return "\n".join(lines)


def bubbles(steps: int, skip: int, md: str, sleep: float = 0.0) -> int:
    """The --bubbles table: measured idle time per minibatch against the closed forms."""
    model = (f"stages sleeping f = b = w = {sleep * 1e3:g} ms per rank and microbatch" if sleep
             else f"the MLP, {MICRO} microbatches of {MINIBATCH // MICRO}")
    lines = [f"machine: {platform.node()} ({platform.machine()}), torch {torch.__version__}, 2 "
             f"processes, {model}, {MICRO} microbatches, medians over minibatches "
             f"{skip + 1}..{steps}", "",
             "| schedule | f / b / w per microbatch and rank (ms) | measured idle per rank "
             "(ms) | closed-form idle (ms) | measured span (ms) | closed-form span (ms) | "
             "closed-form span, a non-split backward as one block before its send (ms) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for schedule, chunks in BUBBLE_SCHEDULES:
        got = measure_bubble(schedule, chunks, steps, skip, sleep)
        lines.append(f"| {schedule} | {got['f'] * 1e3:.1f} / {got['b'] * 1e3:.1f} / "
                     f"{got['w'] * 1e3:.1f} | {got['idle'] * 1e3:.1f} | "
                     f"{got['closed_idle'] * 1e3:.1f} | {got['span'] * 1e3:.1f} | "
                     f"{got['closed_span'] * 1e3:.1f} | {got['block_span'] * 1e3:.1f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if md:
        with open(md, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
