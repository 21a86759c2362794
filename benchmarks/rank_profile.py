"""Per rank of a 2-process run of benchmarks/runtime.py's MLP: each action's main-thread CPU
against plain torch doing the same chunks' work, the messages, gloo's loop threads, and where
the rank waits and why.

For interleaved (chunks c and c + 2 on rank c) and V-shaped schedules (chunks r and 3 - r on
rank r), and any other schedule of benchmarks/runtime.py (the 4 | 4 + head split). Each rank
trains --warmup minibatches, then --rounds runs of --steps minibatches; per round it measures:

- CPU per minibatch of the main thread (the scheduler's nanosecond count), of gloo's loop
  threads and their wake-ups (benchmarks/loop_threads.py), and `isend` calls;
- the main thread's CPU (`time.thread_time`) inside each kind of action of the generated rank
  loop: F, B, W (and the weight gradients a non-split backward runs after its sends), the step,
  the sends and the receives; what is left of the main thread is the driver, the run's set-up
  (one run a minibatch under a flush schedule) and the waits' own bookkeeping;
- every blocking wait (`DistPending.wait` that had not completed), by kind: how long, and why
  for a receive: the peer issued the send only after the wait began (the peer was still
  computing: the schedule's order or the compute's imbalance), or before (the data was in
  flight); and receives posted only after the peer's send was issued (gloo then makes the
  sender's loop thread write the data, docs/runtime-profile.md, third round);
- hand-overs between two chunks of the rank (in memory, no message).

Then both ranks at once run plain torch on the same chunks (8 microbatches of 32, or whole
minibatches of 256 for asynchronous 1F1B, the chunks'
forward, their backward from a random output gradient or, on the last chunk, the loss, plain
autograd accumulation, an SGD step): the compute that the rank's actions hold.

    python benchmarks/rank_profile.py [--schedule interleaved-1f1b] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loop_threads import _thread_cpu  # noqa: E402
from runtime import (  # noqa: E402
    LR,
    MICRO,
    MINIBATCH,
    WIDTH,
    build_model,
    chunk_model,
    ours_pipeline,
    split_model,
)

from pdcompile.backends.launch import Worker, launch  # noqa: E402


def _preempted() -> int:
    """Involuntary context switches of gloo's loop threads of this process: times the
    scheduler took the CPU from one that was still running (it had work, or was spinning)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:
            continue
        if status.split("\n", 1)[0].split(":", 1)[1].strip().startswith("gloo_tcp_loop"):
            total += int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return total


HANDLERS = ("forward", "backward", "backward_weight", "step", "send_f", "send_b", "recv_f",
            "recv_b", "all_reduce")


