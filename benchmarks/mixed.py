"""Mixed clusters: our plans against the two ways to ignore the mix, and an emulated real run.

Part 1, in simulation (no GPU needed): every shipped PipeDream profile planned with
`pdcompile.plan` on the mixed presets (device groups of two kinds, `Cluster.groups`), against
(a) the best plan on the fastest group alone and (b) the best plan that treats every device as
the slowest, both priced on the same mixed cluster by the same simulator (planner/mixed.py
makes both as candidates; `Plan.extra["mixed_times"]` holds their prices). Target (issue 23):
ours beats both.

Part 2, real processes on this machine: an MLP planned for `local-2` with rank 1 emulated
`FACTOR` times slower (`Cluster.with_slowdowns`, runtime/slowdown.py), compiled, exported and
trained on 2 gloo processes with `train_processes(slowdown=...)`; its measured time per
minibatch against the simulator's prediction on the slowed cluster, from the cost pass (what a
user gets before running anything) and from a local dry run (`Pipeline.timed()`); beside it the
even split that ignores the slowdown, run the same way. Target: within 15%.

    python benchmarks/mixed.py [--profiles vgg16,resnet50] [--clusters mixed-A] [--write]
    python benchmarks/mixed.py --emulate-only [--write]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import pdcompile
from pdcompile.machine.cluster import Cluster
from pdcompile.profiles import load_pipedream, profile_path, shipped_profiles

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mixed.md"
CLUSTERS = ("mixed-A", "mixed-a100-v100", "mixed-h100-a100")
FACTOR = 2.0  # rank 1 of the emulated run computes this many times slower
WIDTH, LAYERS, BATCH = 1024, 8, 64


def simulated(profiles: list[str], clusters: list[str], done: Any = None,
              previous: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Part 1: per profile and mixed cluster, our plan and the two baselines' prices
    (`done(rows)` after each row: the results so far survive an interrupted run)."""
    rows: list[dict[str, Any]] = list(previous or [])
    seen = {(r["profile"], r["cluster"]) for r in rows}
    for name in profiles:
        graph = load_pipedream(profile_path(name))
        for label in clusters:
            if (name, label) in seen:
                continue
            cluster = Cluster.preset(label)
            started = time.perf_counter()
            plan = pdcompile.plan(graph, cluster)
            seconds = time.perf_counter() - started
            times = plan.extra["mixed_times"]
            fastest = max(range(len(cluster.groups)), key=cluster.group_speed)
            alone = times.get(f"group {fastest} alone")
            slowest = times.get("as slowest")
            rows.append({"profile": name, "cluster": label, "config": plan.config,
                         "schedule": f"{plan.schedule} x{plan.microbatches}",
                         "found_by": plan.extra["found_by"], "ms": plan.time_per_minibatch * 1e3,
                         "alone_ms": None if alone is None else alone * 1e3,
                         "slowest_ms": None if slowest is None else slowest * 1e3,
                         "fast_group": cluster.groups[fastest].device.name,
                         "plan_seconds": seconds})
            row = rows[-1]
            print(f"  {name} on {label}: {plan.config} {row['ms']:.2f} ms ({row['found_by']}); "
                  f"fast group alone {_ms(row['alone_ms'])}, as slowest "
                  f"{_ms(row['slowest_ms'])} [{seconds:.1f} s]", file=sys.stderr)
            if done is not None:
                done(rows)
    return rows


