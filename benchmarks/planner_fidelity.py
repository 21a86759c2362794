"""The schedule-aware planner against the simulator, against the paper's plan, and at scale.

Four sections of benchmarks/results/planner.md (run through `benchmarks/planner.py --section`):

* "Planner against simulator": every shipped profile x clusters A, B, C x schedules 1f1b and
  1f1b-flush. The planner's predicted time per minibatch, and the simulator's steady state of
  the same plan measured independently (a stream three times as long as the planner's); the
  closed form the planner ranks with beside them. Target: within 10%, worst row named.
* "Planner against simulator, a tied model": the bundled GPT-2 (124 M, its 50,257 x 768
  embedding tied to the output head: 154 MB) on `meta` with analytic H100 costs, on 4 and 8
  H100s at 1e10 B/s x 1f1b (free, and a straight pipeline) and 1f1b-flush: predicted,
  simulated and closed form, and
  the all-reduce of the tie where the plan splits it across ranks (cost/ties.py).
* "VGG-16 on cluster A against the paper's 15-1": the planner's plans (1f1b, and
  schedule="auto") simulated against the paper's 15-1 plan with PipeDream's warm-up (which
  needs more than a V100's memory here) and within the V100's memory.
* "Scale": planner wall time for GPT-2 XL (analytic costs) on 16 x 8 H100, a 1,000-node chain on
  16 x 8 and a 5,000-node chain on 128 x 8, and the gap to the exact DP (all workers in one DP,
  no symmetric servers) where that finishes.
"""

from __future__ import annotations

import platform
import random
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from pdcompile.profiles import SHIPPED as PROFILES  # noqa: E402

H100_SERVERS = "8x{servers}@450GB/s,400Gbps~3us,5us:h100"


def machine() -> str:
    """One line naming the machine the figures come from."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{platform.machine()} {platform.processor() or ''} ({cores} cores), Python "
            f"{platform.python_version()}")


# ------------------------------------------------------------------ planner against simulator
def fidelity_rows(profiles: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (profile, cluster, schedule): predicted, simulated, closed form."""
    import pdcompile
    from pdcompile.planner.simulation import simulate_plan, steady_minibatches
    from pdcompile.profiles import load_pipedream

    names = profiles or sorted(p.name for p in PROFILES.iterdir() if (p / "graph.txt").is_file())
    rows = []
    for name in names:
        graph = load_pipedream(PROFILES / name)
        for cluster_name in ("A", "B", "C"):
            cluster = pdcompile.Cluster.preset(cluster_name)
            for schedule in ("1f1b", "1f1b-flush"):
                started = time.perf_counter()
                plan = pdcompile.plan(graph, cluster, schedule=schedule)
                seconds = time.perf_counter() - started
                stream = 16 * steady_minibatches(plan)  # longer than any planner run
                _, result = simulate_plan(graph, plan, cluster, minibatches=stream,
                                          timeline=False)
                rows.append({
                    "profile": name, "cluster": cluster_name, "schedule": schedule,
                    "microbatches": plan.microbatches, "config": plan.config,
                    "predicted": plan.time_per_minibatch, "simulated": result.time_per_minibatch,
                    "closed": plan.extra["closed_form_time_per_minibatch"],
                    "by_simulator": "simulated_time_per_minibatch" in plan.extra,
                    "memory": max(s.memory for s in plan.stages),
                    "peak": result.peak_memory, "device": cluster.device.memory,
                    "seconds": seconds})
                print(f"  {name} {cluster_name} {schedule}: {plan.config} "
                      f"{plan.time_per_minibatch * 1e3:.2f} ms ({seconds:.1f} s)", flush=True)
    return rows


