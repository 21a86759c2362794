"""Where each rank's time goes in a 2-process run of benchmarks/runtime.py's MLP, by CPU time.

Wall-clock ratios on a shared machine move with the load; CPU time spent per minibatch, and what
it is spent on, moves much less. For each schedule this launches 2 gloo processes (one thread
each, the 4 | 4 + head split or the interleaved chunks of benchmarks/runtime.py), trains
--warmup minibatches, then --steps minibatches three times:

1. plain: the main thread's CPU time (`time.thread_time`), the whole process's (gloo's threads
   included) and the wall time, per minibatch;
2. under cProfile on the thread's CPU clock: the own CPU time of every function, built-ins
   grouped into compute (the matmuls inside linear/mm/addmm_ and autograd's backward, ReLU, the
   loss, the SGD update), copies and allocation (clone, copy_, zeros, empty, cat), communication
   (c10d calls, waits), other built-ins, and Python (every function written in Python: the
   runtime, generated code, nn.Module calls, torch's Python layers); the groups are scaled to
   run 1's CPU time (taking cProfile's own cost out), and the optimizer step's share shown;
   Python calls per minibatch (a count, which load does not change);
3. under torch.profiler: aten ops and allocating aten ops per minibatch (counts).

One process, one thread, plain training (`single`) is profiled the same way: the compute a
minibatch needs, which two ranks share.

    python benchmarks/profile_runtime.py [--schedules 1f1b,1f1b-flush,...] [--steps 8]
        [--md FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runtime as bench  # noqa: E402 - benchmarks/runtime.py, beside this file
from runtime import (  # noqa: E402
    BLOCKS,
    LR,
    MICRO,
    MINIBATCH,
    build_model,
    chunk_of,
    make_data,
)

from pdcompile.backends.launch import Worker, launch  # noqa: E402
from pdcompile.runtime.allocator import tune_allocator  # noqa: E402

# cProfile's built-in entries by what they do (the first list that matches a name wins)
CATEGORIES = (
    ("communication", ("c10d", "_distributed", "broadcast", "all_reduce", "barrier", "isend",
                       "irecv", "wait", "send", "recv")),
    ("copies, allocation", ("clone", "copy_", "contiguous", "zeros", "empty", "cat",
                            "ones", "full", "tensor", "detach", "fill_", "zero_")),
    ("compute", ("linear", "mm", "matmul", "run_backward", "relu", "sum", "add_", "addmm",
                 "cross_entropy", "div_", "mul", "_foreach", "threshold")),
)
GROUPS = ("compute", "copies, allocation", "communication", "other built-ins", "Python")
ALLOCATING = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros",
              "aten::zeros_like", "aten::clone", "aten::cat", "aten::ones_like"}


def _compile(schedule: str) -> Any:
    """Our pipeline of the benchmark (benchmarks/runtime.py's `_ours_worker`)."""
    import pdcompile
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace
    from pdcompile.planner.interleave import interleave

    model = build_model()
    gm = trace(model)
    if schedule.startswith("interleaved"):
        plan = interleave(manual_plan(gm, lambda node: chunk_of(int(str(node.target)))
                                      if node.op == "call_module" else 0), 2)
    else:
        plan = manual_plan(gm, lambda node: int(
            node.op == "call_module" and int(str(node.target)) >= BLOCKS))
    data = make_data(4)
    flush = schedule != "1f1b"
    return pdcompile.compile(model, example_inputs=(data[0][0],), example_target=data[0][1],
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                             schedule=schedule, microbatches=MICRO if flush else None,
                             plan=plan)


def _category(key: tuple[str, int, str]) -> str:
    """What a cProfile entry's own time is spent on."""
    filename, _line, name = key
    if filename != "~":
        return "Python"
    for category, words in CATEGORIES:
        if any(w in name for w in words):
            return category
    return "other built-ins"


def _measure(train: Callable[[], None], steps: int) -> dict[str, Any]:
    """CPU and wall time of `train()` (run 1); its CPU time by what it is spent on and its
    Python calls (run 2, cProfile on the thread's CPU clock); its aten ops (run 3)."""
    from torch.profiler import ProfilerActivity, profile

    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    train()
    out: dict[str, Any] = {
        "wall": (time.perf_counter() - wall) / steps,
        "thread": (time.thread_time() - thread) / steps,
        "process": (time.process_time() - process) / steps}
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    train()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    groups = dict.fromkeys(GROUPS, 0.0)
    for key, (_cc, _calls, own, _cum, _callers) in stats.items():
        groups[_category(key)] += own / steps
    optimizer = sum(v[3] for k, v in stats.items() if k[2] == "step" and k[0].endswith(
        os.path.join("optim", "sgd.py"))) / steps
    total = sum(groups.values())
    groups = {k: v * out["thread"] / total for k, v in groups.items()}  # cProfile's own cost out
    out["groups"] = groups
    out["optimizer"] = optimizer * out["thread"] / total
    out["py_calls"] = sum(v[1] for v in stats.values()) / steps
    own = sorted(((v[2], f"{os.path.basename(k[0])}:{k[2]}") for k, v in stats.items()),
                 reverse=True)[:14]
    out["py_top"] = [(name, t / steps) for t, name in own]
    most = sorted(((v[1], f"{os.path.basename(k[0])}:{k[1]}:{k[2]}") for k, v in
                   stats.items()), reverse=True)[:30]
    out["py_most"] = [(name, n / steps) for n, name in most]
    cumulative = sorted(((v[3], f"{os.path.basename(k[0])}:{k[2]}") for k, v in
                         stats.items() if "pdcompile" in k[0]), reverse=True)[:30]
    out["py_cumulative"] = [(name, t / steps) for t, name in cumulative]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train()
    events = prof.key_averages()
    out["op_calls"] = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    out["allocations"] = sum(e.count for e in events if e.key in ALLOCATING) / steps
    return out


def _ours(worker: Worker, schedule: str, steps: int, warmup: int, width: int) -> dict[str, Any]:
    from pdcompile.backends.distributed import run_distributed

    torch.set_num_threads(1)
    bench.WIDTH = width
    pipe = _compile(schedule)
    data = make_data(max(steps, warmup))
    run_distributed(pipe, data[:warmup], monitor=worker.monitor)

    def train() -> None:
        run_distributed(pipe, data[:steps], monitor=worker.monitor)

    return _measure(train, steps)


def _single(steps: int, warmup: int, micro: int, width: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    bench.WIDTH = width
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = make_data(max(steps, warmup))
    loss_fn = nn.CrossEntropyLoss()

    def train(n: int = steps) -> None:
        for x, y in data[:n]:
            opt.zero_grad()
            for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
                (loss_fn(model(xs), ys) / micro).backward()
            opt.step()

    train(warmup)
    return _measure(train, steps)


def _row(name: str, rank: str, got: dict[str, Any]) -> str:
    ms = 1e3
    groups = got["groups"]
    cells = [f"{got['wall'] * ms:.0f}", f"{got['thread'] * ms:.1f}",
             f"{max(got['process'] - got['thread'], 0.0) * ms:.1f}"]
    cells += [f"{groups[g] * ms:.1f}" for g in GROUPS]
    cells += [f"{got['optimizer'] * ms:.1f}", f"{got['py_calls']:.0f}",
              f"{got['op_calls']:.0f}", f"{got['allocations']:.0f}"]
    return f"| {name} | {rank} | " + " | ".join(cells) + " |"


HEADER = ("| run | rank | wall | main thread CPU | other threads' CPU | compute (matmuls, "
          "autograd, ReLU, loss, SGD) | copies, allocation | communication | other built-ins | "
          "Python | of which optimizer step | Python calls | aten ops | allocating ops |\n"
          "|---|---|" + "---:|" * 12)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,1f1b-flush,interleaved-1f1b,zb-h1,"
                        "interleaved-zb")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--md", default="")
    parser.add_argument("--width", type=int, default=bench.WIDTH, help="the MLP's width; a "
                        "small one (8) leaves almost no compute: what remains is overhead")
    parser.add_argument("--top", action="store_true", help="also print the top ops and "
                        "Python functions per rank")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tune_allocator()
    load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    lines = [f"MLP width {args.width}, ms per minibatch of {MINIBATCH} ({MICRO} microbatches of "
             f"{MINIBATCH // MICRO} where microbatched), {args.steps} minibatches, load average "
             f"{load} at the start, "
             f"torch {torch.__version__}", "", HEADER]
    details = []
    for micro in (1, MICRO):
        single = _single(args.steps, args.warmup, micro, args.width)
        lines.append(_row("single" if micro == 1 else f"single-{micro}", "-", single))
        print(lines[-1], file=sys.stderr, flush=True)
        details.append((f"single-{micro}", "-", single))
    for schedule in [s for s in args.schedules.split(",") if s]:
        got = launch(_ours, 2, args=(schedule, args.steps, args.warmup, args.width), timeout=1800,
                     fault_timeout=120)
        for rank, result in enumerate(got):
            lines.append(_row(schedule, str(rank), result))
            print(lines[-1], file=sys.stderr, flush=True)
            details.append((schedule, rank, result))
    if args.top:
        for schedule, rank, result in details:
            print(f"\n{schedule} rank {rank}:", file=sys.stderr)
            print("  top Python (own ms/minibatch): " + ", ".join(
                f"{k} {v * 1e3:.2f}" for k, v in result["py_top"]), file=sys.stderr)
            print("  pdcompile, cumulative (ms/minibatch): " + ", ".join(
                f"{k} {v * 1e3:.2f}" for k, v in result["py_cumulative"]), file=sys.stderr)
            print("  most called (calls/minibatch): " + ", ".join(
                f"{k} {v:.0f}" for k, v in result["py_most"]), file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