def previous_rows(text: str) -> list[dict[str, Any]]:
    """The simulation table's rows in a results file (for --resume)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or not cells[4].replace(".", "", 1).isdigit():
            continue

        def ms(cell: str) -> float | None:
            return None if cell == "does not fit" else float(cell.split()[0])

        rows.append({"profile": cells[0], "cluster": cells[1], "config": cells[2],
                     "schedule": "", "found_by": cells[3], "ms": float(cells[4]),
                     "alone_ms": ms(cells[5]), "slowest_ms": ms(cells[6])})
    return rows


def _ms(value: float | None) -> str:
    return "does not fit" if value is None else f"{value:.2f} ms"


def _ratio(base: float | None, ours: float) -> str:
    return "(base does not fit)" if base is None else f"{base / ours:.2f}x"


def _simulated_section(rows: list[dict[str, Any]], beaten: int,
                       load: tuple[float, float, float]) -> str:
    return ("## Our plan against ignoring the mix, in simulation\n\n"
            "Shipped PipeDream profiles on the mixed presets (`pdcompile plan --help` lists "
            "them; the CostGraph's times are the first group's device's, the others' from the "
            "device models, `Device.speed_relative_to`). (a): the best plan on the fastest "
            "group alone; (b): the best plan that treats every device as the slowest; both "
            "priced on the mixed cluster by the same simulator as ours. Ours beats both on "
            f"{beaten} of {len(rows)} rows (where ours is the same plan as a baseline, it does "
            "not beat it). Load average when written: "
            f"{load[0]:.2f} (it changes the planning seconds only; prices are deterministic)."
            "\n\n" + simulated_table(rows))


def simulated_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| profile | cluster | our plan | found by | ms per minibatch | (a) fastest group "
             "alone, ms | (b) all as the slowest, ms | ours vs (a) | ours vs (b) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['cluster']} | "
                     f"{(r['config'] + ' ' + r['schedule']).strip()} | "
                     f"{r['found_by']} | {r['ms']:.2f} | {_ms(r['alone_ms'])} | "
                     f"{_ms(r['slowest_ms'])} | {_ratio(r['alone_ms'], r['ms'])} | "
                     f"{_ratio(r['slowest_ms'], r['ms'])} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- part 2: emulated
def mlp() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """LAYERS Linear(WIDTH) layers on minibatches of BATCH, and one example minibatch."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, 10))
    example = torch.randn(BATCH, WIDTH)
    return torch.nn.Sequential(*layers), example, torch.randint(0, 10, (BATCH,))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same minibatches in every process (module level: picklable)."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen),
             torch.randint(0, 10, (BATCH,), generator=gen)) for _ in range(steps)]