def fidelity_section(rows: list[dict[str, Any]]) -> str:
    """The Markdown section of `fidelity_rows`."""
    def err(a: float, b: float) -> float:
        return a / b - 1.0

    worst = max(rows, key=lambda r: abs(err(r["predicted"], r["simulated"])))
    worst_closed = max(rows, key=lambda r: abs(err(r["closed"], r["simulated"])))
    within = sum(abs(err(r["closed"], r["simulated"])) <= 0.10 for r in rows)
    lines = [
        "## Planner against simulator",
        "",
        f"`python benchmarks/planner.py --section fidelity`, {time.strftime('%Y-%m-%d %H:%M')} "
        f"UTC, {machine()}. Every shipped profile x clusters A, B, C x schedules 1f1b and "
        "1f1b-flush (the planner chooses the microbatches: 8 or 32). *predicted*: the plan's "
        "`time_per_minibatch`; *simulated*: the simulator's steady state of the same plan, run "
        "again on a stream 16 times the planner's first (the planner doubles its own until "
        "the time settles); *closed form*: the schedule-aware formula the planner ranks its "
        "candidates with (cost/pipeline_time.py). Memory: "
        "the plan's largest per-worker figure and the simulator's peak (one formula, "
        "cost/memory.py). Target: predicted within 10% of simulated.",
        "",
        f"**Worst row, predicted against simulated: {worst['profile']} on {worst['cluster']}, "
        f"{worst['schedule']}: {err(worst['predicted'], worst['simulated']):+.2%}** (the "
        "planner simulates its best candidates and predicts the chosen plan's steady state, "
        "so the independent longer run checks that the steady state was reached). The closed "
        f"form alone is within 10% on {within} of {len(rows)} rows; its worst: "
        f"{worst_closed['profile']} on {worst_closed['cluster']}, {worst_closed['schedule']}: "
        f"{err(worst_closed['closed'], worst_closed['simulated']):+.1%}.",
        "",
        "| profile | cluster | schedule | config | predicted ms | simulated ms | error | "
        "closed form ms | closed-form error | memory GiB (plan / simulated) | plan s |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        schedule = r["schedule"] + (f" x{r['microbatches']}" if r["microbatches"] > 1 else "")
        config = r["config"] if len(r["config"]) <= 22 else r["config"][:20] + ".."
        lines.append(
            f"| {r['profile']} | {r['cluster']} | {schedule} | {config} | "
            f"{r['predicted'] * 1e3:.2f} | {r['simulated'] * 1e3:.2f} | "
            f"{err(r['predicted'], r['simulated']):+.2%} | {r['closed'] * 1e3:.2f} | "
            f"{err(r['closed'], r['simulated']):+.1%} | {r['memory'] / 2**30:.1f} / "
            f"{r['peak'] / 2**30:.1f} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def tied_rows() -> list[dict[str, Any]]:
    """One row per (cluster, schedule) for GPT-2 (tied embedding and head): predicted,
    simulated, closed form, and the tie's all-reduce per update under the plan."""
    import pdcompile
    from pdcompile.cost.stage_costs import StageCosts
    from pdcompile.planner.simulation import simulate_plan, steady_minibatches

    graph = gpt2_graph()
    rows = []
    for cluster_text in ("4@1e10:h100", "8@1e10:h100"):
        cluster = pdcompile.Cluster.parse(cluster_text)
        for schedule, straight in (("1f1b", False), ("1f1b", True), ("1f1b-flush", False)):
            plan = pdcompile.plan(graph, cluster, schedule=schedule, straight=straight)
            stream = None if plan.schedule == "1f1b-flush" else 16 * steady_minibatches(plan)
            _, result = simulate_plan(graph, plan, cluster, minibatches=stream, timeline=False)
            ranks = [s.ranks for s in plan.stages]
            ties = StageCosts.from_plan(graph, plan, microbatches=plan.microbatches).ties
            rows.append({
                "cluster": cluster_text, "schedule": schedule + (" straight" if straight else ""),
                "config": plan.config,
                "microbatches": plan.microbatches, "predicted": plan.time_per_minibatch,
                "simulated": result.time_per_minibatch,
                "closed": plan.extra["closed_form_time_per_minibatch"],
                "tie": sum(t.seconds(ranks, cluster) for t in ties)})
    return rows


def gpt2_graph() -> Any:
    """The bundled GPT-2 (12 blocks, 1,024 tokens, 8 sequences) on `meta`, analytic H100
    costs, its tied embedding recorded in the CostGraph's `ties`."""
    import torch

    from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
    from pdcompile.models import gpt2
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.passes.trace import trace

    model, inputs = gpt2.factory(size="gpt2", batch_size=8, device="meta")
    gm = trace(model)
    with torch.random.fork_rng():
        annotate_shapes(gm, inputs)
    annotate_costs(gm, inputs, source="analytic", device="h100")
    return to_cost_graph(gm, name="gpt2")


def tied_section(rows: list[dict[str, Any]]) -> str:
    """The Markdown section of `tied_rows`."""
    lines = [
        "## Planner against simulator, a tied model",
        "",
        f"`python benchmarks/planner.py --section tied`, {time.strftime('%Y-%m-%d %H:%M')} "
        f"UTC, {machine()}. The bundled GPT-2 (124 M parameters, 8 sequences of 1,024 "
        "tokens; its 50,257 x 768 token embedding tied to the output head, 154 MB in float32) "
        "on `meta` with analytic H100 costs. *tie*: the all-reduce of the tied gradients per "
        "update where the plan puts the embedding and the head on different ranks "
        "(cost/ties.py; 0 where one stage or one rank holds both), which the simulator and the "
        "closed form both charge; *straight*: the planner asked for a straight pipeline. "
        "Target: closed form within 10% of simulated.",
        "",
        "| cluster | schedule | config | predicted ms | simulated ms | closed form ms | "
        "closed-form error | tie ms |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        schedule = r["schedule"] + (f" x{r['microbatches']}" if r["microbatches"] > 1 else "")
        lines.append(
            f"| {r['cluster']} | {schedule} | {r['config']} | {r['predicted'] * 1e3:.2f} | "
            f"{r['simulated'] * 1e3:.2f} | {r['closed'] * 1e3:.2f} | "
            f"{r['closed'] / r['simulated'] - 1.0:+.2%} | {r['tie'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the paper's plan
def paper_section() -> str:
    """VGG-16 on clusters A and B: our plans against the paper's 15-1, in simulation."""
    from simulator import paper_plan

    import pdcompile
    from pdcompile.planner import price_plan
    from pdcompile.planner.simulation import data_parallel_plan, simulate_plan
    from pdcompile.profiles import load_pipedream

    graph = load_pipedream(PROFILES / "vgg16")
    lines = [
        "## VGG-16 against the paper's 15-1",
        "",
        f"`python benchmarks/planner.py --section paper`, {time.strftime('%Y-%m-%d %H:%M')} UTC, "
        f"{machine()}. Simulated time per minibatch of each plan on PipeDream's VGG-16 profile "
        "(batch 128), speed-up over data parallelism simulated the same way, and peak memory "
        "per worker (weights, gradients, Adam's state, stashed versions, activations in "
        "flight) against the V100's 16 GiB. The paper's 15-1 is cut before the first fully "
        "connected layer (our reading of the paper).",
        "",
        "| cluster | plan | schedule | in flight per stage | simulated ms | vs data parallel | "
        "peak GiB | fits a V100 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cluster_name in ("A", "B"):
        cluster = pdcompile.Cluster.preset(cluster_name)
        _, dp = simulate_plan(graph, data_parallel_plan(graph, cluster), cluster,
                              timeline=False)
        theirs = paper_plan(graph, "15-1", cluster)
        rows: list[tuple[str, Any, str]] = [
            ("ours", pdcompile.plan(graph, cluster), ""),
            ("ours, schedule auto", pdcompile.plan(graph, cluster, schedule="auto"), ""),
            ("paper 15-1, PipeDream's warm-up", theirs, "noam"),
            ("paper 15-1 within the memory",
             price_plan(graph, theirs, cluster, memory=cluster.device.memory), ""),
        ]
        for label, plan, warmup in rows:
            kwargs: dict[str, Any] = {"warmup": warmup} if warmup else {}
            _, result = simulate_plan(graph, plan, cluster, timeline=False, **kwargs)
            flight = "/".join(str(n) for n in result_in_flight(result, plan))
            schedule = plan.schedule + (f" x{plan.microbatches}" if plan.microbatches > 1
                                        else "")
            lines.append(
                f"| {cluster_name} | {label}: {plan.config} | {schedule} | {flight} | "
                f"{result.time_per_minibatch * 1e3:.1f} | "
                f"{dp.time_per_minibatch / result.time_per_minibatch:.2f}x | "
                f"{result.peak_memory / 2**30:.1f} | "
                f"{'yes' if result.peak_memory <= cluster.device.memory else 'no'} |")
    return "\n".join(lines) + "\n"


def result_in_flight(result: Any, plan: Any) -> list[int]:
    """The most microbatches each stage held in flight in a simulation."""
    return [max(result.memory[r].in_flight for r in s.ranks) for s in plan.stages]


# ------------------------------------------------------------------ scale
def chain(nodes: int, seed: int = 0, skips: int = 0) -> Any:
    """A chain of `nodes` random blocks (0.1-1 ms forward, twice as much backward at most,
    0.1-10 MB activations, up to 4 MB of weights): a stand-in for a deep model's fx graph;
    `skips` random short skip edges (each over 2 to 8 blocks) make it branch."""
    from pdcompile.cost.costgraph import add_block, new_cost_graph

    rng = random.Random(seed)
    graph = new_cost_graph(f"chain of {nodes}" + (f" with {skips} skips" if skips else ""), 32)
    for i in range(nodes):
        add_block(graph, f"n{i}", fwd=rng.uniform(1e-4, 1e-3), bwd=rng.uniform(2e-4, 2e-3),
                  act=rng.uniform(1e5, 1e7), params=rng.uniform(0, 4e6))
        if i:
            graph.add_edge(f"n{i - 1}", f"n{i}")
    for _ in range(skips):
        start = rng.randrange(nodes - 2)
        graph.add_edge(f"n{start}", f"n{min(nodes - 1, start + rng.randint(2, 8))}")
    return graph


# random-cost graphs at scale: (nodes, skips, cluster, target); each planned in a process of
# its own, so that its peak resident memory is its own
RANDOM_CASES = (
    (5000, 300, H100_SERVERS.format(servers=128), "< 10 s, < 4 GB"),
    (5000, 300, "1024@450GB/s~3us:h100", "< 10 s, < 4 GB"),
    (5000, 300, H100_SERVERS.format(servers=16), "< 5 s"),
    (5000, 300, "128@450GB/s~3us:h100", "< 5 s"),
    (5000, 0, "128@450GB/s~3us:h100", "< 5 s"),
    (5000, 300, H100_SERVERS.format(servers=32), ""),
    (2000, 200, "1024@450GB/s~3us:h100", ""),
    (1000, 100, "128@450GB/s~3us:h100", ""),
)


# cost_model="pipedream" on random-cost graphs: (nodes, skips, cluster), flat and on servers of 8
PIPEDREAM_CASES = tuple(
    (nodes, nodes // 10 if nodes < 5000 else 300, cluster)
    for nodes in (500, 2000, 5000)
    for cluster in ("16@450GB/s~3us:h100", "128@450GB/s~3us:h100", "1024@450GB/s~3us:h100",
                    H100_SERVERS.format(servers=16), H100_SERVERS.format(servers=128)))


# ... and the slowest inputs: as many nodes as fit the state budget uncoarsened (budget - 1)
PIPEDREAM_NEAR_BUDGET = ("16@450GB/s~3us:h100", "1024@450GB/s~3us:h100",
                         "4x4@450GB/s,400Gbps~3us,5us:h100", H100_SERVERS.format(servers=2),
                         H100_SERVERS.format(servers=128))


def measure_random(nodes: int, skips: int, cluster: str,
                   cost_model: str = "native") -> dict[str, Any]:
    """One `pdcompile.plan` call on `chain(nodes, skips=skips)`: wall and CPU seconds (the
    process's: on a shared machine the wall time counts other jobs too), peak resident
    memory of the process (ru_maxrss, graph and imports included), the plan."""
    import resource

    import pdcompile

    graph = chain(nodes, skips=skips)
    started, cpu = time.perf_counter(), time.process_time()
    plan = pdcompile.plan(graph, cluster, cost_model=cost_model)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "cpu": cpu, "peak": peak,
            "config": plan.config, "ms": plan.time_per_minibatch * 1e3,
            "states": plan.extra.get("states", ""),
            "by": "simulator" if "simulated_time_per_minibatch" in plan.extra else "closed form"}


def random_rows(cases: tuple[tuple[int, int, str, str], ...] = RANDOM_CASES,
                cost_model: str = "native") -> list[tuple[int, int, str, str, dict[str, Any]]]:
    """`measure_random` for every row of `cases` (nodes, skips, cluster, target), each in a
    fresh process."""
    import json
    import os
    import subprocess
    import sys

    rows = []
    for nodes, skips, cluster, target in cases:
        code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import planner_fidelity as f; "
                f"print(json.dumps(f.measure_random({nodes}, {skips}, {cluster!r}, "
                f"{cost_model!r})))")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=600, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append((nodes, skips, cluster, target, result))
        print(f"  {nodes} nodes, {skips} skips on {cluster}: {result['seconds']:.2f} s "
              f"({result['cpu']:.2f} s CPU), "
              f"{result['peak'] / 2**20:.0f} MiB", flush=True)
    return rows


def pipedream_scale_section() -> str:
    """cost_model="pipedream" (the original optimizer's DP and model) at scale: wall time, CPU
    time and peak memory on random-cost graphs, each planned in a process of its own."""
    import pdcompile
    from pdcompile.planner.dp_search import pipedream_budget

    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    near = []
    for cluster in PIPEDREAM_NEAR_BUDGET:
        levels = tuple(level.workers for level in pdcompile.Cluster.parse(cluster).levels)
        nodes = pipedream_budget(levels) - 1
        near.append((nodes, nodes // 10, cluster, "near the budget"))
    rows = random_rows(tuple((n, s, c, "") for n, s, c in PIPEDREAM_CASES) + tuple(near),
                       "pipedream")
    after = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    lines = [
        "## Scale, cost model pipedream",
        "",
        f"`python benchmarks/planner.py --section scale-pipedream`, "
        f"{time.strftime('%Y-%m-%d %H:%M')} UTC, {machine()}; load average {load} before the "
        f"rows and {after} after (the VM's 2 cores are shared). One "
        "`pdcompile.plan(graph, cluster, cost_model=\"pipedream\")` call per process on "
        "`chain(nodes, skips=...)` (random per-node costs, short skip edges over 2-8 blocks): wall "
        "and CPU time of the call, the process's peak resident memory (ru_maxrss: imports and "
        "the graph included). The original's DP runs on at most `pipedream_budget` states for "
        "the cluster (graphs with as many nodes coarsened first) and on levels wider than 32 "
        "workers in units of neighbouring workers (planner/dp.py `unit_bounds`); budgets: "
        + ", ".join(f"{w} flat {pipedream_budget((w,))}" for w in (16, 128, 1024))
        + f", 8x16 {pipedream_budget((8, 16))}, 8x128 {pipedream_budget((8, 128))} states. "
        "Before this change (2026-11-25, load 4.2): 2,000 nodes + 200 skips on flat 1,024 "
        "workers had not finished after 100 s under a 6 GB address-space cap (its tables: "
        "states x states x workers, no coarsening below 6,000 states).",
        "",
        "Rows marked 'near the budget' have one node fewer than the cluster's state budget, "
        "so that nothing is coarsened: the slowest inputs for that cluster.",
        "",
        "| nodes | skips | cluster | workers | plan s | CPU s | peak MiB | config | "
        "predicted ms | states |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for nodes, skips, cluster_text, note, r in rows:
        config = r["config"] if len(r["config"]) <= 30 else r["config"][:28] + ".."
        workers = pdcompile.Cluster.parse(cluster_text).workers
        mark = f" ({note})" if note else ""
        lines.append(f"| {nodes:,}{mark} | {skips} | `{cluster_text}` | {workers} | "
                     f"{r['seconds']:.2f} | {r['cpu']:.2f} | {r['peak'] / 2**20:.0f} | "
                     f"{config} | {r['ms']:.3f} | {r['states']} |")
    return "\n".join(lines) + "\n"


def gpt2_xl_graph() -> Any:
    """GPT-2 XL (48 blocks, 1,024 tokens, 8 sequences) on `meta`, analytic H100 costs; the
    CostGraph is cached in benchmarks/results/.cache (tracing takes ~15 s)."""
    from pdcompile.cost.costgraph import load, save

    cache = ROOT / "benchmarks" / "results" / ".cache" / "gpt2-xl-h100.json"
    if cache.exists():
        return load(cache)
    import torch

    from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
    from pdcompile.models import gpt2
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.passes.trace import trace

    model, inputs = gpt2.factory(size="xl", layers=48, batch_size=8, device="meta")
    gm = trace(model)
    with torch.random.fork_rng():
        annotate_shapes(gm, inputs)
    annotate_costs(gm, inputs, source="analytic", device="h100")
    graph = to_cost_graph(gm, name="gpt2-xl")
    cache.parent.mkdir(parents=True, exist_ok=True)
    save(graph, cache)
    return graph


def scale_section(*, exact_limit: int = 32) -> str:
    """Planner wall times at scale and the gap to the exact DP where it runs."""
    import pdcompile

    rows = []
    cases = [("GPT-2 XL (analytic)", gpt2_xl_graph, 16, "< 5 s"),
             ("1,000-node chain", lambda: chain(1000), 16, ""),
             ("5,000-node chain", lambda: chain(5000), 128, "< 10 s")]
    for label, make, servers, target in cases:
        graph = make()
        cluster = pdcompile.Cluster.parse(H100_SERVERS.format(servers=servers))
        started = time.perf_counter()
        plan = pdcompile.plan(graph, cluster)
        seconds = time.perf_counter() - started
        rows.append((label, graph.number_of_nodes(), cluster.workers, plan, seconds, target))
        print(f"  {label} on {cluster.workers}: {seconds:.2f} s", flush=True)
    lines = [
        "## Scale",
        "",
        f"`python benchmarks/planner.py --section scale`, {time.strftime('%Y-%m-%d %H:%M')} UTC, "
        f"{machine()}. Wall time of one `pdcompile.plan` call (schedule 1f1b) on servers of 8 "
        "H100 (NVLink 450 GB/s inside, 400 Gbps between). Above 16 workers on several servers "
        "the planner gives every server the same pipeline (symmetric servers: one server's DP, "
        "each stage's replicas on all servers all-reducing together) after coarsening the "
        "graph to at most 300 blocks; the prediction is the closed form where a simulation "
        "would be too long. GPT-2 XL's token embedding is tied to its output head: under 1f1b "
        "the stages holding them take equal replica counts, as the runtime requires (the DP "
        "and CP-SAT search under that rule, and refused candidates are priced again with "
        "their tied stages set equal; docs/cost-model.md). Before, the planner dropped the "
        "DP's plans that broke it and returned 16 stages of 8 at 100.1 ms.",
        "",
        "| graph | nodes | workers | plan s | target | config | predicted ms | by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, nodes, workers, plan, seconds, target in rows:
        by = "simulator" if "simulated_time_per_minibatch" in plan.extra else "closed form"
        config = plan.config if len(plan.config) <= 30 else plan.config[:28] + ".."
        lines.append(f"| {label} | {nodes:,} | {workers} | {seconds:.2f} | {target} | "
                     f"{config} | {plan.time_per_minibatch * 1e3:.3f} | {by} |")
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    lines += ["", "Random-cost graphs (`chain(nodes, skips=...)`: random per-node costs, short "
              "skip edges over 2-8 blocks), each planned in a process of its own: wall time of the "
              "`pdcompile.plan` call and the process's peak resident memory (ru_maxrss: imports "
              "and the graph included). Flat clusters wider than 32 workers are planned in "
              f"units of neighbouring workers (planner/dp.py `unit_bounds`). Load average {load} "
              "before the rows (the VM's 2 cores are shared).", "",
              "| graph | nodes | cluster | workers | plan s | CPU s | peak MiB | target | config | "
              "predicted ms | by | states |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for nodes, skips, cluster_text, target, r in random_rows():
        config = r["config"] if len(r["config"]) <= 30 else r["config"][:28] + ".."
        workers = pdcompile.Cluster.parse(cluster_text).workers
        lines.append(f"| random chain, {skips} skips | {nodes:,} | `{cluster_text}` | {workers} | "
                     f"{r['seconds']:.2f} | {r['cpu']:.2f} | {r['peak'] / 2**20:.0f} | {target} | "
                     f"{config} | "
                     f"{r['ms']:.3f} | {r['by']} | {r['states']} |")
    lines += ["", "Gap to the exact DP (one DP over all workers, no symmetric servers), where it "
              f"finishes (up to {exact_limit} workers), closed form against closed form:", "",
              "| graph | workers | symmetric s | config | ms | exact s | config | ms | gap |",
              "|---|---|---|---|---|---|---|---|---|"]
    for label, make in (("GPT-2 XL (analytic)", gpt2_xl_graph),
                        ("1,000-node chain", lambda: chain(1000))):
        graph = make()
        for servers in (2, 4):
            cluster = pdcompile.Cluster.parse(H100_SERVERS.format(servers=servers))
            if cluster.workers > exact_limit:
                continue
            timed = []
            for symmetric in (True, False):
                started = time.perf_counter()
                plan = pdcompile.plan(graph, cluster, symmetric=symmetric, simulate=False)
                timed.append((plan, time.perf_counter() - started))
            (sym, sym_s), (exact, exact_s) = timed
            gap = sym.time_per_minibatch / exact.time_per_minibatch - 1.0
            lines.append(
                f"| {label} | {cluster.workers} | {sym_s:.2f} | {sym.config[:24]} | "
                f"{sym.time_per_minibatch * 1e3:.3f} | {exact_s:.2f} | {exact.config[:24]} | "
                f"{exact.time_per_minibatch * 1e3:.3f} | {gap:+.1%} |")
            print(f"  gap {label} {cluster.workers}: {gap:+.1%}", flush=True)
    return "\n".join(lines) + "\n"
