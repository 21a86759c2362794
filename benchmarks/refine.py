"""Plan refinement by simulation on the paper's clusters: how much the schedule-aware local search
(`pdcompile.refine_plan`) gains over the planner's own choice, in the simulator.

For every shipped PipeDream profile and clusters A and B (16 V100): the native DP's plan, then
`refine_plan` from it (asynchronous 1F1B, PipeDream's warm-up, peak memory within the device),
each simulated against plain data parallelism on the same simulator; the paper's Table 1 figure
where one is known (measured on real clusters, for scale only).

    python benchmarks/refine.py                         # writes benchmarks/results/refine.md
    python benchmarks/refine.py --profiles vgg16 alexnet --budget 200 --out -
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from pdcompile.profiles import SHIPPED as PROFILES  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "refine.md"



def row(name: str, cluster_name: str, budget: int, minibatches: int) -> dict[str, Any]:
    import pdcompile
    from pdcompile import Cluster
    from pdcompile.planner.simulation import data_parallel_plan, simulate_plan
    from pdcompile.profiles import load_pipedream

    graph = load_pipedream(PROFILES / name)
    cluster = Cluster.preset(cluster_name)
    started = time.perf_counter()
    plan = pdcompile.plan(graph, cluster, planner="dp")
    plan_seconds = time.perf_counter() - started
    _, dp = simulate_plan(graph, data_parallel_plan(graph, cluster), cluster,
                          minibatches=minibatches, timeline=False)
    started = time.perf_counter()
    refined = pdcompile.refine_plan(plan, graph, cluster, minibatches=minibatches,
                                    max_evaluations=budget)
    refine_seconds = time.perf_counter() - started
    return {"profile": name, "cluster": cluster_name, "dp_config": plan.config,
            "dp_speedup": dp.time_per_minibatch / refined.start,
            "config": refined.plan.config,
            "speedup": dp.time_per_minibatch / refined.simulated,
            "gain": refined.gain, "evaluations": refined.evaluations,
            "plan_seconds": plan_seconds, "refine_seconds": refine_seconds,
            "paper": _paper(name, cluster_name)}


def _paper(name: str, cluster_name: str) -> str:
    """The paper's Table 1 entry as benchmarks/simulator.py lists it (config, speed-up)."""
    from simulator import PAPER_TABLE_1  # benchmarks/ is on the path of a script run from it

    config, speedup, _ = PAPER_TABLE_1.get((name, cluster_name), (None, None, ""))
    return ", ".join(x for x in (config, speedup) if x) or "-"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| profile | cluster | DP plan | simulated speed-up over DP-par | refined plan | "
             "simulated speed-up | gain | simulations | refine s | paper (Table 1) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['cluster']} | {r['dp_config']} | "
                     f"{r['dp_speedup']:.2f}x | {r['config']} | {r['speedup']:.2f}x | "
                     f"{r['gain']:.2f}x | {r['evaluations']} | {r['refine_seconds']:.1f} | "
                     f"{r['paper']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="*", default=None)
    parser.add_argument("--budget", type=int, default=400, help="simulations per row")
    parser.add_argument("--minibatches", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS), help="Markdown file, or - for stdout")
    args = parser.parse_args()
    names = args.profiles or sorted(p.name for p in PROFILES.iterdir()
                                    if (p / "graph.txt").is_file())
    rows = []
    for name in names:
        for cluster_name in ("A", "B"):
            rows.append(row(name, cluster_name, args.budget, args.minibatches))
            r = rows[-1]
            print(f"  {name:<14} {cluster_name} {r['dp_config']:<26} {r['dp_speedup']:.2f}x -> "
                  f"{r['config']:<26} {r['speedup']:.2f}x ({r['refine_seconds']:.1f} s)",
                  file=sys.stderr, flush=True)
    gains = [r["gain"] for r in rows]
    text = f"""# Plan refinement by simulation (benchmarks/refine.py)

Machine: {platform.processor() or platform.machine()}, this VM; command:
`python benchmarks/refine.py --budget {args.budget} --minibatches {args.minibatches}`.

Each row: the native DP's plan for the profile on the paper's cluster (16 V100, V100 device
model), then `pdcompile.refine_plan` from it with at most {args.budget} simulations (moves:
merge, split, move a replica, move a boundary; candidates whose simulated peak memory exceeds
16 GiB are skipped). Speed-ups are the simulator's (asynchronous 1F1B, PipeDream's warm-up,
steady state of {args.minibatches}+ minibatches) over plain data parallelism simulated the same
way. The paper's figures were measured on real clusters and are shown for scale only. VGG-16's
15-1 fits a V100 in our memory model (14.5 GiB per worker): the DP's own plan on cluster A.

{table(rows)}

Gain of refinement over the DP's plan, simulated: geometric mean
{math.exp(sum(math.log(g) for g in gains) / len(gains)):.2f}x, best {max(gains):.2f}x, over
{len(rows)} rows; rows where the DP's plan was kept: {sum(1 for g in gains if g <= 1.0)}.
"""
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
