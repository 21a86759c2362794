"""Planning time and peak memory on random DAGs at scale, and GPT-2 XL on flat 128 workers.

Each case plans in a fresh process (`pdcompile.plan`, default options): a random DAG of N
nodes (each node reads its predecessor, a recent node, or one to four earlier ones; costs
drawn from ordinary ranges with zeros and extremes mixed in, as tests/helpers/scale_dags.py
draws them) on a cluster in the short form, or GPT-2 XL (benchmarks/planner_fidelity.py
`gpt2_xl_graph`) on `128@450GB/s~3us:h100`, the "flat 128 < 10 s" row of the README. Per run:
wall and CPU seconds of the call, the process's peak resident memory (VmHWM), the plan, the
load average before it. The machine may be shared: read CPU seconds, and the load beside them.

    python benchmarks/random_dags.py [--xl-runs 3] [--seeds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def dag(n: int, seed: int) -> nx.DiGraph:
    """The random DAG of `n` nodes drawn by `seed` (module docstring): the same graph for the
    same arguments, in any process."""
    from pdcompile.cost.costgraph import add_block, new_cost_graph

    rng = random.Random(seed)

    def uniform(low: float, high: float) -> Callable[[], float]:
        return lambda: rng.uniform(low, high)

    seconds = [0.0] * 2 + [1e-9] + [uniform(1e-5, 1e-2)] * 36 + [1.0]
    sizes = [0.0] * 2 + [1.0] + [uniform(0, 1e7)] * 36 + [1e9]
    weights = [0.0] * 10 + [uniform(0, 4e6)] * 29 + [2e8]

    def pick(values: list[Any]) -> float:
        value = rng.choice(values)
        return float(value() if callable(value) else value)

    graph = new_cost_graph(f"random DAG of {n}", 32)
    for i in range(n):
        add_block(graph, f"n{i}", fwd=pick(seconds), bwd=pick(seconds),
                  act=float(int(pick(sizes))), params=float(int(pick(weights))))
    for i in range(1, n):
        style = rng.random()
        parents = ({i - 1} if style < 0.6 else {rng.randrange(max(0, i - 50), i)}
                   if style < 0.8 else set(rng.sample(range(i), min(i, rng.randint(1, 4)))))
        for p in parents:
            if rng.random() < 0.3:
                graph.add_edge(f"n{p}", f"n{i}", bytes=float(int(pick(sizes))))
            else:
                graph.add_edge(f"n{p}", f"n{i}")
    return graph


CHILD = """
import json, random, sys, time
sys.path.insert(0, {bench!r})
import pdcompile
from pdcompile.errors import PlanError
from random_dags import dag

kind, n, seed, cluster = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if kind == "xl":
    from planner_fidelity import gpt2_xl_graph
    graph = gpt2_xl_graph()
else:
    graph = dag(n, seed)
wall, cpu = time.perf_counter(), time.process_time()
out = {{"nodes": graph.number_of_nodes(), "edges": graph.number_of_edges()}}
try:
    plan = pdcompile.plan(graph, cluster)
    out["config"] = plan.config if len(plan.config) <= 30 else plan.config[:28] + ".."
    out["ms"] = plan.time_per_minibatch * 1e3
except PlanError as err:
    out["refused"] = str(err).split(";")[0][:90]
out["wall"], out["cpu"] = time.perf_counter() - wall, time.process_time() - cpu
out["peak_mib"] = int(next(line.split()[1] for line in open("/proc/self/status")
                          if line.startswith("VmHWM:"))) / 1024
print(json.dumps(out))
"""

CASES = ((300, "8@450GB/s~3us:h100"), (800, "4x4@1e10,1.25e9:v100"),
         (2000, "128@450GB/s~3us:h100"), (2000, "8x16@450GB/s,400Gbps~3us,5us:h100"),
         (2000, "1024@450GB/s~3us:h100"), (1500, "B"), (1000, "h100-4node"),
         (500, "mixed-A"), (400, "8x4@150GB/s,100Gbps:a100*16,v100*16"))


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def _run(kind: str, nodes: int, seed: int, cluster: str) -> dict[str, object]:
    script = CHILD.format(bench=str(ROOT / "benchmarks"))
    load = _load()
    done = subprocess.run([sys.executable, "-c", script, kind, str(nodes), str(seed), cluster],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:120], "load": load}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xl-runs", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print("| graph | cluster | plan wall s | CPU s | peak MiB | load | plan |")
    print("|---|---|---|---|---|---|---|")
    for _ in range(args.xl_runs):
        row = _run("xl", 0, 0, "128@450GB/s~3us:h100")
        _print("GPT-2 XL", "128@450GB/s~3us:h100", row)
    for nodes, cluster in CASES:
        for seed in range(1, args.seeds + 1):
            _print(f"random DAG, {nodes:,} nodes, seed {seed}", cluster,
                   _run("dag", nodes, seed, cluster))
    return 0


def _print(label: str, cluster: str, row: dict[str, object]) -> None:
    if "error" in row:
        print(f"| {label} | `{cluster}` | failed: {row['error']} | | | {row['load']} | |",
              flush=True)
        return
    plan = row.get("refused") or f"{row['config']}, {row['ms']:.3f} ms"
    print(f"| {label} | `{cluster}` | {row['wall']:.2f} | {row['cpu']:.2f} | "
          f"{row['peak_mib']:.0f} | {row['load']} | {plan} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
