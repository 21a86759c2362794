"""Where the cost pass's per-node times and the runtime's per-action work part, per stage.

benchmarks/mixed.py's MLP (8 x Linear(1024) + ReLU, a Linear(1024, 10) head, minibatches of 64,
cross-entropy, SGD), planned on `local-2` as an even split (`--slowed`: the plan for rank 1
emulated 2x slower, mixed.py's "ours"). One
process, one torch thread, every figure the thread's CPU time (`time.thread_time`; other work on
the machine takes cores away but not this thread's CPU seconds), medians of `--repeats`, side by
side in one run. Per stage, forward and backward of one minibatch:

1. the cost pass as it was: each node's forward and backward timed alone (again and again, on
   its recorded inputs), its timing overhead subtracted, summed over the stage's nodes;
2. the cost pass now (`annotate_costs`, what the planner and simulator read): forwards timed
   where the model's forward pass meets them, backwards alone;
3. the stage in sequence, plain autograd: the stage's GraphModule before the fuse pass, forward
   then backward from all-ones gradients (`measure_model`);
4. the stage in sequence, fused: the compiled stage module (runtime/linear_grads.py), inside
   `accumulating_grads()`, forward then backward;
5. the runtime: a local dry run (`Pipeline.timed()`), each F and B action's duration, with the
   runtime's clock read as this thread's CPU time; the loss is inside the last stage's F and B;
6. the weight copy of stashing (`time_weight_copies`), which stage 0's runtime F includes and
   the simulator prices apart; the optimizer step (the runtime's STEP action).

    python benchmarks/cost_gap.py [--slowed] [--repeats 9] [--minibatches 24]
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
    parser.add_argument("--slowed", action="store_true",
                        help="profile the plan made for rank 1 emulated 2x slower (mixed.py's)")
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
    gm_raw = trace(mlp()[0])  # as the cost pass timed forwards before: each node alone
    annotate_shapes(gm_raw, (example,))
    from pdcompile.cost import node_costs

    saved = node_costs._forward_in_sequence
    node_costs._forward_in_sequence = lambda *a, **k: {}  # type: ignore[assignment]
    try:
        annotate_costs(gm_raw, (example,), clock="cpu", repeats=args.repeats)
    finally:
        node_costs._forward_in_sequence = saved
    # the even split, or the plan for rank 1 emulated 2x slower (benchmarks/mixed.py's "ours")
    plan = pdcompile.plan(graph, cluster.with_slowdowns((1.0, 2.0)) if args.slowed else cluster,
                          straight=True)
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
    print(f"nodes per stage {[len(st.nodes) for st in plan.stages]}, minibatch {BATCH}; ms per "
          "minibatch, thread CPU time")
    from pdcompile.cost.optimizer_timing import time_weight_copies

    copies = time_weight_copies(pipe)
    print("| stage | cost pass before: nodes alone | cost pass now: forwards in sequence | "
          "stage in sequence, plain autograd | stage in sequence, fused Linear | runtime "
          "actions F + B | weight copy (in stage 0's F) | runtime STEP |")
    print("|---|---|---|---|---|---|---|---|")
    for s, (program, stage) in enumerate(zip(pipe.parts.stages, plan.stages, strict=True)):
        names = set(stage.nodes)
        raw = {n.name: n for n in gm_raw.graph.nodes}
        f1 = sum(node_costs.get_cost(raw[n]).fwd for n in names if n in raw)
        b1 = sum(node_costs.get_cost(raw[n]).bwd for n in names if n in raw)
        f2 = sum(node_costs.get_cost(kept[n]).fwd for n in names if n in kept)
        b2 = sum(node_costs.get_cost(kept[n]).bwd for n in names if n in kept)
        inputs = tuple(example if r.stage is None else
                       values[r.stage, r.name].detach().requires_grad_()
                       for r in program.inputs)
        plain = _plain_stage(pipe, s)
        f3, b3 = measure_model(plain, inputs, clock="cpu", repeats=args.repeats,
                               timer=CpuTimeTimer(clock=time.thread_time))
        f4, b4 = _fused_sequence(program.module, inputs, repeats=args.repeats,
                                 grads_in=s > 0)
        rank = stage.ranks[0]  # the runtime records actions by rank
        f5 = statistics.median(actions[rank, "F"])
        b5 = statistics.median(actions[rank, "B"])
        st = statistics.median(actions[rank, "STEP"])
        print(f"| {s} | {f1 * 1e3:.2f} + {b1 * 1e3:.2f} = {(f1 + b1) * 1e3:.2f} | "
              f"{f2 * 1e3:.2f} + {b2 * 1e3:.2f} = {(f2 + b2) * 1e3:.2f} | "
              f"{f3 * 1e3:.2f} + {b3 * 1e3:.2f} = {(f3 + b3) * 1e3:.2f} | "
              f"{f4 * 1e3:.2f} + {b4 * 1e3:.2f} = {(f4 + b4) * 1e3:.2f} | "
              f"{f5 * 1e3:.2f} + {b5 * 1e3:.2f} = {(f5 + b5) * 1e3:.2f} | "
              f"{copies[s] * 1e3:.2f} | {st * 1e3:.2f} |")
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
