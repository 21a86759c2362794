"""`pdcompile plan`: partition a model or a profile over a cluster and print the plan.

    pdcompile plan --profile vgg16 \\
        --cluster 4x4@1e10,1.25e9 --cost-model pipedream
    pdcompile plan pdcompile/models/vgg16.py:factory --cluster A --planner ilp --time-limit 30
    pdcompile plan --costgraph graph.json --cluster 16 --memory 16GiB --json > plan.json
    pdcompile plan pdcompile.models.democnn:factory --cluster local-2 --draw plan.svg
    pdcompile plan --profile vgg16 --cluster A --draw vgg.png \\
        --stage 1
    pdcompile plan --profile alexnet --cluster A --refine 300

Prints the plan's summary (stages, replicas, ranks, predicted compute, sync, communication,
memory, time per minibatch, speed-up over data parallelism, planner status); --json prints
the plan as JSON instead (the same as Plan.to_json()). --draw writes the partitioned graph:
nodes grouped and coloured by stage, replicas in the stage titles, every edge crossing a stage
boundary labelled with its bytes per minibatch (.svg/.png drawn with matplotlib, .dot for
graphviz); stages of more than --collapse nodes are drawn as one box, --stage K expands only K.
--refine N then searches around the planner's plan with up to N simulations of asynchronous
1F1B (pdcompile.refine_plan) and prints the plan that simulates fastest.
Exit status: 0 ok, 1 a user error or bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdcompile.cli.common import (
    Spinner,
    add_cluster_option,
    add_cost_option,
    load_cluster,
    load_cost_graph,
)
from pdcompile.errors import PdcompileError
from pdcompile.planner import PLANNERS
from pdcompile.schedule.kinds import KINDS


def register(subparsers: Any) -> None:
    """Add the `plan` parser."""
    parser = subparsers.add_parser(
        "plan", help="partition a model or profile into (replicated) pipeline stages",
        description=__doc__, formatter_class=_Formatter)
    parser.add_argument("model", nargs="?",
                        help="path/to/file.py:factory or package.module:factory returning "
                        "(model, example inputs), e.g. pdcompile.models.vgg16:factory")
    parser.add_argument("--profile", metavar="PATH",
                        help="a PipeDream graph.txt (or its folder) instead of a model, e.g. "
                        "--profile vgg16")
    parser.add_argument("--costgraph", metavar="PATH",
                        help="a CostGraph JSON file instead of a model (written by "
                        "`pdcompile inspect --save`), e.g. --costgraph graph.json")
    add_cluster_option(parser, default="A")
    parser.add_argument("--planner", default="auto", choices=PLANNERS,
                        help="dp: PipeDream's dynamic program; ilp: the DP then the exact CP-SAT "
                        "model; auto: CP-SAT too when the graph is small (default), e.g. "
                        "--planner dp")
    parser.add_argument("--cost-model", default="native", choices=("native", "pipedream"),
                        help="native (default) or pipedream (the original optimizer's model), "
                        "e.g. --cost-model pipedream")
    parser.add_argument("--straight", action="store_true",
                        help="no replication: one worker per stage (a straight pipeline)")
    parser.add_argument("--memory", default=None,
                        help="memory per worker, e.g. --memory 16GiB (default: the cluster's "
                        "device; the pipedream model applies a memory limit only when given)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="seconds for CP-SAT (default 10), e.g. --time-limit 30")
    parser.add_argument("--schedule", default="1f1b",
                        choices=(*KINDS, "auto"),
                        help="the schedule the plan is priced for (memory, bubble; default "
                        "1f1b), or auto: the planner chooses it and its microbatches, e.g. "
                        "--schedule auto")
    parser.add_argument("--microbatches", type=int, default=None, metavar="N",
                        help="microbatches per minibatch for the flush schedules and 2bw "
                        "(default: the planner chooses), e.g. --microbatches 8")
    parser.add_argument("--stages", type=int, default=None, metavar="K",
                        help="exactly K straight stages balanced by cost (with a schedule "
                        "of chunks: K workers with two chunks each), e.g. --stages 4")
    add_cost_option(parser)
    parser.add_argument("--analytic", action="store_const", const="analytic", dest="cost",
                        help=argparse.SUPPRESS)
    parser.add_argument("--draw", metavar="PATH",
                        help="draw the partitioned graph to PATH (.svg, .png or .dot), e.g. "
                        "--draw plan.svg")
    parser.add_argument("--stage", type=int, metavar="K",
                        help="with --draw: expand only stage K, the others as boxes")
    parser.add_argument("--collapse", type=int, default=40, metavar="N",
                        help="with --draw: stages of more than N nodes drawn as one box "
                        "(default 40)")
    parser.add_argument("--refine", type=int, default=None, metavar="N",
                        help="then improve the plan by a local search scored by the simulator "
                        "(async 1F1B), N simulations at most, e.g. --refine 300")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as JSON (Plan.to_json()), e.g. --json > plan.json")
    parser.set_defaults(func=run)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of option help (the cluster presets are listed one per line)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        lines: list[str] = []
        for line in text.splitlines():
            indent = len(line) - len(line.lstrip())
            lines += textwrap.wrap(line, width, subsequent_indent=" " * indent) or [""]
        return lines


def run(args: argparse.Namespace) -> int:
    """Plan and print."""
    from pdcompile.planner import plan

    # checked before profiling and planning, which may take minutes
    if args.collapse < 1:
        raise PdcompileError(f"--collapse {args.collapse}: give a positive node count, e.g. "
                             "--collapse 40 (stages of more nodes are drawn as one box)")
    if args.stage is not None and args.stage < 0:
        raise PdcompileError(f"--stage {args.stage}: give a stage number from 0, e.g. --stage 0")
    cluster = load_cluster(args.cluster)
    graph = load_cost_graph(args, cluster, cost=args.cost,
                            progress=args.cost != "analytic" and not args.json
                            and sys.stderr.isatty())
    with Spinner(f"planning {graph.number_of_nodes()} nodes on {cluster.workers} workers"):
        result = plan(graph, cluster, planner=args.planner, cost_model=args.cost_model,
                      straight=args.straight, memory=args.memory, time_limit=args.time_limit,
                      schedule=args.schedule, microbatches=args.microbatches,
                      stages=args.stages)
    refined = None
    if args.refine is not None:
        from pdcompile.planner.refine import refine_plan

        if args.refine < 1:
            raise PdcompileError(f"--refine {args.refine}: give the number of simulations, "
                                 "e.g. --refine 300")
        with Spinner(f"refining {result.config} by simulation ({args.refine} at most)"):
            refined = refine_plan(result, graph, cluster, max_evaluations=args.refine)
        result = refined.plan
    if args.json:
        print(result.to_json())
    else:
        print(f"{graph.graph.get('name') or 'model'} on {cluster.describe()}")
        print(result.summary())
        if refined is not None:
            print(f"refined by simulation ({refined.evaluations} simulations): "
                  f"{refined.start * 1e3:.2f} ms -> {refined.simulated * 1e3:.2f} ms per "
                  f"minibatch simulated ({refined.gain:.2f}x)"
                  + "".join(f"\n  {move}" for move in refined.moves))
    if args.draw:
        from pdcompile.viz.plan_graph import costgraph_picture, write_picture

        picture = costgraph_picture(graph, result, collapse=args.collapse, stage=args.stage)
        where = cluster.name or f"{cluster.workers} workers"
        title = (f"{graph.graph.get('name') or 'model'}: {result.config} on {where} "
                 "(edges: bytes per minibatch)")
        written = write_picture(picture, args.draw, title)
        print(f"wrote {written}", file=sys.stderr if args.json else sys.stdout)
    elif args.stage is not None:
        raise PdcompileError("--stage K chooses the stage --draw expands; add --draw plan.svg")
    return 0