def emulated(*, minibatches: int = 64, repeats: int = 3) -> list[dict[str, Any]]:
    """Part 2: measured against predicted, for our plan and the even split, rank 1 slowed."""
    from pdcompile.backends.simulate import simulate
    from pdcompile.cost.cache_flush import caches_for
    from pdcompile.cost.node_costs import annotate_costs, to_cost_graph
    from pdcompile.cost.optimizer_timing import time_optimizer_steps, time_weight_copies
    from pdcompile.cost.stage_costs import StageCosts
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.passes.trace import trace
    from pdcompile.worker import train_processes

    torch.set_num_threads(1)
    factors = (1.0, FACTOR)
    plain = Cluster.preset("local-2")
    slowed = plain.with_slowdowns(factors)
    model, example, target = mlp()
    gm = trace(model)
    annotate_shapes(gm, (example,))
    # the process's CPU time: a plan that other work on this machine does not reshuffle
    annotate_costs(gm, (example,), caches=caches_for(plain), clock="cpu", repeats=9)
    graph = to_cost_graph(gm, name="mlp")
    # the same with the other worker's compute beside it (each of the 2 workers shares the
    # machine with 1 busy other: `annotate_costs(neighbours=...)`)
    busy = trace(mlp()[0])
    annotate_costs(busy, (example,), caches=caches_for(plain), clock="cpu", repeats=9,
                   neighbours=1)
    busy_graph = to_cost_graph(busy, name="mlp")
    plans = {"ours (speed-aware)": pdcompile.plan(graph, slowed, straight=True),
             "even split": pdcompile.plan(graph, plain, straight=True)}
    rows = []
    for label, plan in plans.items():
        pipe = pdcompile.compile(mlp()[0], example_inputs=(example,), example_target=target,
                                 plan=plan, loss_fn=torch.nn.functional.cross_entropy)
        schedule = pipe.schedule(minibatches)
        measured, full_speed = [], []
        with tempfile.TemporaryDirectory() as export:
            pipe.export(export)
            for _ in range(repeats):  # slowed and full-speed runs taking turns
                for slowdown, into in ((factors, measured), (None, full_speed)):
                    run = train_processes(export, 2, functools.partial(batches, minibatches),
                                          steps=minibatches, record=True, timeout=300,
                                          slowdown=slowdown)
                    assert run.timeline is not None
                    into.append((run.timeline.time_per_minibatch(), run.timeline))
        measured.sort(key=lambda m: m[0])
        full_speed.sort(key=lambda m: m[0])
        real = measured[len(measured) // 2][0]
        plain_ms, plain_timeline = full_speed[len(full_speed) // 2]
        work = {"optimizer": time_optimizer_steps(pipe), "stash": time_weight_copies(pipe)}
        costs = replace(StageCosts.from_plan(graph, plan), **work)
        from_cost_pass = simulate(schedule, costs, slowed, timeline=False).time_per_minibatch
        busy_costs = replace(StageCosts.from_plan(busy_graph, plan), **work)
        from_busy = simulate(schedule, busy_costs, slowed, timeline=False).time_per_minibatch
        # as the simulator priced it before the runtime computed weight gradients after the
        # input-gradient send: every backward one block before its send
        block_cost_pass = simulate(schedule, costs, slowed, timeline=False,
                                   wgrad_share=0.0).time_per_minibatch
        pipe.timed()
        pipe.train(batches(16))
        assert pipe.last_timeline is not None
        dry_costs = costs.with_measured_compute(pipe.last_timeline)
        pipe.timed(record=False)
        from_dry_run = simulate(schedule, dry_costs, slowed, timeline=False).time_per_minibatch
        block_dry_run = simulate(schedule, dry_costs, slowed, timeline=False,
                                 wgrad_share=0.0).time_per_minibatch
        # the same plan run at full speed: its measured stage compute, simulated slowed
        seen = costs.with_measured_compute(plain_timeline)
        from_plain = simulate(schedule, seen, slowed, timeline=False).time_per_minibatch
        # the slowdown's effect as a ratio, which contention common to both runs cancels from
        effect = from_plain / simulate(schedule, seen, plain, timeline=False).time_per_minibatch
        rows.append({"plan": label, "config": plan.config,
                     "plain_ms": plain_ms * 1e3, "effect": effect,
                     "measured_effect": real / plain_ms,
                     "plain_run_ms": from_plain * 1e3, "plain_run_error": from_plain / real - 1.0,
                     "measured_ms": real * 1e3,
                     "range_ms": (measured[0][0] * 1e3, measured[-1][0] * 1e3),
                     "cost_pass_ms": from_cost_pass * 1e3,
                     "cost_pass_error": from_cost_pass / real - 1.0,
                     "busy_ms": from_busy * 1e3, "busy_error": from_busy / real - 1.0,
                     "dry_run_ms": from_dry_run * 1e3, "dry_run_error": from_dry_run / real - 1.0,
                     "block_cost_pass_error": block_cost_pass / real - 1.0,
                     "block_dry_run_error": block_dry_run / real - 1.0,
                     "compute_ms": tuple(sum(c.fwd) * 1e3 + sum(c.bwd) * 1e3
                                         for c in (costs, busy_costs, dry_costs, seen)),
                     "nodes": [len(s.nodes) for s in plan.stages]})
        r = rows[-1]
        print(f"  emulated {label} {plan.config}: measured {r['measured_ms']:.1f} ms, cost pass "
              f"{r['cost_pass_ms']:.1f} ms ({r['cost_pass_error']:+.1%}), with a busy "
              f"neighbour {r['busy_ms']:.1f} ms ({r['busy_error']:+.1%}), dry run "
              f"{r['dry_run_ms']:.1f} ms ({r['dry_run_error']:+.1%}), full-speed run's compute "
              f"{r['plain_run_ms']:.1f} ms ({r['plain_run_error']:+.1%}); the full-speed run "
              f"took {r['plain_ms']:.1f} ms; backward as one block: cost pass "
              f"{r['block_cost_pass_error']:+.1%}, dry run {r['block_dry_run_error']:+.1%}; "
              f"compute per minibatch, cost pass / with a busy neighbour / dry run / full-speed "
              f"run: "
              f"{' / '.join(f'{c:.1f}' for c in r['compute_ms'])} ms", file=sys.stderr)
    return rows


def emulated_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| plan | nodes per stage | measured ms per minibatch, slowed (median; range) | "
             "predicted from the cost pass | error | from the cost pass, 1 busy neighbour | "
             "error | from a local dry run | error | from the "
             "full-speed run's stage compute | error | full-speed run, ms | slowed / full "
             "speed, measured | predicted | error, backward priced as one block: cost pass / "
             "dry run | compute per minibatch, all stages: cost pass / with a busy neighbour "
             "/ dry run / full-speed run (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["range_ms"]
        lines.append(f"| {r['plan']} | {' / '.join(map(str, r['nodes']))} | "
                     f"{r['measured_ms']:.1f} ({low:.1f}-{high:.1f}) | {r['cost_pass_ms']:.1f} | "
                     f"{r['cost_pass_error']:+.1%} | {r['busy_ms']:.1f} | "
                     f"{r['busy_error']:+.1%} | {r['dry_run_ms']:.1f} | "
                     f"{r['dry_run_error']:+.1%} | {r['plain_run_ms']:.1f} | "
                     f"{r['plain_run_error']:+.1%} | {r['plain_ms']:.1f} | "
                     f"{r['measured_effect']:.2f}x | {r['effect']:.2f}x | "
                     f"{r['block_cost_pass_error']:+.1%} / {r['block_dry_run_error']:+.1%} | "
                     f"{' / '.join(f'{c:.1f}' for c in r['compute_ms'])} |")
    return "\n".join(lines)


def merged(old: str, sections: list[str]) -> str:
    """The results file with `sections` (a header, then "## " parts) in place of the old ones of
    the same heading, the old parts this run did not make kept (the two parts run apart)."""
    parts = {chunk.split("\n", 1)[0]: "## " + chunk.strip()
             for chunk in old.split("\n## ")[1:]}
    for section in sections[1:]:
        parts[section.split("\n", 1)[0][3:]] = section
    return "\n\n".join([sections[0], *parts.values()]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default=",".join(shipped_profiles()))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--emulate-only", action="store_true")
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--minibatches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS}")
    parser.add_argument("--resume", action="store_true",
                        help="keep the simulation rows already in the results file, add others")
    args = parser.parse_args()
    load_before = os.getloadavg()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sections = [f"# Mixed clusters\n\nMachine: {platform.machine()}, this VM "
                f"({os.cpu_count()} cores), Python {platform.python_version()}, torch "
                f"{torch.__version__}. `python benchmarks/mixed.py --write` (both parts; "
                f"`--simulate-only` or `--emulate-only` rewrite one). This run: {stamp}."]
    if not args.emulate_only:
        def section(rows: list[dict[str, Any]]) -> str:
            beaten = sum(1 for r in rows if r["alone_ms"] is not None
                         and r["slowest_ms"] is not None
                         and r["ms"] < r["alone_ms"] and r["ms"] < r["slowest_ms"])
            return _simulated_section(rows, beaten, os.getloadavg())

        def done(rows: list[dict[str, Any]]) -> None:
            if args.write:
                RESULTS.write_text(merged(RESULTS.read_text() if RESULTS.exists() else "",
                                          [sections[0], section(rows)]))

        kept = previous_rows(RESULTS.read_text()) if args.resume and RESULTS.exists() else []
        rows = simulated(args.profiles.split(","), args.clusters.split(","), done, kept)
        sections.append(section(rows))
        print(simulated_table(rows))
    if not args.simulate_only:
        rows_e = emulated(minibatches=args.minibatches, repeats=args.repeats)
        load = os.getloadavg()
        table = emulated_table(rows_e)
        sections.append(
            f"## An emulated slower device, real processes\n\n"
            f"MLP of {LAYERS} x Linear({WIDTH}) on minibatches of {BATCH}, 2 gloo processes "
            f"(one thread each), rank 1 emulated {FACTOR:g}x slower (`train_processes(slowdown="
            f"(1, {FACTOR:g}))`, `pdcompile run --slowdown 1,{FACTOR:g}`), asynchronous 1F1B, "
            f"{args.minibatches} minibatches, median of {args.repeats} runs. Predictions: the "
            f"simulator on `local-2` with the same slowdown (`pdcompile simulate --slowdown "
            f"1,{FACTOR:g}`), from three sources of stage costs: the cost pass (before anything "
            f"runs; and again with 1 busy neighbour, `annotate_costs(neighbours=1)`: the other "
            f"worker's compute beside each timing), a local dry run (`Pipeline.timed()`, one "
            f"process), and the median of as "
            f"many full-speed runs of the same plan on the 2 processes, taking turns with the "
            f"slowed ones (their measured stage compute, so the error is that of the slowdown's "
            f"effect alone; the last two columns compare that effect as a ratio). Target: within "
            f"15%. Load average before / after: "
            f"{load_before[0]:.2f} / {load[0]:.2f} (other work shared the 2 cores).\n\n"
            + table)
        print(table)
    if args.write:
        RESULTS.write_text(merged(RESULTS.read_text() if RESULTS.exists() else "", sections))
        print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
