"""What a tied weight split across two ranks costs a step, measured against its price.

Model: a token embedding of VOCAB x WIDTH (50,000 x 768 in float32: 153.6 MB, GPT-2's size)
read at the input and again as the output head (tied), with two Linear(WIDTH, WIDTH) + tanh
between; the untied twin gives the head its own weight of the same size. Both are cut
embedding | layers + head on 2 gloo processes (one thread each) under 1F1B-flush, 2
microbatches of 4 sequences of 2 tokens (little compute, so the all-reduce shows), SGD. The
tied run all-reduces the head's and the embedding's gradients (153.6 MB) at every update
(runtime/stage_runtime.py `reduce_tie`); the untied run does not, and otherwise does the same
work (each stage holds and steps one VOCAB x WIDTH weight either way).

Rounds of --steps minibatches alternate tied and untied (a load from elsewhere hits both); a
round's time is `run_distributed`'s training loop, the slower rank's. The table gives the
medians per minibatch, their difference, and the price of the all-reduce: cost/ties.py's ring
on `local-2` (this machine's loopback all-reduce rate, measured through the runtime's path and
cached), the difference the simulator and the closed form predict between the plans from one
cost pass of the tied model, with its tie and without it, and gloo's all-reduce of one tensor
of the tie's size timed in the same two processes after the rounds (at the load of the
moment).

`--schedule 1f1b` runs asynchronous 1F1B instead (whole minibatches, an update each): there the
tie also makes the head's stage wait at every update for the embedding's stage to reach its
own, after the minibatch's backward has crossed back, so the pipeline no longer overlaps the
stages (cost/steady_cycle.py prices that).

    python benchmarks/tie_allreduce.py [--rounds 5] [--steps 6] [--schedule 1f1b] [--md FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdcompile.backends.launch import Worker, launch  # noqa: E402

VOCAB, WIDTH, BATCH, TOKENS, MICRO = 50_000, 768, 8, 2, 2


class HeadTied(nn.Module):
    """Embedding -> 2 x (Linear + tanh) -> head onto the vocabulary, tied or not."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator),
             torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator))
            for _ in range(steps)]


def pipeline(tied: bool, cluster: Any = None, schedule: str = "1f1b-flush") -> Any:
    """The compiled 2-stage pipeline (embedding | the rest)."""
    import pdcompile
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace

    torch.manual_seed(0)
    model = HeadTied(tied)
    plan = manual_plan(trace(model), lambda node: int(node.op != "placeholder"
                                                      and str(node.target) != "emb"))
    idx, target = batches(1)[0]
    return pdcompile.compile(model, example_inputs=(idx,), example_target=target,
                             loss_fn=loss_fn, plan=plan, schedule=schedule,
                             microbatches=MICRO if schedule != "1f1b" else None,
                             cluster=cluster,
                             optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))


def _worker(worker: Worker, rounds: int, steps: int, schedule: str) -> dict[str, list[float]]:
    import torch.distributed as dist

    from pdcompile.backends.distributed import run_distributed

    torch.set_num_threads(1)
    pipes = {name: pipeline(name == "tied", schedule=schedule) for name in ("tied", "untied")}
    data = batches(steps)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for pipe in pipes.values():  # warm-up
        run_distributed(pipe, data[:2], monitor=worker.monitor)
    for _ in range(rounds):
        for name, pipe in pipes.items():
            run = run_distributed(pipe, data, monitor=worker.monitor)
            mine = torch.tensor([run.seconds])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            times[name].append(float(mine) / steps)
    # the all-reduce alone, at this moment's load: gloo's ring of one tensor of the tie's size
    grads = torch.ones(VOCAB * WIDTH)
    times["allreduce"] = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(grads)
        mine = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        times["allreduce"].append(float(mine))
    return times


