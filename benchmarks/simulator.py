"""Simulator benchmark: the PipeDream paper's comparison in simulation, plus the fidelity check.

Part 1 (runs here, no GPU needed): for every shipped PipeDream profile, plan it for the paper's
clusters A (4 x 4 V100, PCIe, 10 Gbps) and B (2 x 8 V100, NVLink, 25 Gbps) with `pdcompile.plan`,
then simulate the chosen plan under asynchronous 1F1B and plain data parallelism (one stage on
all 16 workers) with the same simulator, and print the predicted speed-up of the plan over data
parallelism: the planner's own estimate, the simulator's (PipeDream's NOAM warm-up, and the
latency-aware warm-up of schedule.generators), next to the figures of the paper's Table 1 where
it has them (those are measured epoch-time speed-ups from the paper, not computed here).

Part 2: real runs against the simulator. `fidelity` compiles small compute-bound models (costs
measured by the cost pass), trains them on 2 and 4 local processes with the distributed backend,
records what ran, simulates the same schedule with the same costs and compares
(`pdcompile.viz.compare`). `fidelity_synthetic` runs the lowered schedule IR on real processes with
synthetic stages and gloo transfers.

    python benchmarks/simulator.py [--planner dp] [--cost-model native] [--write]
    python benchmarks/simulator.py --fidelity [--write]     # only the compiled-pipeline runs
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import pdcompile
from pdcompile.machine.cluster import Cluster
from pdcompile.planner.search import price_plan
from pdcompile.planner.simulation import data_parallel_plan, simulate_plan
from pdcompile.profiles import load_pipedream

ROOT = Path(__file__).resolve().parents[1]
from pdcompile.profiles import SHIPPED as PROFILES  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "simulator.md"

# Table 1 of Narayanan et al., SOSP 2019 ("PipeDream: Generalized Pipeline Parallelism for DNN
# Training", doi:10.1145/3341301.3359646): PipeDream's configuration and its measured speed-up
# over data parallelism on 16 GPUs. The paper's PDF could not be read from this session; only
# figures found in a written source are kept, each with its source (PAPER_SOURCES); a None
# config or speed-up means "not available from a source" (the earlier, memorised figures for
# those cells were dropped). The paper's GNMT-16 is our gnmt_large, GNMT-8 our gnmt.
# Values: (config or None, speed-up text or None, source keys).
PAPER_TABLE_1: dict[tuple[str, str], tuple[str | None, str | None, str]] = {
    ("vgg16", "A"): ("15-1", "5.28x", "a, b"),
    ("vgg16", "B"): ("15-1", "2.98x (TTA 2.46x)", "a"),
    ("resnet50", "A"): ("16", "1x", "a'"),
    ("resnet50", "B"): ("16", "1x", "a'"),
    ("alexnet", "A"): (None, "4.92x", "a"),
    ("alexnet", "B"): (None, "2.04x", "a"),
    ("gnmt_large", "A"): (None, "TTA 2.92x (epoch time: n/a)", "a"),
    ("gnmt_large", "B"): (None, "3.14x", "a"),
    ("gnmt", "B"): (None, None, ""),
}
PAPER_SOURCES = """\
Sources of the paper's figures (the paper itself, doi:10.1145/3341301.3359646, could not be
opened from the session that wrote this; check against it before quoting):

- **a**: a public reading note of the SOSP'19 PDF, found through a code-search index of public
  GitHub repositories (a Markdown "source note" of a personal knowledge base, id
  `doi-10-1145-3341301-3359646-pipedream-generalized-pipeline-parallelism-dnn-training`,
  deep read of the 15-page PDF, SHA-256 d29b17c8...; the index did not report its repository).
  Its results table gives: VGG-16, cluster A (4x4 V100, PCIe, 10 Gbps) up to 5.28x (epoch
  time and time to accuracy), cluster B (2x8 V100, NVLink, 25 Gbps) 2.98x epoch time and 2.46x
  time to accuracy, optimizer's configuration 15-1; ResNet-50: the optimizer picks plain data
  parallelism, about 1x (**a'**: the note says so without naming a cluster; shown here for
  both); AlexNet (synthetic data): 4.92x on A, 2.04x on B (epoch time); GNMT-16: up to about
  3.14x on B, 2.92x time to accuracy on A with 16 GPUs. It gives no configuration for
  AlexNet or GNMT and nothing on GNMT-8 (our `gnmt`) on cluster B.
- **b**: the paper's abstract (a copy of the SOSP'19 PDF at vdocuments.site) and the Microsoft
  Research blog post of 28 October 2019: "up to 5.3x faster" than data parallelism, which
  matches VGG-16 on cluster A (5.28x).

