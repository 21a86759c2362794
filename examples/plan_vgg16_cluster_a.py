"""Plan VGG-16 for PipeDream's cluster A from the shipped profile; compare with data parallelism.

    python examples/plan_vgg16_cluster_a.py
    python examples/plan_vgg16_cluster_a.py --profile path/to/vgg16/graph.txt --planner ilp

Cluster A: 4 servers x 4 V100 over PCIe, 10 Gbps between servers. The profile is PipeDream's own
(per-layer forward/backward times and activation/parameter sizes measured on a V100), read by
`pdcompile.profiles.load_pipedream`. Prints our plan, PipeDream's cost model's plan, and each
one's predicted speed-up over plain data parallelism on the same 16 workers. To see the
1F1B schedule of the plan run: pdcompile simulate --profile PATH --cluster A --out sim/
"""

from __future__ import annotations

import argparse

import pdcompile

DEFAULT = "vgg16"  # a profile shipped with the package (pdcompile.profiles.shipped_profiles())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=DEFAULT, help="graph.txt, its folder or a shipped profile's name")
    parser.add_argument("--planner", default="dp", choices=("dp", "ilp", "auto"))
    parser.add_argument("--small", action="store_true", help="accepted for the tests (the "
                        "example is already fast)")
    args = parser.parse_args()

    graph = pdcompile.profiles.load_pipedream(args.profile)
    cluster = pdcompile.Cluster.preset("A")
    print(f"VGG-16 ({graph.number_of_nodes()} profiled layers) on {cluster.describe()}\n")
    for cost_model in ("native", "pipedream"):
        plan = pdcompile.plan(graph, cluster, planner=args.planner, cost_model=cost_model)
        print(f"cost model {cost_model}: configuration {plan.config}, "
              f"{plan.time_per_minibatch * 1e3:.1f} ms per minibatch against "
              f"{plan.dp_time * 1e3:.1f} ms for data parallelism: "
              f"{plan.speedup_over_dp:.2f}x")
    plan = pdcompile.plan(graph, cluster, planner=args.planner)
    print()
    print(plan.summary())


if __name__ == "__main__":
    main()
