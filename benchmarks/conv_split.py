"""Zero-bubble schedules on a CNN: what deferring the convolutions' weight gradients buys.

A CNN of 8 Conv2d(C, C, 3) + ReLU blocks and a Linear head, cut 4 | 4 + head over 2 gloo
processes (one thread each), 8 microbatches of 32 images per minibatch. Side by side, rounds
interleaved (a load from elsewhere hits every configuration alike):

    flush        1f1b-flush
    zb           zb-h1, convolutions' dW deferred to W (runtime/conv_grads.py)
    zb-linear    zb-h1 with only the Linear head's dW deferred (the runtime before
                 conv_grads.py: the convolutions computed theirs in B)
    zbv          zb-v, 4 chunks of 2 blocks (the last with the head) in a V on the 2 ranks
    zbv-linear   zb-v with only the head's dW deferred

and the prediction of each: the plan priced on `local-2` from the cost pass's measured node
costs (`pipe.plan.time_per_minibatch`). Prints a Markdown table; `--md FILE` writes it too.

    python benchmarks/conv_split.py [--rounds 4] [--steps 8] [--md FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from pdcompile.backends.launch import Worker, launch
from pdcompile.runtime.allocator import tune_allocator

CHANNELS, SIDE, BLOCKS, CLASSES, MINIBATCH, MICRO = 32, 16, 8, 10, 256, 8
CONFIGS = {"flush": ("1f1b-flush", True), "zb": ("zb-h1", True),
           "zb-linear": ("zb-h1", False), "zbv": ("zb-v", True), "zbv-linear": ("zb-v", False)}


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(CHANNELS * SIDE * SIDE, CLASSES))


def make_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    distinct = [(torch.randn(MINIBATCH, CHANNELS, SIDE, SIDE, generator=gen),
                 torch.randint(0, CLASSES, (MINIBATCH,), generator=gen)) for _ in range(2)]
    return [distinct[i % 2] for i in range(steps)]


def pipeline(name: str, steps: int) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pipeline of configuration `name` and `steps` minibatches."""
    import pdcompile
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace
    from pdcompile.planner.interleave import fold_v

    schedule, convs = CONFIGS[name]
    model = build_model()
    gm = trace(model)
    if schedule == "zb-v":  # chunk c: blocks 2c and 2c + 1 (layers 4c..4c+3), the head in 3
        plan = fold_v(manual_plan(gm, lambda node: min(int(str(node.target)) // 4, 3)
                                  if node.op == "call_module" else 0))
    else:
        plan = manual_plan(gm, lambda node: int(
            node.op == "call_module" and int(str(node.target)) >= 2 * BLOCKS // 2))
    data = make_data(steps)
    patch = mock.patch("pdcompile.passes.fuse.deferrable_convs", lambda gm: []) if not convs \
        else mock.patch.dict({})
    with patch:
        pipe = pdcompile.compile(model, example_inputs=(data[0][0],),
                                 example_target=data[0][1],
                                 loss_fn=nn.functional.cross_entropy,
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                                 schedule=schedule, microbatches=MICRO, plan=plan,
                                 cluster="local-2")
    return pipe, data


def _worker(worker: Worker, name: str, steps: int, warmup: int) -> list[float]:
    from pdcompile.backends.distributed import run_distributed

    pipe, data = pipeline(name, max(steps, warmup))
    if warmup:
        run_distributed(pipe, data[:warmup], monitor=worker.monitor)
    run = run_distributed(pipe, data[:steps], monitor=worker.monitor)
    mine = torch.tensor([run.seconds])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return [float(mine)]


def predicted_ms(name: str) -> float:
    """The predicted time per minibatch of configuration `name` on `local-2` (the plan priced
    from the cost pass's measured node costs)."""
    pipe, _ = pipeline(name, 1)
    return 1e3 * float(pipe.plan.time_per_minibatch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--md", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tune_allocator()
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            values = launch(_worker, 2, args=(name, args.steps, args.warmup), timeout=1800,
                            fault_timeout=60)
            seconds[name].append(max(values[0][0], values[1][0]))
            print(f"{name}: {seconds[name][-1]:.3f} s", file=sys.stderr, flush=True)
    rates = {name: statistics.median(args.steps * MINIBATCH / t for t in ts)
             for name, ts in seconds.items()}
    predicted = {name: predicted_ms(name) for name in CONFIGS}
    lines = [f"machine: {platform.machine()}, torch {torch.__version__}, 2 processes x 1 "
             f"thread, {args.rounds} rounds x {args.steps} minibatches of {MINIBATCH} "
             f"({MICRO} microbatches), medians", "",
             "| configuration | samples/s | ms per minibatch | predicted ms | rounds (samples/s) |",
             "|---|---:|---:|---:|---|"]
    for name, ts in seconds.items():
        per = [args.steps * MINIBATCH / t for t in ts]
        lines.append(f"| {name} ({CONFIGS[name][0]}) | {rates[name]:.1f} | "
                     f"{1e3 * MINIBATCH / rates[name]:.1f} | {predicted[name]:.1f} | "
                     f"{', '.join(f'{r:.0f}' for r in per)} |")
    lines += ["", f"zb / flush: {rates['zb'] / rates['flush']:.2f}x measured, "
              f"{predicted['flush'] / predicted['zb']:.2f}x predicted; zb / zb-linear: "
              f"{rates['zb'] / rates['zb-linear']:.2f}x measured, "
              f"{predicted['zb-linear'] / predicted['zb']:.2f}x predicted; zbv / zbv-linear: "
              f"{rates['zbv'] / rates['zbv-linear']:.2f}x measured, "
              f"{predicted['zbv-linear'] / predicted['zbv']:.2f}x predicted"]
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