class Probe:
    """Patches the distributed transport and the stage runtime of this process to time and
    count what one rank does; `reset()` between rounds, `take()` the round's figures."""

    def __init__(self) -> None:
        from pdcompile.backends import distributed
        from pdcompile.runtime import stage_runtime

        self.reset()
        probe = self
        transport_cls, pending_cls = distributed.DistributedTransport, distributed.DistPending
        runtime_cls = stage_runtime.StageRuntime
        isend = distributed.dist.isend

        def counting_isend(tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
            probe.isends += 1
            return isend(tensor, dst, *args, **kwargs)

        distributed.dist.isend = counting_isend  # type: ignore[assignment]
        # gloo's own calls, inside the handlers' time: how much of a send or a receive is gloo
        for name in ("isend", "irecv"):
            setattr(distributed.dist, name,
                    self._timed_call(f"of which gloo {name}", getattr(distributed.dist, name)))
        send, post, wait = transport_cls.send, transport_cls._post_recv, pending_cls.wait

        def timed_send(self: Any, tensors: Any, dst_rank: int, tag: Any) -> Any:
            if dst_rank == self.rank:
                probe.handovers += 1
            else:
                probe.sent[tag].append(time.time())
            pending = send(self, tensors, dst_rank, tag)
            pending.probe_tag = ("send", tag)
            return pending

        def timed_post(self: Any, specs: Any, src_rank: int, tag: Any) -> Any:
            probe.posted[tag].append(time.time())
            pending = post(self, specs, src_rank, tag)
            pending.probe_tag = ("recv", tag)
            return pending

        def timed_wait(self: Any) -> Any:
            if self._done:
                return wait(self)
            start = time.time()
            got = wait(self)
            what = getattr(self, "probe_tag", ("collective", None))
            probe.waits.append((what[0], what[1], start, time.time() - start))
            return got

        transport_cls.send = timed_send  # type: ignore[method-assign]
        transport_cls._post_recv = timed_post  # type: ignore[method-assign]
        pending_cls.wait = timed_wait  # type: ignore[method-assign]
        for name in HANDLERS:
            setattr(runtime_cls, name, self._timed_handler(name, getattr(runtime_cls, name)))
        finish = runtime_cls._finish_backward

        def timed_finish(self: Any, microbatch: int) -> None:
            start = time.thread_time()
            finish(self, microbatch)
            spent = time.thread_time() - start
            probe.cpu["W after send"] += spent
            probe.nested += spent

        runtime_cls._finish_backward = timed_finish  # type: ignore[method-assign]
        # what a run costs outside its actions: the set-up of each run (one a minibatch under
        # a flush schedule) and the driver around the generated loop
        from pdcompile.backends import distributed_announce, program

        for owner, name, label in ((program.RunProgram, "runtime", "set-up: runtimes"),
                                   (distributed_announce.Announcements, "next",
                                    "set-up: announcements"),
                                   (transport_cls, "expect", "set-up: receives posted")):
            setattr(owner, name, self._timed_call(label, getattr(owner, name)))
        distributed.drive = self._timed_call("driver, actions included", distributed.drive)

    def _timed_handler(self, name: str, handler: Callable[..., Generator[Any, None, None]]
                       ) -> Callable[..., Generator[Any, None, None]]:
        probe = self

        def timed(rt: Any, *args: Any) -> Generator[Any, None, None]:
            inner = handler(rt, *args)
            while True:
                probe.nested, start = 0.0, time.thread_time()
                try:
                    value = next(inner)
                except StopIteration:
                    probe.cpu[name] += time.thread_time() - start - probe.nested
                    return
                probe.cpu[name] += time.thread_time() - start - probe.nested
                yield value

        return timed

    def _timed_call(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                probe.calls[label] += time.thread_time() - start

        return timed

    def reset(self) -> None:
        self.calls: dict[str, float] = defaultdict(float)
        self.isends = self.handovers = 0
        self.nested = 0.0
        self.cpu: dict[str, float] = defaultdict(float)
        self.sent: dict[Any, list[float]] = defaultdict(list)
        self.posted: dict[Any, list[float]] = defaultdict(list)
        self.waits: list[tuple[str, Any, float, float]] = []

    def take(self) -> dict[str, Any]:
        return {"isends": self.isends, "handovers": self.handovers, "cpu": dict(self.cpu),
                "calls": dict(self.calls),
                "sent": {_key(t): v for t, v in self.sent.items()},
                "posted": {_key(t): v for t, v in self.posted.items()},
                "waits": [(k, _key(t) if t is not None else None, s, d)
                          for k, t, s, d in self.waits]}


def _key(tag: Any) -> tuple[Any, ...]:
    return (tag.kind, tag.src_stage, tag.dst_stage, tag.microbatch, tag.name)


def _chunks_of(schedule: str, rank: int, model: nn.Sequential) -> list[tuple[int, nn.Module]]:
    """The rank's chunks of `model` by stage, as `ours_plan` places them."""
    from pdcompile.schedule.kinds import kind

    if kind(schedule).v_shape:
        indices = [rank, 3 - rank]
    elif schedule.startswith("interleaved"):
        indices = [rank, rank + 2]
    else:
        return [(rank, split_model(model)[rank])]
    parts = chunk_model(model)
    return [(i, parts[i]) for i in indices]


def _plain(schedule: str, rank: int, steps: int) -> dict[str, float]:
    """Plain torch on the rank's chunks: ms of main-thread CPU per minibatch in the forwards,
    the backwards (weight gradients included) and the step."""
    chunks = _chunks_of(schedule, rank, build_model())
    last = max(i for i, _ in chunks) == (3 if len(chunks) > 1 else 1)
    params = [p for _, c in chunks for p in c.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    gen = torch.Generator().manual_seed(rank)
    count = 1 if schedule == "1f1b" else MICRO  # asynchronous 1F1B: whole minibatches
    micro = MINIBATCH // count
    x = torch.randn(micro, WIDTH, generator=gen)
    y = torch.randint(0, 10, (micro,), generator=gen)
    grad = torch.randn(micro, WIDTH, generator=gen) * 1e-3
    spent = defaultdict(float)
    for _ in range(steps):
        opt.zero_grad()
        for _m in range(count):
            for stage, chunk in chunks:
                start = time.thread_time()
                inp = x if stage == 0 else x.clone().requires_grad_(True)
                out = chunk(inp)
                loss = nn.functional.cross_entropy(out, y) / count \
                    if last and stage == max(i for i, _ in chunks) else None
                spent["F"] += time.thread_time() - start
                start = time.thread_time()
                if loss is not None:
                    loss.backward()
                else:
                    out.backward(grad)
                spent["B+W"] += time.thread_time() - start
        start = time.thread_time()
        opt.step()
        spent["step"] += time.thread_time() - start
    return {k: v * 1e3 / steps for k, v in spent.items()}


def _worker(worker: Worker, schedule: str, rounds: int, steps: int, warmup: int) -> Any:
    from pdcompile.backends import distributed

    torch.set_num_threads(1)
    pipe, data = ours_pipeline(schedule, max(steps, warmup, 4))
    probe = Probe()
    reads = distributed.reads_data(pipe, worker.rank)
    if warmup:
        distributed.run_distributed(pipe, data[:warmup] if reads else None,
                                    monitor=worker.monitor)
    out: dict[str, Any] = {"rounds": [], "plain": []}
    for _ in range(rounds):
        dist.barrier()
        probe.reset()
        before, preempted = _thread_cpu(), _preempted()
        run = distributed.run_distributed(pipe, data[:steps] if reads else None,
                                          monitor=worker.monitor)
        after = _thread_cpu()
        spent = {k: after[k][0] - before.get(k, (0.0, 0))[0] for k in after}
        loops = [k for k in after if k.startswith("gloo_tcp_loop")]
        got = probe.take()
        got.update(main=spent["main"] * 1e3 / steps,
                   loop=sum(spent[k] for k in loops) * 1e3 / steps,
                   preempted=(_preempted() - preempted) / steps,
                   wakes=sum(after[k][1] - before.get(k, (0.0, 0))[1] for k in loops) / steps,
                   wall=run.seconds * 1e3 / steps)
        out["rounds"].append(got)
    for _ in range(rounds):
        dist.barrier()
        out["plain"].append(_plain(schedule, worker.rank, steps))
    return out


def _why(results: list[dict[str, Any]], rank: int, r: int, steps: int) -> dict[str, float]:
    """Round r's waits of `rank`, classified against the other rank's sends."""
    mine, other = results[rank]["rounds"][r], results[1 - rank]["rounds"][r]
    seen: dict[tuple[Any, ...], int] = defaultdict(int)
    out: dict[str, float] = defaultdict(float)
    for kind, key, start, blocked in mine["waits"]:
        if kind != "recv":
            out[f"{kind} wait ms"] += blocked * 1e3 / steps
            continue
        index = seen[key]
        seen[key] += 1
        sends = other["sent"].get(tuple(key), [])
        sent = sends[index] if index < len(sends) else start
        peer = min(max(sent - start, 0.0), blocked)
        out[f"recv {key[0]}: peer not yet sent, ms"] += peer * 1e3 / steps
        out[f"recv {key[0]}: in flight, ms"] += (blocked - peer) * 1e3 / steps
        out[f"recv {key[0]}: blocking waits"] += 1 / steps
    for key, posts in mine["posted"].items():
        sends = other["sent"].get(tuple(key), [])
        late = sum(post > sent for post, sent in zip(posts, sends, strict=False))
        out[f"recv {key[0]}: posted after the send"] += late / steps
        out[f"recv {key[0]}: posted"] += len(posts) / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[0]
    results = launch(_worker, 2, args=(args.schedule, args.rounds, args.steps, args.warmup),
                     timeout=900, fault_timeout=60)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"{args.schedule}, {args.rounds} rounds of {args.steps} minibatches, load "
          f"{load_before} -> {load}; per minibatch, medians over rounds (ms unless a count)")
    for rank in (0, 1):
        rounds = results[rank]["rounds"]

        def med(f: Callable[[dict[str, Any]], float], rounds: list[Any] = rounds) -> float:
            return statistics.median(f(x) for x in rounds)

        plain = {k: statistics.median(p[k] for p in results[rank]["plain"])
                 for k in results[rank]["plain"][0]}
        cpu = {k: med(lambda x, k=k: x["cpu"].get(k, 0.0) * 1e3 / args.steps)
               for k in [*HANDLERS, "W after send"]}
        main_ms = med(lambda x: x["main"])
        print(f"rank {rank}: wall {med(lambda x: x['wall']):.1f}, main thread {main_ms:.1f} "
              f"(plain torch F {plain['F']:.1f} B+W {plain['B+W']:.1f} step "
              f"{plain['step']:.1f} = {sum(plain.values()):.1f}), loop threads "
              f"{med(lambda x: x['loop']):.1f}, wake-ups {med(lambda x: x['wakes']):.0f} "
              f"(preempted {med(lambda x: x['preempted']):.0f}), "
              f"isends {med(lambda x: x['isends'] / args.steps):.1f}, hand-overs "
              f"{med(lambda x: x['handovers'] / args.steps):.1f}")
        actions = sum(cpu.values())
        calls = {k: med(lambda x, k=k: x["calls"].get(k, 0.0) * 1e3 / args.steps)
                 for k in ("set-up: runtimes", "set-up: announcements",
                           "set-up: receives posted", "driver, actions included",
                           "of which gloo isend", "of which gloo irecv")}
        driver = calls.pop("driver, actions included")
        gloo = {k: calls.pop(k) for k in ("of which gloo isend", "of which gloo irecv")}
        print("  actions: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items() if v)
              + "".join(f", {k} {v:.2f}" for k, v in gloo.items())
              + f" (together {actions:.1f}); outside actions {main_ms - actions:.1f}: the "
              f"driver's own {driver - actions:.2f}, "
              + ", ".join(f"{k} {v:.2f}" for k, v in calls.items())
              + f", the rest {main_ms - driver - sum(calls.values()):.2f}")
        why = [_why(results, rank, r, args.steps) for r in range(len(rounds))]
        keys = sorted({k for w in why for k in w})
        print("  waits: " + ", ".join(
            f"{k} {statistics.median(w.get(k, 0.0) for w in why):.1f}" for k in keys))


if __name__ == "__main__":
    main()
