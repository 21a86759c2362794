"""Plan a GPT-2 XL-sized model (1.5 B parameters) for one server of 8 x H100, without the memory.

    python examples/gpt2_xl_h100.py                 # 48 layers, 1024 tokens (about a minute)
    python examples/gpt2_xl_h100.py --layers 4      # what the tests run

The model is built on PyTorch's `meta` device: parameters and activations have shapes but no
storage, so tracing, shape propagation and the analytic cost pass (FLOPs and bytes on an H100
roofline) run on a laptop in under a gigabyte. The planner then partitions the costed graph over
the `h100-node` preset (8 GPUs, NVLink) and compares with data parallelism.

Reading the result at full size: with 1F1B the first stage keeps a minibatch in flight per
stage downstream, so under the 80 GB limit the early stages get few layers and the last one
many. The planner's data-parallel time is the time data parallelism would take, not a promise
that it fits: eight copies of every activation of a 8 x 1024-token minibatch do not.
"""

from __future__ import annotations

import argparse
import time

import torch

import pdcompile
from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
from pdcompile.models import gpt2
from pdcompile.passes.shapes import annotate_shapes
from pdcompile.passes.trace import trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48, help="transformer blocks (XL: 48)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per minibatch")
    parser.add_argument("--planner", default="dp", choices=("dp", "ilp", "auto"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    started = time.perf_counter()
    model, inputs = gpt2.factory(size="xl", layers=args.layers, batch_size=args.batch_size,
                                 device="meta")
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 XL shape, {args.layers} layers: {params / 1e9:.2f} B parameters on "
          f"{next(model.parameters()).device} (no memory), minibatch {tuple(inputs[0].shape)}")
    gm = trace(model)
    annotate_shapes(gm, inputs)
    annotate_costs(gm, inputs, source="analytic", device="h100")
    graph = to_cost_graph(gm, name=f"gpt2-xl-{args.layers}")
    print(f"traced and costed {graph.number_of_nodes()} nodes in "
          f"{time.perf_counter() - started:.1f} s")

    cluster = pdcompile.Cluster.preset("h100-node")
    plan = pdcompile.plan(graph, cluster, planner=args.planner)
    print(f"\n{cluster.describe()}")
    print(plan.summary())
    print(f"\npipeline {plan.config}: {plan.speedup_over_dp:.2f}x over data parallelism "
          f"({plan.time_per_minibatch * 1e3:.1f} ms against {plan.dp_time * 1e3:.1f} ms per "
          "minibatch)")


if __name__ == "__main__":
    main()