Figures written here before from memory and not found in any source were removed: AlexNet
15-1 on A and B, GNMT-16 "straight" and 2.34x (epoch time) on A, GNMT-8 on B ("16", 1x)."""


def paper_comparison(*, planner: str, cost_model: str, minibatches: int,
                     profiles: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (profile, cluster): plan, simulate plan and data parallelism, compare."""
    rows = []
    names = profiles or sorted(p.name for p in PROFILES.iterdir() if (p / "graph.txt").is_file())
    for name in names:
        graph = load_pipedream(PROFILES / name)
        for cluster_name in ("A", "B"):
            cluster = Cluster.preset(cluster_name)
            started = time.perf_counter()
            plan = pdcompile.plan(graph, cluster, planner=planner, cost_model=cost_model)
            plan_seconds = time.perf_counter() - started
            lcm = math.lcm(*(s.replicas for s in plan.stages))
            stream = max(minibatches, 4 * lcm)
            started = time.perf_counter()
            _, noam = simulate_plan(graph, plan, cluster, minibatches=stream, timeline=False)
            _, aware = simulate_plan(graph, plan, cluster, minibatches=stream, warmup="latency",
                                     timeline=False)
            dp_plan = data_parallel_plan(graph, cluster)
            _, dp = simulate_plan(graph, dp_plan, cluster, minibatches=max(minibatches, 64),
                                  timeline=False)
            sim_seconds = time.perf_counter() - started
            paper = PAPER_TABLE_1.get((name, cluster_name), (None, None, ""))
            theirs = paper_plan(graph, paper[0], cluster) if paper[0] else None
            paper_sim: tuple[float, float] | None = None
            if theirs is not None:
                step = max(minibatches, 4 * math.lcm(*(s.replicas for s in theirs.stages)))
                _, p_noam = simulate_plan(graph, theirs, cluster, minibatches=step,
                                          timeline=False)
                _, p_aware = simulate_plan(graph, theirs, cluster, minibatches=step,
                                           warmup="latency", timeline=False)
                paper_sim = (dp.time_per_minibatch / p_noam.time_per_minibatch,
                             dp.time_per_minibatch / p_aware.time_per_minibatch)
            rows.append({
                "profile": name, "cluster": cluster_name, "config": plan.config,
                "planner_speedup": plan.speedup_over_dp,
                "sim_speedup": dp.time_per_minibatch / noam.time_per_minibatch,
                "sim_speedup_latency": dp.time_per_minibatch / aware.time_per_minibatch,
                "sim_bubble": noam.steady_bubble,
                "peak_gib": noam.peak_memory / 2**30,
                "peak_gib_latency": aware.peak_memory / 2**30,
                "device_gib": cluster.device.memory / 2**30,
                "planner_ms": plan.time_per_minibatch * 1e3,
                "sim_ms": noam.time_per_minibatch * 1e3,
                "sim_dp_ms": dp.time_per_minibatch * 1e3,
                "paper_config": paper[0], "paper_speedup": paper[1],
                "paper_source": paper[2], "paper_sim": paper_sim,
                "plan_seconds": plan_seconds, "sim_seconds": sim_seconds,
            })
            print(f"  {name:<14} {cluster_name} {plan.config:<24} done "
                  f"({plan_seconds:.1f} s plan, {sim_seconds:.1f} s simulate)", file=sys.stderr)
    return rows


