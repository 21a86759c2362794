"""`pdcompile simulate`: plan a model or profile on a cluster, simulate the schedule, draw it.

    pdcompile simulate --profile vgg16 --cluster A \\
        --schedule 1f1b --out sim/
    pdcompile simulate pdcompile/models/vgg16.py:factory --cluster B --schedule 1f1b-flush \\
        --microbatches 8

Prints the plan and the simulated figures (time per minibatch, throughput, bubble, memory per
worker) and writes to --out: plan.json, schedule.txt, timeline.json, gantt.png, gantt.svg,
trace.json (Chrome trace). With --measured TIMELINE.json (recorded by a real run of the same
plan) it prints predicted against measured figures (`pdcompile.viz.compare`: time per minibatch,
bubble, per-stage forward, backward and receive waits) and draws the measured run too.
A MODEL is profiled on this CPU, with cold caches where the cluster's workers outnumber their
cores (`local-N` on a smaller machine: the workers take turns, and the simulator shares the
cores among them), or, with --cost analytic, priced on the cluster's device (FLOPs and bytes),
as `pdcompile plan --cost analytic` prices it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdcompile.backends.simulate import SimResult
from pdcompile.cli.common import (
    add_cluster_option,
    add_cost_option,
    load_cluster,
    load_cost_graph,
    read_plan_file,
)
from pdcompile.errors import PdcompileError
from pdcompile.machine.local import oversubscription_note
from pdcompile.plan import Plan
from pdcompile.planner.simulation import simulate_plan
from pdcompile.schedule.ir import Schedule
from pdcompile.schedule.kinds import KINDS
from pdcompile.timeline import Timeline
from pdcompile.units import format_seconds
from pdcompile.viz.compare import Comparison, compare


def register(subparsers: Any) -> None:
    """Add the `simulate` parser."""
    parser = subparsers.add_parser(
        "simulate", help="predict a pipeline's speed on a cluster and draw its timeline",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?",
                        help="path/to/file.py:factory returning (model, example inputs)")
    parser.add_argument("--profile",
                        help="a PipeDream graph.txt (or its folder) instead of a model")
    parser.add_argument("--costgraph", help="a CostGraph JSON file instead of a model")
    parser.add_argument("--plan", dest="plan_file", help="use this plan.json instead of planning")
    add_cluster_option(parser, default="A")
    parser.add_argument("--schedule", default="1f1b", choices=(*KINDS, "auto"),
                        help="the schedule, or 'auto': the planner chooses it and its "
                        "microbatches")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per minibatch (1f1b-flush, gpipe, 2bw; default: the "
                        "planner chooses, or 8 with --plan; 1f1b: 1)")
    parser.add_argument("--minibatches", type=int, default=None,
                        help="minibatches streamed through 1f1b / 2bw (rounded up to a multiple of "
                        "the replica counts; default: enough for the steady state)")
    parser.add_argument("--warmup", default="plan", choices=("plan", "noam", "latency"),
                        help="warm-up depth: the planner's choice (default; PipeDream's NOAM for "
                        "a plan without one), NOAM, or 'latency' (deep enough to hide transfers)")
    parser.add_argument("--planner", default="auto", choices=("auto", "dp", "ilp"))
    parser.add_argument("--cost-model", default="native", choices=("native", "pipedream"))
    add_cost_option(parser)
    parser.add_argument("--measured", help="a timeline.json recorded by a real run, to compare")
    parser.add_argument("--out", help="folder for plan.json, schedule.txt, timeline.json, "
                        "gantt.png/.svg and trace.json")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--slowdown", default=None, metavar="F0,F1,...",
                        help="each rank's compute this many times slower (one factor per "
                             "worker of the cluster, e.g. 1,2): the prediction for `pdcompile "
                             "run --slowdown` with the same factors")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The subcommand."""
    import pdcompile

    cluster = load_cluster(args.cluster)
    graph = load_cost_graph(args, cluster, cost=args.cost)
    if args.slowdown:
        try:
            factors = [float(f) for f in args.slowdown.split(",")]
        except ValueError:
            raise PdcompileError(f"--slowdown {args.slowdown!r}: write one number per worker, "
                                 "e.g. 1,2") from None
        cluster = cluster.with_slowdowns(factors)
    if args.plan_file:
        plan = read_plan_file(args.plan_file)
        if args.schedule == "auto":
            raise PdcompileError("--schedule auto lets the planner choose; with --plan name the "
                                 "schedule to simulate (or leave --schedule out for the plan's)")
    else:
        plan = pdcompile.plan(graph, cluster, planner=args.planner, cost_model=args.cost_model,
                              schedule=args.schedule, microbatches=args.microbatches)
    if plan.workers > cluster.workers:
        raise PdcompileError(f"the plan uses {plan.workers} workers but the cluster has "
                             f"{cluster.workers}")
    note = oversubscription_note(plan.workers) if cluster.name.startswith("local") else None
    if note is not None:
        print(note, file=sys.stderr)
    name = plan.schedule if args.schedule == "auto" else args.schedule
    schedule, result = simulate_plan(graph, plan, cluster, schedule=name,
                                     microbatches=args.microbatches,
                                     minibatches=args.minibatches, warmup=args.warmup)
    measured = Timeline.load(args.measured) if args.measured else None
    comparison = compare(result.timeline, measured) if measured is not None else None
    figures = _figures(plan, result, comparison)
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        print(plan.summary())
        print()
        print(result.summary())
        print(f"planner predicted {format_seconds(plan.time_per_minibatch)} per minibatch; "
              f"simulated {format_seconds(result.time_per_minibatch)}")
        if comparison is not None:
            print()
            print(f"predicted against measured ({args.measured}):")
            print(comparison.table())
    if args.out:
        written = write_outputs(Path(args.out), plan, schedule, result, measured)
        if not args.json:
            print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _figures(plan: Plan, result: SimResult, comparison: Comparison | None) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "config": plan.config, "schedule": result.schedule,
        "planner_time_per_minibatch": plan.time_per_minibatch,
        "time_per_minibatch": result.time_per_minibatch, "throughput": result.throughput,
        "makespan": result.makespan, "bubble": result.bubble,
        "steady_bubble": result.steady_bubble, "peak_memory": result.peak_memory,
        "memory": {str(r): m.total for r, m in sorted(result.memory.items())},
    }
    if comparison is not None:
        measured_time = comparison.time_per_minibatch.measured
        figures["measured_time_per_minibatch"] = measured_time
        figures["predicted_over_measured"] = (result.time_per_minibatch / measured_time
                                              if measured_time > 0 else float("inf"))
        figures["comparison"] = comparison.to_dict()
    return figures


