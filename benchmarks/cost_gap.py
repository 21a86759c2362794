"""Where the cost pass's per-node times and the runtime's per-action work part, per stage.

benchmarks/mixed.py's MLP (8 x Linear(1024) + ReLU, a Linear(1024, 10) head, minibatches of 64,
cross-entropy, SGD), planned on `local-2` as an even split (or `--stages 1`: one stage). One
process, one torch thread, every figure the thread's CPU time (`time.thread_time`; other work on
the machine takes cores away but not this thread's CPU seconds), medians of `--repeats`, side by
side in one run. Per stage, forward and backward of one minibatch:

1. nodes alone: the cost pass (`annotate_costs`, what the planner and simulator read), each
   node timed alone with its timing overhead subtracted, summed;
2. nodes alone, overhead kept: the same without subtracting the per-node timing overhead;
3. the stage in sequence, plain autograd: the stage's GraphModule before the fuse pass, forward
   then backward from all-ones gradients (`measure_model`);
4. the stage in sequence, fused: the compiled stage module (runtime/linear_grads.py), inside
   `accumulating_grads()`, forward then backward;
5. the runtime: a local dry run (`Pipeline.timed()`), each F and B action's duration, with the
   runtime's clock read as this thread's CPU time; the loss is inside the last stage's F and B;
6. the per-action overhead the cost pass now adds (`machine/action_overhead.py`).

    python benchmarks/cost_gap.py [--stages 2] [--repeats 9] [--minibatches 24]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mixed import BATCH, batches, mlp  # noqa: E402

import pdcompile  # noqa: E402
from pdcompile.cost.node_costs import annotate_costs, measure_model, to_cost_graph  # noqa: E402
from pdcompile.cost.timers import CpuTimeTimer  # noqa: E402
from pdcompile.machine.cluster import Cluster  # noqa: E402
from pdcompile.passes.shapes import annotate_shapes  # noqa: E402
from pdcompile.passes.trace import trace  # noqa: E402
from pdcompile.runtime.linear_grads import accumulating_grads  # noqa: E402


def _stage_nodes(plan: Any) -> list[set[str]]:
    return [set(stage.nodes) for stage in plan.stages]


def _fused_sequence(module: torch.nn.Module, inputs: tuple[Any, ...], *,
                    repeats: int, grads_in: bool) -> tuple[float, float]:
    """Forward and backward of a compiled (fused) stage module, as the runtime calls it."""
    fwd, bwd = [], []
    clock = time.thread_time
    for i in range(repeats + 2):
        leaves = [x.detach().requires_grad_(grads_in and x.is_floating_point())
                  for x in inputs]
        start = clock()
        with torch.enable_grad(), accumulating_grads():
            out = module(*leaves)
        mid = clock()
        outs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        end = clock()
        if i >= 2:
            fwd.append(mid - start)
            bwd.append(end - mid)
        module.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--minibatches", type=int, default=24)
    parser.add_argument("--overhead", action="store_true",
                        help="also add the measured per-action overhead to the cost pass")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    cluster = Cluster.preset("local-2")
    model, example, target = mlp()
    gm = trace(model)
    annotate_shapes(gm, (example,))
    annotate_costs(gm, (example,), clock="cpu", repeats=args.repeats)
    graph = to_cost_graph(gm, name="mlp")
    kept = {n.name: n for n in gm.graph.nodes}
    gm_raw = trace(mlp()[0])
    annotate_shapes(gm_raw, (example,))
    from pdcompile.cost import node_costs

    saved = node_costs._overheads
    node_costs._overheads = lambda *a, **k: (0.0, 0.0)  # type: ignore[assignment]
    try:
        annotate_costs(gm_raw, (example,), clock="cpu", repeats=args.repeats)
    finally:
        node_costs._overheads = saved
    plan = pdcompile.plan(graph, cluster, straight=True)  # the even split
    pipe = pdcompile.compile(mlp()[0], example_inputs=(example,), example_target=target,
                             plan=plan, loss_fn=torch.nn.functional.cross_entropy)
    # the runtime's clock as this thread's CPU time (one process, one thread: the local backend)

    import pdcompile.runtime.stage_runtime as sr

    cpu_time = types.SimpleNamespace(time=time.thread_time, perf_counter=time.thread_time,
                                     monotonic=time.thread_time, sleep=time.sleep)
    patched = [sr]
    originals = [m.time for m in patched]  # type: ignore[attr-defined]
    for m in patched:
        m.time = cpu_time  # type: ignore[attr-defined]
    try:
        pipe.timed()
        pipe.train(batches(args.minibatches))
    finally:
        for m, orig in zip(patched, originals, strict=True):
            m.time = orig  # type: ignore[attr-defined]
    timeline = pipe.last_timeline
    assert timeline is not None
    actions: dict[tuple[int, str], list[float]] = {}
    for event in timeline.events[len(timeline.events) // 4:]:
        kind = event.parsed().kind.name
        if kind in ("F", "B", "STEP"):
            actions.setdefault((event.rank, kind), []).append(event.duration)
    values = pipe._example_values((example,))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"load average {load[0]:.2f} {load[1]:.2f}; {stamp}")
    print(f"config {plan.config}, minibatch {BATCH}; ms, thread CPU time")
    print("| stage | nodes alone (cost pass) | nodes alone, timing overhead kept | sequence, "
          "plain autograd | sequence, fused Linear | runtime action | step |")
    print("|---|---|---|---|---|---|---|")
    for s, (program, stage) in enumerate(zip(pipe.parts.stages, plan.stages, strict=True)):
        names = set(stage.nodes)
        f1 = sum(node_costs.get_cost(kept[n]).fwd for n in names if n in kept)
        b1 = sum(node_costs.get_cost(kept[n]).bwd for n in names if n in kept)
        raw = {n.name: n for n in gm_raw.graph.nodes}
        f2 = sum(node_costs.get_cost(raw[n]).fwd for n in names if n in raw)
        b2 = sum(node_costs.get_cost(raw[n]).bwd for n in names if n in raw)
        inputs = tuple(example if r.stage is None else
                       values[r.stage, r.name].detach().requires_grad_()
                       for r in program.inputs)
        plain = _plain_stage(pipe, s)
        f3, b3 = measure_model(plain, inputs, clock="cpu", repeats=args.repeats,
                               timer=CpuTimeTimer(clock=time.thread_time))
        f4, b4 = _fused_sequence(program.module, inputs, repeats=args.repeats,
                                 grads_in=s > 0)
        rank = s
        f5 = statistics.median(actions[rank, "F"])
        b5 = statistics.median(actions[rank, "B"])
        st = statistics.median(actions[rank, "STEP"])
        print(f"| {s} | {f1 * 1e3:.2f} + {b1 * 1e3:.2f} = {(f1 + b1) * 1e3:.2f} | "
              f"{f2 * 1e3:.2f} + {b2 * 1e3:.2f} = {(f2 + b2) * 1e3:.2f} | "
              f"{f3 * 1e3:.2f} + {b3 * 1e3:.2f} = {(f3 + b3) * 1e3:.2f} | "
              f"{f4 * 1e3:.2f} + {b4 * 1e3:.2f} = {(f4 + b4) * 1e3:.2f} | "
              f"{f5 * 1e3:.2f} + {b5 * 1e3:.2f} = {(f5 + b5) * 1e3:.2f} | {st * 1e3:.2f} |")
    return 0


def _plain_stage(pipe: Any, stage: int) -> torch.nn.Module:
    """The stage's module with its fused Linear calls put back to plain `F.linear`."""
    import copy

    from pdcompile.runtime.linear_grads import linear_accumulate

    module = copy.deepcopy(pipe.parts.stages[stage].module)
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is linear_accumulate:
            node.target = torch.nn.functional.linear
    module.recompile()
    return module


if __name__ == "__main__":
    sys.exit(main())