def paper_plan(graph: Any, config: str, cluster: Cluster) -> Any:
    """The paper's configuration as a Plan we can simulate, where we know where it cuts: "16"
    (data parallelism) and "15-1" cut before the first fully connected layer (the source says
    the convolutional layers are replicated and the fully connected ones are not; the exact cut
    is our reading). None for other configurations."""
    from pdcompile.cost.costgraph import topological_order
    from pdcompile.plan import Plan, Stage

    if config == str(cluster.workers):
        return data_parallel_plan(graph, cluster)
    if config != f"{cluster.workers - 1}-1":
        return None
    order = topological_order(graph)
    first_fc = next((i for i, n in enumerate(order)
                     if str(graph.nodes[n].get("label", "")).startswith("Linear")), None)
    if first_fc is None:
        return None
    workers = cluster.workers
    stages = (Stage(tuple(order[:first_fc]), workers - 1, tuple(range(workers - 1))),
              Stage(tuple(order[first_fc:]), 1, (workers - 1,)))
    return Plan(stages=stages, time_per_minibatch=0.0, dp_time=0.0, workers=workers,
                planner="paper")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `paper_comparison` rows."""
    head = ("| profile | cluster | our config | planner speed-up | simulated speed-up (NOAM) | "
            "simulated speed-up (latency-aware warm-up) | steady bubble (NOAM) | "
            "planner / simulated / simulated DP ms per minibatch | peak GiB per worker "
            "(NOAM / latency-aware) | **paper** config | **paper** speed-up (Table 1) | "
            "source | paper's config simulated here: speed-up (NOAM / latency-aware) |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        listed = (r["profile"], r["cluster"]) in PAPER_TABLE_1
        missing = "not available" if listed else "-"
        paper = r["paper_speedup"] or missing
        config = r["paper_config"] or missing
        theirs = (f"{r['paper_sim'][0]:.2f}x / {r['paper_sim'][1]:.2f}x"
                  if r["paper_sim"] else "-")
        over = " (over device)" if r["peak_gib"] > r["device_gib"] else ""
        lines.append(
            f"| {r['profile']} | {r['cluster']} | {r['config']} | {r['planner_speedup']:.2f}x | "
            f"{r['sim_speedup']:.2f}x | {r['sim_speedup_latency']:.2f}x | {r['sim_bubble']:.0%} | "
            f"{r['planner_ms']:.1f} / {r['sim_ms']:.1f} / {r['sim_dp_ms']:.1f} | "
            f"{r['peak_gib']:.1f} / {r['peak_gib_latency']:.1f}{over} | "
            f"{config} | {paper} | {r['paper_source'] or '-'} | {theirs} |")
    return "\n".join(lines)


def scaling() -> list[tuple[str, int, int, float, float]]:
    """Simulator speed: (shape, workers, minibatches, seconds to generate+lower, to simulate)."""
    from pdcompile.backends.simulate import simulate
    from pdcompile.cost.stage_costs import StageCosts
    from pdcompile.schedule.generators import generate
    from pdcompile.schedule.lower import lower

    cluster = Cluster.preset("h100-4node").with_workers(64)
    out = []
    for shape, ranks in (("64 stages x 1", [[s] for s in range(64)]),
                         ("16 stages x 4", [list(range(4 * s, 4 * s + 4)) for s in range(16)])):
        started = time.perf_counter()
        schedule = lower(generate("1f1b", ranks, 1000))
        built = time.perf_counter() - started
        costs = StageCosts.uniform(len(ranks), fwd=1e-3, bwd=2e-3, params=1e8, edge_bytes=1e6)
        started = time.perf_counter()
        simulate(schedule, costs, cluster)
        out.append((shape, 64, 1000, built, time.perf_counter() - started))
    return out


# ------------------------------------------------------------------ fidelity, synthetic stages
def _work(seconds: float, mode: str, per_iteration: float, a: torch.Tensor) -> None:
    """Spend `seconds`: sleeping (an accelerator's kernel: the CPU stays free) or multiplying."""
    if mode == "sleep":
        time.sleep(seconds)
        return
    for _ in range(max(1, round(seconds / per_iteration))):
        torch.mm(a, a)


def _synthetic_worker(rank: int, world: int, port: int, schedule_text: str,
                      fwd: list[float], bwd: list[float], edge_numel: int, params_numel: int,
                      mode: str, out: str) -> None:
    """Run one rank's lowered actions for real: compute stand-ins, gloo sends and all-reduces."""
    from datetime import timedelta

    import torch.distributed as dist

    from pdcompile.schedule.ir import Kind, Schedule
    from pdcompile.timeline import Recorder, Timeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        schedule = Schedule.from_text(schedule_text)
        groups = {s: dist.new_group(list(ranks)) for s, ranks in enumerate(schedule.stage_ranks)
                  if len(ranks) > 1}
        stage = schedule.stage_of_rank(rank)
        a = torch.randn(128, 128)
        started = time.perf_counter()
        for _ in range(50):
            torch.mm(a, a)
        per_iteration = (time.perf_counter() - started) / 50
        payload, grads = torch.zeros(edge_numel), torch.zeros(params_numel)
        inbox = torch.zeros(edge_numel)
        recorder, sends = Recorder(rank), []
        dist.barrier()
        for action in schedule.actions[rank]:
            with recorder.record(action):
                kind = action.kind
                if kind == Kind.F:
                    _work(fwd[stage], mode, per_iteration, a)
                elif kind == Kind.B:
                    _work(bwd[stage], mode, per_iteration, a)
                elif kind in (Kind.SEND_F, Kind.SEND_B):
                    assert action.peer is not None
                    dst = schedule.rank_of(action.peer, action.microbatch)
                    tag = 2 * action.microbatch + (kind == Kind.SEND_B)
                    sends.append(dist.isend(payload, dst, tag=tag))
                elif kind in (Kind.RECV_F, Kind.RECV_B):
                    assert action.peer is not None
                    src = schedule.rank_of(action.peer, action.microbatch)
                    dist.recv(inbox, src, tag=2 * action.microbatch + (kind == Kind.RECV_B))
                elif kind == Kind.ALLREDUCE:
                    dist.all_reduce(grads, group=groups[stage])
        for handle in sends:
            if handle is not None:
                handle.wait()
        dist.barrier()
        Timeline(recorder.events, "measured").save(Path(out) / f"rank_{rank}.json")
    finally:
        dist.destroy_process_group()


def fidelity_synthetic(*, mode: str = "sleep", minibatches: int = 48,
                       fwd: float = 0.02, bwd: float = 0.04, edge_bytes: float = 4e6,
                       params_bytes: float = 4e6) -> list[dict[str, Any]]:
    """Simulated against measured time per minibatch for synthetic stages on real processes.

    Each rank runs its lowered 1F1B actions: F and B are stand-ins of `fwd` / `bwd` seconds
    (`mode` "sleep": the CPU stays free, as with an accelerator; "matmul": real CPU work),
    transfers are real gloo sends of `edge_bytes`, replicas all-reduce `params_bytes`. The
    simulator gets the per-stage F and B times measured in the same run and the local cluster
    model (measured loopback bandwidth), and predicts the same schedule.
    """
    import tempfile

    import torch.multiprocessing as mp

    from pdcompile.backends.simulate import simulate
    from pdcompile.cost.stage_costs import StageCosts
    from pdcompile.machine.local import free_port
    from pdcompile.schedule.generators import generate
    from pdcompile.schedule.lower import lower
    from pdcompile.timeline import Timeline

    rows = []
    shapes = [("2 stages", [[0], [1]]), ("4 stages", [[0], [1], [2], [3]]),
              ("2-1-1", [[0, 1], [2], [3]])]
    if mode == "matmul":
        shapes = shapes[:1]  # 2 cores: more processes than cores would measure the contention
    for label, ranks in shapes:
        world = sum(len(r) for r in ranks)
        schedule = lower(generate("1f1b", ranks, minibatches))
        stages = len(ranks)
        f = [fwd * len(r) for r in ranks]  # a replicated stage is that much slower per worker
        b = [bwd * len(r) for r in ranks]
        with tempfile.TemporaryDirectory() as out:
            ctx = mp.get_context("spawn")
            port = free_port()
            procs = [ctx.Process(target=_synthetic_worker,
                                 args=(r, world, port, schedule.to_text(), f, b,
                                       int(edge_bytes // 4), int(params_bytes // 4), mode, out))
                     for r in range(world)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(timeout=300)
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            if any(proc.exitcode != 0 for proc in procs):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"synthetic run {label}: exit codes {codes}")
            parts = [Timeline.load(Path(out) / f"rank_{r}.json") for r in range(world)]
        measured = Timeline.merge(parts)
        measured.meta.update({"schedule": "1f1b", "microbatches_per_minibatch": 1})
        measured.check_schedule(schedule)
        durations: dict[tuple[int, str], list[float]] = {}
        for event, action in measured.compute_events():
            durations.setdefault((action.stage, action.kind.value), []).append(event.duration)
        costs = StageCosts(
            tuple(sum(durations[s, "F"]) / len(durations[s, "F"]) for s in range(stages)),
            tuple(sum(durations[s, "B"]) / len(durations[s, "B"]) for s in range(stages)),
            params=(params_bytes,) * stages,
            edges={(s, s + 1): edge_bytes for s in range(stages - 1)},
            optimizer=(0.0,) * stages)
        cluster = Cluster.preset(f"local-{world}")
        if mode == "sleep":  # a sleeping stage leaves its core free, as an accelerator would
            cluster = replace(cluster, levels=tuple(replace(lv, cores=None)
                                                    for lv in cluster.levels))
        predicted = simulate(schedule, costs, cluster, timeline=False)
        real = measured.time_per_minibatch()
        rows.append({"shape": label, "processes": world, "mode": mode,
                     "measured_ms": real * 1e3, "simulated_ms": predicted.time_per_minibatch * 1e3,
                     "error": predicted.time_per_minibatch / real - 1.0})
        print(f"  fidelity {label} ({mode}): measured {real * 1e3:.1f} ms, simulated "
              f"{predicted.time_per_minibatch * 1e3:.1f} ms", file=sys.stderr)
    return rows


# ------------------------------------------------------------------ fidelity, compiled pipelines
FIDELITY_MODELS = ("mlp", "cnn")


def fidelity_model(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A compute-bound model for the fidelity runs and one example minibatch (inputs, target).

    "mlp": 8 linear layers of width 1024 on minibatches of 64 (about 8 ms of forward and
    backward per layer with one thread here; activations of 256 KiB between stages);
    "cnn": 6 convolutions of 48 channels on 32 x 32 images, minibatches of 16.
    """
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    if name == "mlp":
        for _ in range(8):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(1024, 10))
        example = torch.randn(64, 1024)
    elif name == "cnn":
        channels = 3
        for _ in range(6):
            layers += [torch.nn.Conv2d(channels, 48, 3, padding=1), torch.nn.ReLU()]
            channels = 48
        layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(48, 10)]
        example = torch.randn(16, 3, 32, 32)
    else:
        raise ValueError(f"unknown fidelity model {name!r}; choose one of {FIDELITY_MODELS}")
    return torch.nn.Sequential(*layers), example, torch.randint(0, 10, (example.shape[0],))


def fidelity_batches(name: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `steps` minibatches in every process (module level: picklable for the launch)."""
    _, example, _ = fidelity_model(name)
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(example.shape, generator=gen),
             torch.randint(0, 10, (example.shape[0],), generator=gen)) for _ in range(steps)]


def fidelity(processes: tuple[int, ...] = (2, 4), *, models: tuple[str, ...] = ("mlp",),
             minibatches: int = 256, repeats: int = 3, layouts: tuple[str, ...] = ("straight",),
             out: Path | None = None) -> list[dict[str, Any]]:
    """Simulated against measured time per minibatch of compiled pipelines on real processes.

    For each model and process count n: trace the model, measure its per-node costs with the
    cost pass (one thread, as the workers run), plan a straight n-stage pipeline for the
    `local-n` cluster (loopback bandwidth measured) with the DP planner (layout "straight"), or
    take plain data parallelism priced by the planner (layout "dp": one stage on n workers, its
    gradients all-reduced by gloo every round), compile it, export it,
    and train `minibatches` minibatches under asynchronous 1F1B on n local processes with the
    distributed backend, recording every action (`train_processes(record=True)`). The simulator
    runs the very schedule that ran (`pipe.schedule(minibatches)`) five times:

    - "cost pass": with the stage costs summed from the cost pass (`StageCosts.from_plan`) in
      the cache state the user's path profiles in for this cluster (`cache_flush.caches_for`:
      warm while every worker has a core, cold when n processes take turns on fewer cores),
      optimizer steps and weight snapshots timed on clones (`cost.optimizer_timing`): the prediction
      a user gets before running anything; on `local-n` with n above the core count the simulator
      shares the cores among the workers (`Level.cores`, processor sharing);
    - "cost pass, busy neighbours": the same, from a second cost pass that times every node
      while min(n, cores) - 1 helper processes run the model's forward and backward
      (`annotate_costs(neighbours=...)`), as the other workers of the pipeline will on the
      other cores (the time slicing beyond that is the simulator's);
    - "local dry run": with each stage's forward, backward and optimizer step measured by a
      short run of the compiled pipeline in this one process (`Pipeline.timed()`, then
      `StageCosts.with_measured_compute`): whole stages through the runtime's own path, weight
      stashing included, before any worker is launched (it cannot see cores shared by more
      workers than cores);
    - "measured compute": with each stage's forward, backward and optimizer step replaced by
      the means measured in the run, so the remaining error is the schedule, transfers and
      per-action overheads the simulator does not model;
    - "cost pass, the other cache state": the same from a cost pass in the other state
      (`annotate_costs(caches=...)`; "cold" evicts the last-level cache before every timed
      run): warm and cold bracket the run.

    `repeats` real runs and as many dry runs: this VM's compute varies from run to run by about
    as much as the target, so the row reports the median measured time (and its spread), the
    median of the dry runs' predictions and of the measured-compute predictions; the comparison
    table is of the median run. `compare()` of the cost-pass prediction and the measured
    timeline says where the error is. With `out`, the median run's timelines, Gantt charts and
    comparison table are written there.
    """
    import functools
    import tempfile

    from pdcompile.backends.simulate import simulate
    from pdcompile.cost.cache_flush import caches_for
    from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
    from pdcompile.cost.optimizer_timing import time_optimizer_steps, time_weight_copies
    from pdcompile.cost.stage_costs import StageCosts
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.passes.trace import trace
    from pdcompile.timeline import stage_figures
    from pdcompile.viz.compare import compare
    from pdcompile.worker import train_processes

    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    rows = []
    for name, n, layout in itertools.product(models, processes, layouts):
        model, example, target = fidelity_model(name)
        cluster = Cluster.preset(f"local-{n}")
        # as the user's path profiles for this cluster: cold caches where workers take turns
        caches = caches_for(cluster)
        other = "warm" if caches == "cold" else "cold"
        gm = trace(model)
        annotate_shapes(gm, (example,))
        annotate_costs(gm, (example,), caches=caches)
        graph = to_cost_graph(gm, name=name)
        neighbours = min(n, cores) - 1  # the rest of the sharing is the simulator's
        gm_busy = trace(model)
        annotate_shapes(gm_busy, (example,))
        annotate_costs(gm_busy, (example,), neighbours=neighbours, caches=caches)
        graph_busy = to_cost_graph(gm_busy, name=name)
        gm_other = trace(model)
        annotate_shapes(gm_other, (example,))
        annotate_costs(gm_other, (example,), caches=other)
        graph_other = to_cost_graph(gm_other, name=name)
        if layout == "dp":
            plan = price_plan(graph, data_parallel_plan(graph, cluster), cluster)
        else:
            plan = pdcompile.plan(graph, cluster, planner="dp", straight=True)
        pipe = pdcompile.compile(model, example_inputs=(example,), example_target=target,
                                 plan=plan, loss_fn=torch.nn.functional.cross_entropy)
        schedule = pipe.schedule(minibatches)
        runs = []
        with tempfile.TemporaryDirectory() as export:
            pipe.export(export)
            for _ in range(repeats):
                started = time.perf_counter()
                run = train_processes(export, n, functools.partial(fidelity_batches, name,
                                                                   minibatches),
                                      steps=minibatches, record=True, timeout=300)
                assert run.timeline is not None
                run.timeline.check_schedule(schedule)
                runs.append((run.timeline.time_per_minibatch(), run.timeline,
                             time.perf_counter() - started))
        runs.sort(key=lambda r: r[0])
        _, measured, wall = runs[len(runs) // 2]  # the median run (odd repeats)
        # the optimizer steps and weight snapshots timed on clones, as the demo predicts
        runtime_work = {"optimizer": time_optimizer_steps(pipe),
                        "stash": time_weight_copies(pipe)}
        costs = replace(StageCosts.from_plan(graph, plan), **runtime_work)
        predicted = simulate(schedule, costs, cluster)
        # as the simulator priced it before the runtime computed weight gradients after the
        # input-gradient send: every backward one block before its send
        block = simulate(schedule, costs, cluster, timeline=False, wgrad_share=0.0)
        costs_busy = replace(StageCosts.from_plan(graph_busy, plan), **runtime_work)
        with_busy = simulate(schedule, costs_busy, cluster, timeline=False)
        seen = stage_figures(measured)
        stages = range(costs.stages)
        # F and B of each run include the copies; the median run's prediction is reported
        with_measured = simulate(schedule, costs.with_measured_compute(measured), cluster,
                                 timeline=False)
        costs_other = replace(StageCosts.from_plan(graph_other, plan), **runtime_work)
        with_other = simulate(schedule, costs_other, cluster, timeline=False)
        comparison = compare(predicted.timeline, measured)
        real = comparison.time_per_minibatch.measured
        alone = _stages_alone(pipe.stage_modules, example)
        # a local dry run: the compiled pipeline's own rank loops in this one process
        # (stash path included), a few minibatches, its per-stage means as the costs
        dry = []
        pipe.timed()
        for _ in range(repeats):
            pipe.train(fidelity_batches(name, DRY_RUN_MINIBATCHES))
            assert pipe.last_timeline is not None
            from_dry = costs.with_measured_compute(pipe.last_timeline)
            dry.append((simulate(schedule, from_dry, cluster, timeline=False), from_dry))
        pipe.timed(record=False)
        dry.sort(key=lambda r: r[0].time_per_minibatch)
        with_dry, dry_costs = dry[len(dry) // 2]
        block_dry = simulate(schedule, dry_costs, cluster, timeline=False, wgrad_share=0.0)
        cost_compute = sum(costs.fwd[s] + costs.bwd[s] for s in stages)
        run_compute = sum(seen[s]["fwd"] + seen[s]["bwd"] for s in stages)
        busy_compute = sum(costs_busy.fwd[s] + costs_busy.bwd[s] for s in stages)
        rows.append({
            "model": name, "processes": n, "cores": cores,
            "config": f"{plan.config}, {len(plan.stages)} stages",
            "measured_ms": real * 1e3,
            "measured_range_ms": (runs[0][0] * 1e3, runs[-1][0] * 1e3),
            "repeats": repeats,
            "predicted_ms": predicted.time_per_minibatch * 1e3,
            "error": predicted.time_per_minibatch / real - 1.0,
            "neighbours": neighbours,
            "block_error": block.time_per_minibatch / real - 1.0,
            "block_dry_error": block_dry.time_per_minibatch / real - 1.0,
            "busy_ms": with_busy.time_per_minibatch * 1e3,
            "busy_error": with_busy.time_per_minibatch / real - 1.0,
            "busy_compute_ms": busy_compute * 1e3,
            "dry_ms": with_dry.time_per_minibatch * 1e3,
            "dry_error": with_dry.time_per_minibatch / real - 1.0,
            "measured_compute_ms": with_measured.time_per_minibatch * 1e3,
            "measured_compute_error": with_measured.time_per_minibatch / real - 1.0,
            "caches": caches, "other_caches": other,
            "other_ms": with_other.time_per_minibatch * 1e3,
            "other_error": with_other.time_per_minibatch / real - 1.0,
            "compute_ratio": cost_compute / run_compute if run_compute else float("nan"),
            "compute_ms": (cost_compute * 1e3, sum(alone) * 1e3, run_compute * 1e3),
            "bubble_measured": measured.steady_bubble_fraction(),
            "bubble_predicted": predicted.steady_bubble,
            "wall_s": wall, "comparison": comparison,
        })
        print(f"  fidelity {name} x{n} ({plan.config}): measured {real * 1e3:.1f} ms, "
              f"predicted {predicted.time_per_minibatch * 1e3:.1f} ms "
              f"({rows[-1]['error']:+.1%}), with {neighbours} busy neighbours "
              f"{with_busy.time_per_minibatch * 1e3:.1f} ms "
              f"({rows[-1]['busy_error']:+.1%}), with measured compute "
              f"{with_measured.time_per_minibatch * 1e3:.1f} ms, from a local dry run "
              f"{with_dry.time_per_minibatch * 1e3:.1f} ms ({rows[-1]['dry_error']:+.1%}); "
              f"backward as one block: cost pass {rows[-1]['block_error']:+.1%}, dry run "
              f"{rows[-1]['block_dry_error']:+.1%}", file=sys.stderr)
        if out is not None:
            _write_fidelity_run(out / f"{name}-{n}-{layout}", predicted.timeline, measured,
                                comparison.table(), plan.rank_to_stage())
    return rows


def _stages_alone(modules: list[Any], example: torch.Tensor) -> list[float]:
    """Forward + backward seconds of each whole stage module run alone in this process (one
    thread), fed the previous stage's output: what the stage costs without the pipeline."""
    from pdcompile.cost.node_costs import measure_model

    out, value = [], example
    for module in modules:
        fwd, bwd = measure_model(module, (value,))
        out.append(fwd + bwd)
        with torch.no_grad():
            value = module(value)
        while isinstance(value, tuple | list):
            value = value[0]
    return out


def _write_fidelity_run(folder: Path, predicted: Any, measured: Any, table: str,
                        stage_of: dict[int, int]) -> None:
    """Timelines, Gantt charts and the comparison table of one fidelity run."""
    from pdcompile.viz.gantt import draw_gantt

    folder.mkdir(parents=True, exist_ok=True)
    predicted.save(folder / "predicted.json")
    measured.save(folder / "measured.json")
    draw_gantt(predicted, folder / "predicted.png", stage_of_rank=stage_of, title="predicted")
    draw_gantt(measured, folder / "measured.png", stage_of_rank=stage_of, title="measured")
    (folder / "comparison.txt").write_text(table + "\n")


def fidelity_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `fidelity` rows."""
    lines = ["| model | processes | plan | measured ms per minibatch, median (range) | "
             "predicted (cost pass) | "
             "error | predicted (cost pass, N-1 busy neighbours) | error | predicted from a local "
             "dry run | error | predicted with "
             "measured compute | error | predicted (cost pass, the other cache state) | error | "
             "compute per "
             "minibatch, all stages: cost pass / stages alone / in the run (ms) | compute per "
             "minibatch, cost pass with busy neighbours (ms) | steady bubble measured / "
             "predicted | error, backward priced as one block: cost pass / dry run |",
             "|" + "---|" * 18]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['processes']} | {r['config']} | {r['measured_ms']:.1f} "
            f"({r['measured_range_ms'][0]:.1f}-{r['measured_range_ms'][1]:.1f}) | "
            f"{r['predicted_ms']:.1f} ({r['caches']}) | **{r['error']:+.1%}** | "
            f"{r['busy_ms']:.1f} ({r['neighbours']}) | **{r['busy_error']:+.1%}** | "
            f"{r['dry_ms']:.1f} | **{r['dry_error']:+.1%}** | "
            f"{r['measured_compute_ms']:.1f} | "
            f"{r['measured_compute_error']:+.1%} | {r['other_ms']:.1f} ({r['other_caches']}) | "
            f"**{r['other_error']:+.1%}** | "
            f"{' / '.join(f'{v:.1f}' for v in r['compute_ms'])} | "
            f"{r['busy_compute_ms']:.1f} | "
            f"{r['bubble_measured']:.0%} / {r['bubble_predicted']:.0%} | "
            f"{r['block_error']:+.1%} / {r['block_dry_error']:+.1%} |")
    return "\n".join(lines)


FIDELITY_TITLE = "## Fidelity: compiled pipelines on the distributed backend"
DRY_RUN_MINIBATCHES = 16  # minibatches of the local dry run (fidelity)
SYNTHETIC_TITLE = "## Fidelity: synthetic stages on real processes"


def fidelity_section(rows: list[dict[str, Any]], *, minibatches: int, load: tuple[float, float],
                     command: str) -> str:
    """The Markdown section of the compiled-pipeline fidelity runs (title included)."""
    cores = os.cpu_count() or 1
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    quiet = load[0] < 0.5  # before the runs: the runs' own processes raise the load after them
    conditions = ("The machine was otherwise idle when the runs started." if quiet else
                  f"**Measured under load**: the machine ({cores} cores) was shared with other "
                  "jobs while these ran, so every measured time here is inflated and noisy; "
                  "rerun on a quiet machine before reading the errors.")
    details = "\n\n".join(
        f"#### {r['model']}, {r['processes']} processes ({r['config']})\n\n"
        + r["comparison"].markdown() for r in rows)
    return f"""{FIDELITY_TITLE}

Produced by `{command}`
({stamp}; {minibatches} minibatches per run; load average {load[0]:.1f} before and
{load[1]:.1f} after). Machine: {platform.machine()} VM, {cores} cores, torch {torch.__version__},
one torch thread per process, gloo over 127.0.0.1.

{conditions}

Every row is the median of {rows[0]['repeats'] if rows else 1} real runs (range in brackets) and
of as many local dry runs: this VM's compute varies from run to run by about as much as the
target. Each row: the model's per-node costs measured by the cost pass in this process (one
thread, as every worker runs), a straight pipeline with one stage per process planned by the DP
planner for `local-N` (loopback bandwidth measured), compiled, exported and trained for real under
asynchronous 1F1B on N processes by the distributed backend (`train_processes(record=True)`,
gloo over 127.0.0.1). The simulator runs the same lowered schedule that ran:
"predicted (cost pass)" is the prediction a user gets before running anything (target: within
15% for compute-bound pipelines), from a cost pass on an otherwise idle machine in the cache
state that `pdcompile plan`, `simulate` and `compile()` profile in for this cluster (in
brackets; `cache_flush.caches_for`: warm while every worker has a core, cold when the workers
outnumber the cores and take turns on them, each turn evicting the caches of the worker
before); "predicted (cost pass, N-1 busy neighbours)" is the same from a second cost pass that
times every node while min(N, cores) - 1 helper processes (the number in brackets; one thread
each) run the model's forward and backward in a loop (`annotate_costs(neighbours=...)`):
pipeline workers on one host compute at the same time and share its last-level cache and
memory bandwidth, so each layer can run slower in the pipeline than alone, and this profile
sees that slowdown before anything runs; "predicted from a local dry run" takes each stage's
forward, backward and optimizer step from {DRY_RUN_MINIBATCHES} minibatches of the compiled
pipeline run in this one process (`Pipeline.timed()`, `StageCosts.with_measured_compute`): whole
stages through the runtime's own path, weight stashing included, still before any worker is
launched; "predicted with measured compute" replaces each stage's forward, backward and
optimizer step by the means measured in the run, so what remains is the simulator's model of
the schedule, the transfers and the overheads between actions; "the other cache state" is the
cost pass in the state the first column did not use (cold: the last-level cache evicted before
every timed run, `annotate_costs(caches="cold")`): warm and cold bracket the run. On top of the cost
pass the simulator adds what the runtime does around the stage modules, timed in this process
on clones of each stage's parameters (`pdcompile.cost.optimizer_timing`, as `pdcompile demo`
predicts): the optimizer step, and under asynchronous 1F1B the weight-stash snapshot on stages
that keep more than one minibatch in flight (one clone of the weights per new version; the last
stage uses its live weights; a backward hands the stashed gradients over without a copy).
Sends over loopback occupy the sending process for bytes / loopback bandwidth (the copy is its
CPU's work; `Level.cpu_copies`). Runs are {minibatches} minibatches long and measured over the
middle half of their completions: a worker's heap grows for its first ~100 minibatches (the
CNN's workers from 300 to 700 MB, with page faults that cost 10-25% of the CPU while it lasts),
and the simulator predicts the steady state after that. Every process, this one included, runs with
`runtime/allocator.tune_allocator()` (freed memory kept for reuse). The first compute column
sums forward + backward of all stages per minibatch three ways: the cost pass (per node,
summed), each whole stage module timed alone in this process, and the means measured in the
run (stash copies included); the next one is the cost pass with busy neighbours (per node,
summed). "mlp": 8 linear layers of 1024 on minibatches of 64; "cnn": 6 convolutions of 48
channels on 32 x 32 images, minibatches of 16 (`fidelity_model`).

**4 processes on a {cores}-core machine are oversubscribed**: the simulator shares the cores
among the workers (`local-N` records this machine's cores, `Level.cores`; k workers computing on
c cores each run at c / k of their speed, and a loopback transfer keeps a core busy on both
ends), with costs profiled cold, as the workers find their caches after another worker's turn.
What it does not model: the operating system's time slices (a woken receiver waits for a core:
measured receive waits of 5-8 ms per minibatch where it predicts about 1) and the runtime's own
CPU per action (the workers' user time per minibatch is 10-20% above the profiled compute).
In these rows "predicted with measured compute" overshoots by construction: a forward measured
in the run already lasted longer for sharing its core, and the simulator shares the core again.

{fidelity_table(rows)}

Per run, `pdcompile.viz.compare` of the cost-pass prediction and the measured timeline (per stage:
mean forward, backward, optimizer step, time spent posting sends and waiting in receives per
microbatch; share of the steady window computing and outside any action):

{details}
"""


def synthetic_section(rows: list[dict[str, Any]], load: tuple[float, float]) -> str:
    """The Markdown section of the synthetic-stage runs (title included)."""
    return f"""{SYNTHETIC_TITLE}

Every rank runs its lowered 1F1B actions from the schedule IR (`fidelity_synthetic`), F and B
as stand-ins (sleep: the CPU stays free, as with an accelerator; matmul: real CPU work, 2
processes only on this 2-core machine), transfers as real gloo sends of 4 MB between processes,
replicas all-reducing 4 MB; 48 minibatches. The simulator gets the F and B times measured in the
same run and the `local-N` cluster (loopback bandwidth measured; for sleeping stages without
its core count: they leave the cores free), so the difference is the modelling of the schedule
and the communication. Load average of the machine {load[0]:.1f} before, {load[1]:.1f} after
({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}; {platform.machine()} VM,
{os.cpu_count()} cores, torch {torch.__version__}).

| shape | processes | compute | measured ms per minibatch | simulated | error |
|---|---|---|---|---|---|
""" + "\n".join(f"| {r['shape']} | {r['processes']} | {r['mode']} | {r['measured_ms']:.1f} | "
                f"{r['simulated_ms']:.1f} | {r['error']:+.1%} |" for r in rows) + "\n"


def replace_sections(text: str, sections: dict[str, str]) -> str:
    """`text` with each "## title" section replaced by (or, if missing, followed by) its new
    text; the other sections are kept as they are."""
    parts: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            parts.append([])
        parts[-1].append(line)
    out, done = [], set()
    for part in parts:
        title = part[0].rstrip("\n") if part and part[0].startswith("## ") else None
        if title in sections:
            out.append(sections[title].rstrip("\n") + "\n\n")
            done.add(title)
        elif part:
            out.append("".join(part).rstrip("\n") + "\n\n")
    for title, body in sections.items():
        if title not in done:
            out.append(body.rstrip("\n") + "\n\n")
    return "".join(out).rstrip("\n") + "\n"


def sections_of(text: str) -> dict[str, str]:
    """The "## title" sections of a Markdown text, by title line (each with its title)."""
    out: dict[str, str] = {}
    title: str | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            title = line.rstrip("\n")
            out[title] = ""
        if title is not None:
            out[title] += line
    return out


def main() -> int:
    """Print the tables; with --write also update benchmarks/results/simulator.md."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planner", default="dp", choices=("auto", "dp", "ilp"))
    parser.add_argument("--cost-model", nargs="+", default=["native", "pipedream"],
                        choices=("native", "pipedream"))
    parser.add_argument("--minibatches", type=int, default=64)
    parser.add_argument("--profiles", nargs="*", default=None)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--fidelity", action="store_true",
                        help="only the fidelity runs of compiled pipelines (about 3 minutes); "
                        "with --write only their section of the results is replaced")
    parser.add_argument("--fidelity-minibatches", type=int, default=256)
    parser.add_argument("--fidelity-repeats", type=int, default=3,
                        help="real runs and dry runs per row (medians; odd)")
    parser.add_argument("--fidelity-models", nargs="+", default=list(FIDELITY_MODELS),
                        choices=FIDELITY_MODELS)
    parser.add_argument("--fidelity-processes", nargs="+", type=int, default=[2, 4],
                        help="process counts of the fidelity runs")
    parser.add_argument("--fidelity-layouts", nargs="+", default=["straight"],
                        choices=("straight", "dp"),
                        help="straight pipelines, and/or plain data parallelism (its all-reduce "
                        "priced at the loopback's measured all-reduce bandwidth)")
    parser.add_argument("--fidelity-out", type=Path, default=None,
                        help="also write each fidelity run's timelines and Gantt charts here")
    parser.add_argument("--no-fidelity", action="store_true",
                        help="skip every run on real processes")
    args = parser.parse_args()
    torch.set_num_threads(1)

    sections: dict[str, str] = {}
    if not args.no_fidelity:
        before = os.getloadavg()[0]
        rows = fidelity(tuple(args.fidelity_processes), models=tuple(args.fidelity_models),
                        minibatches=args.fidelity_minibatches,
                        repeats=args.fidelity_repeats,
                        layouts=tuple(args.fidelity_layouts), out=args.fidelity_out)
        command = ("python benchmarks/simulator.py --fidelity --write" if args.fidelity else
                   "python benchmarks/simulator.py --write")
        sections[FIDELITY_TITLE] = fidelity_section(
            rows, minibatches=args.fidelity_minibatches, load=(before, os.getloadavg()[0]),
            command=command)
    if args.fidelity:
        text = "\n\n".join(sections.values())
        print(text)
        if args.write:
            old = RESULTS.read_text() if RESULTS.exists() else "# Simulator results\n"
            RESULTS.write_text(replace_sections(old, sections))
        return 0
    if not args.no_fidelity:
        before = os.getloadavg()[0]
        synthetic = fidelity_synthetic(mode="sleep") + fidelity_synthetic(mode="matmul")
        sections[SYNTHETIC_TITLE] = synthetic_section(synthetic, (before, os.getloadavg()[0]))

    tables = []
    for cost_model in args.cost_model:
        rows = paper_comparison(planner=args.planner, cost_model=cost_model,
                                minibatches=args.minibatches, profiles=args.profiles)
        tables.append(f"### Plans from cost model `{cost_model}`\n\n{format_table(rows)}")
    table = "\n\n".join(tables)
    speed = scaling()
    speed_table = "\n".join(
        ["| schedule shape | workers | minibatches | generate + lower (s) | simulate (s) |",
         "|---|---|---|---|---|"]
        + [f"| {s} | {w} | {n} | {b:.2f} | {t:.2f} |" for s, w, n, b, t in speed])
    machine = (f"{platform.processor() or platform.machine()}, this VM ({os.cpu_count()} cores), "
               f"Python {platform.python_version()}, torch {torch.__version__} CPU")
    report = f"""# Simulator results

Machine: {machine}.
Produced by `python benchmarks/simulator.py --planner {args.planner} \
--cost-model {" ".join(args.cost_model)} --write`; the fidelity section alone by
`python benchmarks/simulator.py --fidelity --write` (about 2 minutes).

## The paper's comparison, in simulation (clusters A and B, 16 workers, V100 model)

Plans from `pdcompile.plan(planner="{args.planner}", cost_model=...)` for every shipped
PipeDream profile ("pipedream": the original optimizer's cost model; "native": ours).
"Simulated speed-up" is the simulator's time per minibatch of data parallelism (one stage on
all 16 workers, ring all-reduce each round) over that of the chosen plan, both in steady state
of a stream of minibatches under asynchronous 1F1B(-RR) on the same simulator. NOAM:
PipeDream's warm-up depth; latency-aware: the deeper depth that also covers transfer time
(schedule.generators.latency_aware_warmup). **The "paper" columns are the paper's own figures**
(Table 1 of the PipeDream SOSP'19 paper: speed-ups measured on real clusters, epoch time unless
marked TTA, time to accuracy), only where a source was found ("source" column, listed below);
"not available": the table has the row, but no source gave the figure; "-": the paper has no
such row. The last column simulates the paper's own configuration where we can build it ("16";
"15-1" cut before the first fully connected layer) against the same data-parallel baseline.
Everything else is computed here.

{table}

{PAPER_SOURCES}

Reading the table. The planner prices a plan with a closed-form model (slowest stage, transfers
and replica all-reduce assumed overlapped or added per stage); the simulator runs the actual 1F1B
order on the cluster model, which adds three effects the closed form leaves out: (1) replicas of
a stage all-reduce after every round, so a round ends with its slowest replica, and replicas fed
one after another by a narrower stage wait for each other; (2) PipeDream's warm-up depth (NOAM)
counts workers only, so when a transfer takes longer than a stage's compute the pipeline drains
while data is on the wire; the latency-aware depth hides that at the price of more activations
in flight (see the memory column; "(over device)" marks plans that would not fit a 16 GiB V100);
(3) transfers on one link queue behind each other. With the native cost model, where the plan
is plain data parallelism ("16") the two agree to within 1% (the simulator adds the optimizer
step and the weight-stash copies): both price the ring all-reduce alike and leave the profiles'
`Input` time (data loading) out (the pipedream cost model prices the all-reduce its own way, so
its data-parallel times differ).

Against the paper. The simulated speed-ups are well below the paper's measured ones. For
VGG-16 the native planner's plans simulate at 1.51x on A (15-1, the paper's configuration) and
1.42x on B (12-4), the paper's 15-1 at 1.45x on both, and all fit a 16 GiB V100 (14.5 and
13.0 GiB per worker for ours); the pipedream cost model's plans simulate at 1.12x and 0.38x:
its closed-form model ranks configurations differently from the simulator.
`pdcompile.refine_plan` searches around the planner's plan with the simulator itself
(benchmarks/refine.py, refine.md). The remaining gap to
5.28x / 2.98x is not explained by anything measured here; one candidate is the baseline: our
data parallelism is an ideal ring all-reduce at full link bandwidth, the paper's was PyTorch's
DistributedDataParallel of 2019 on those clusters. This comparison is deterministic (profiles
and cluster models only, no timing), so it does not change between runs.

## Simulator speed

{speed_table}
"""
    if args.write and RESULTS.exists():  # sections not rerun now are kept from the last run
        # (every one, those written by hand too: the data-parallel fidelity runs were once
        # dropped here), in the file's order
        own = set(sections_of(report))
        kept = sections_of(RESULTS.read_text())
        sections = {title: sections.get(title, body) for title, body in kept.items()
                    if title not in own} | sections
    report = replace_sections(report, sections)
    print(report)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