def write_outputs(out: Path, plan: Plan, schedule: Schedule, result: SimResult,
                  measured: Timeline | None) -> list[Path]:
    """plan.json, schedule.txt, timeline.json, gantt.png/.svg, trace.json (+ measured_*)."""
    from pdcompile.viz.chrome_trace import write_chrome_trace
    from pdcompile.viz.gantt import draw_gantt

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "plan.json", out / "schedule.txt", out / "timeline.json"]
    written[0].write_text(plan.to_json())
    written[1].write_text(schedule.to_text())
    result.timeline.save(written[2])
    stage_of = plan.rank_to_stage()
    title = f"{plan.config} {result.schedule}: {format_seconds(result.time_per_minibatch)} per " \
            f"minibatch, bubble {result.bubble:.0%} (simulated)"
    draw_gantt(result.timeline, [out / "gantt.png", out / "gantt.svg"], title=title,
               stage_of_rank=stage_of)
    written += [out / "gantt.png", out / "gantt.svg", write_chrome_trace(result.timeline,
                                                                         out / "trace.json")]
    if measured is not None:
        draw_gantt(measured, out / "measured_gantt.png", stage_of_rank=stage_of,
                   title=f"{plan.config} measured")
        written += [out / "measured_gantt.png",
                    write_chrome_trace(measured, out / "measured_trace.json")]
    return written
