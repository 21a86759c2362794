"""The CPU gloo's I/O threads burn per minibatch, and the messages each rank sends, in a
2-process run of benchmarks/runtime.py's MLP (our pipeline, the 4 | 4 + head split).

Wall-clock ratios on the shared 2-core machine move with the load; the messages a rank sends
per minibatch (a count) do not, and the CPU of gloo's loop threads per minibatch (threads named
gloo_tcp_loop*, the scheduler's nanosecond count in /proc/self/task/*/schedstat) moves much
less than wall time. Each rank trains --warmup minibatches, then --rounds runs of --steps
minibatches; per round and rank it reports ms of CPU per minibatch on the main thread, on
gloo's loop threads and on the others, the loop threads' wake-ups per minibatch (voluntary
context switches: a count, which the load moves little) and `isend` calls per minibatch by
destination. To compare two trees, run it with each tree first on PYTHONPATH, alternating.

    python benchmarks/loop_threads.py [--schedule 1f1b-flush] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runtime import BLOCKS, LR, MICRO, build_model, make_data  # noqa: E402

from pdcompile.backends.launch import Worker, launch  # noqa: E402


def _thread_cpu() -> dict[str, tuple[float, int]]:
    """By thread name ('main' for the main thread), summed over this process's threads of
    that name: seconds on a CPU (the scheduler's nanosecond count, not 10 ms ticks) and
    voluntary context switches (the times it slept: its wake-ups)."""
    out: dict[str, tuple[float, int]] = {}
    pid = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended
            continue
        name = "main" if int(tid) == pid else status.split("\n", 1)[0].split(":", 1)[1].strip()
        woke = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        cpu, wakes = out.get(name, (0.0, 0))
        out[name] = (cpu + ran, wakes + woke)
    return out


def _worker(worker: Worker, schedule: str, rounds: int, steps: int,
            warmup: int) -> list[dict[str, Any]]:
    import pdcompile
    from pdcompile.backends import distributed
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace

    torch.set_num_threads(1)
    model = build_model()
    gm = trace(model)
    plan = manual_plan(gm, lambda node: int(
        node.op == "call_module" and int(str(node.target)) >= BLOCKS))
    data = make_data(max(steps, warmup, 4))
    flush = schedule != "1f1b"
    pipe = pdcompile.compile(model, example_inputs=(data[0][0],), example_target=data[0][1],
                             loss_fn=torch.nn.functional.cross_entropy,
                             optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                             schedule=schedule, microbatches=MICRO if flush else None,
                             plan=plan)
    sent: dict[int, int] = {}
    isend = distributed.dist.isend

    def counting(tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
        sent[dst] = sent.get(dst, 0) + 1
        return isend(tensor, dst, *args, **kwargs)

    distributed.dist.isend = counting  # type: ignore[assignment]
    reads = distributed.reads_data(pipe, worker.rank)
    if warmup:
        distributed.run_distributed(pipe, data[:warmup] if reads else None,
                                    monitor=worker.monitor)
    out = []
    for _ in range(rounds):
        dist.barrier()
        sent.clear()
        before = _thread_cpu()
        distributed.run_distributed(pipe, data[:steps] if reads else None,
                                    monitor=worker.monitor)
        after = _thread_cpu()
        spent = {k: after[k][0] - before.get(k, (0.0, 0))[0] for k in after}
        loops = [k for k in after if k.startswith("gloo_tcp_loop")]
        loop = sum(spent[k] for k in loops)
        woke = sum(after[k][1] - before.get(k, (0.0, 0))[1] for k in loops)
        out.append({"main": spent["main"] * 1e3 / steps, "loop": loop * 1e3 / steps,
                    "others": (sum(spent.values()) - spent["main"] - loop) * 1e3 / steps,
                    "wakes": woke / steps, "sent": {k: v / steps for k, v in sent.items()}})
    distributed.dist.isend = isend  # type: ignore[assignment]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b-flush")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    results = launch(_worker, 2, args=(args.schedule, args.rounds, args.steps, args.warmup),
                     timeout=600)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"{args.schedule}, load {load}: ms of CPU per minibatch (main thread, gloo loop "
          "threads, other threads); loop threads' wake-ups and isend calls per minibatch")
    for rank, rounds in enumerate(results):
        for r in rounds:
            print(f"rank {rank}: main {r['main']:.1f} loop {r['loop']:.1f} "
                  f"others {r['others']:.1f} wakes {r['wakes']:.0f} sent {r['sent']}")


if __name__ == "__main__":
    main()