def predicted(schedule: str = "1f1b-flush") -> dict[str, float]:
    """The all-reduce's price on local-2, and the tied model's plan priced on local-2 from one
    cost pass with its tie and without it (the same node costs: the difference is the tie's)."""
    from pdcompile import Cluster
    from pdcompile.cost.costed_graph import costed_graph
    from pdcompile.cost.ties import SharedWeights
    from pdcompile.passes.split import manual_plan
    from pdcompile.passes.trace import trace
    from pdcompile.planner import price_plan

    cluster = Cluster.preset("local-2")
    tie = SharedWeights((0, 1), float(VOCAB * WIDTH * 4))
    out = {"price": tie.seconds([(0,), (1,)], cluster),
           "allreduce_rate": cluster.levels[0].allreduce_rate}
    torch.manual_seed(0)
    model = HeadTied(tied=True)
    plan = manual_plan(trace(model), lambda node: int(node.op != "placeholder"
                                                      and str(node.target) != "emb"))
    plan = dataclasses.replace(plan, schedule=schedule,
                               microbatches=MICRO if schedule != "1f1b" else 1)
    graph = costed_graph(model, (batches(1)[0][0],), cluster)
    untied = graph.copy()
    del untied.graph["ties"]
    for name, priced_graph in (("tied", graph), ("untied", untied)):
        priced = price_plan(priced_graph, plan, cluster, simulate=True)
        out[name] = priced.extra["simulated_time_per_minibatch"]
        out[name + "_closed"] = priced.extra["closed_form_time_per_minibatch"]
    return out


def table(measured: dict[str, list[float]], price: dict[str, float], rounds: int,
          steps: int, schedule: str) -> str:
    tied, untied = (statistics.median(measured[n]) for n in ("tied", "untied"))
    load = os.getloadavg()
    ms = 1e3
    return "\n".join([
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load[0]:.1f}, "
        f"{schedule}, {rounds} rounds of {steps} minibatches, medians per minibatch:",
        "",
        "| | tied | untied | difference |",
        "|---|---|---|---|",
        f"| measured (2 gloo processes) | {tied * ms:.1f} ms | {untied * ms:.1f} ms | "
        f"**{(tied - untied) * ms:.1f} ms** |",
        f"| simulated from one cost pass, with and without the tie (local-2) | "
        f"{price['tied'] * ms:.1f} ms | "
        f"{price['untied'] * ms:.1f} ms | {(price['tied'] - price['untied']) * ms:.1f} ms |",
        f"| the planner's closed form (local-2) | {price['tied_closed'] * ms:.1f} ms | "
        f"{price['untied_closed'] * ms:.1f} ms | "
        f"{(price['tied_closed'] - price['untied_closed']) * ms:.1f} ms |",
        f"| the all-reduce's price (cost/ties.py, {VOCAB * WIDTH * 4 / 1e6:.1f} MB at "
        f"{price['allreduce_rate'] / 1e9:.2f} GB/s) | | | **{price['price'] * ms:.1f} ms** |",
        f"| gloo's all-reduce of one {VOCAB * WIDTH * 4 / 1e6:.1f} MB tensor, timed in the same "
        f"processes after the rounds | | | {statistics.median(measured['allreduce']) * ms:.1f} "
        "ms |",
        "",
        f"rounds, tied: {', '.join(f'{t * ms:.1f}' for t in measured['tied'])} ms; untied: "
        f"{', '.join(f'{t * ms:.1f}' for t in measured['untied'])} ms",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--md", default="")
    parser.add_argument("--schedule", default="1f1b-flush", choices=("1f1b-flush", "1f1b"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    price = predicted(args.schedule)
    results = launch(_worker, 2, args=(args.rounds, args.steps, args.schedule), timeout=1500,
                     fault_timeout=120)
    measured = {name: [max(a, b) for a, b in zip(results[0][name], results[1][name],
                                                  strict=True)] for name in results[0]}
    text = table(measured, price, args.rounds, args.steps, args.schedule)
    print(text)
    if args.md:
        with open(args.md, "a") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
