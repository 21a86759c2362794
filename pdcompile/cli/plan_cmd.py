"""`pdcompile plan`: partition a model or a profile over a cluster and print the plan.

    pdcompile plan --profile vgg16/graph.txt --cluster 4x4@1e10,1.25e9 --cost-model pipedream
    pdcompile plan examples/vgg16.py:factory --cluster A --planner ilp --time-limit 30
    pdcompile plan --costgraph graph.json --cluster 16 --memory 16GiB --json > plan.json

Prints the plan's summary (stages, replicas, ranks, predicted compute, sync, communication,
memory, time per minibatch, speed-up over data parallelism, planner status); --json prints
the plan as JSON instead (the same as Plan.to_json()).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from typing import Any

import networkx as nx

from pdcompile.cli.common import add_cluster_option, load_cluster, load_factory
from pdcompile.errors import PdcompileError
from pdcompile.planner import PLANNERS


def register(subparsers: Any) -> None:
    """Add the `plan` parser."""
    parser = subparsers.add_parser(
        "plan", help="partition a model or profile into (replicated) pipeline stages",
        description=__doc__, formatter_class=_Formatter)
    parser.add_argument("model", nargs="?",
                        help="path/to/file.py:factory returning (model, example inputs)")
    parser.add_argument("--profile",
                        help="a PipeDream graph.txt (or its folder) instead of a model")
    parser.add_argument("--costgraph", help="a CostGraph JSON file instead of a model")
    add_cluster_option(parser, default="A")
    parser.add_argument("--planner", default="auto", choices=PLANNERS,
                        help="dp: PipeDream's dynamic program; ilp: the DP then the exact CP-SAT "
                        "model; auto: CP-SAT too when the graph is small (default)")
    parser.add_argument("--cost-model", default="native", choices=("native", "pipedream"),
                        help="native (default) or pipedream (the original optimizer's model)")
    parser.add_argument("--straight", action="store_true",
                        help="no replication: one worker per stage")
    parser.add_argument("--memory", default=None,
                        help="memory per worker, e.g. 16GiB (default: the cluster's device; the "
                        "pipedream model applies a memory limit only when this is given)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="seconds for CP-SAT (default 10)")
    parser.add_argument("--schedule", default="1f1b",
                        choices=("1f1b", "1f1b-flush", "gpipe", "2bw"),
                        help="the schedule the plan is priced for (memory, bubble)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="microbatches per minibatch for the flush schedules")
    parser.add_argument("--analytic", action="store_true",
                        help="for a MODEL: analytic costs on the cluster's device instead of "
                        "measuring on this machine")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
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

    sources = [x for x in (args.model, args.profile, args.costgraph) if x]
    if len(sources) != 1:
        raise PdcompileError("give exactly one of MODEL (file.py:factory), --profile graph.txt "
                             "or --costgraph graph.json")
    cluster = load_cluster(args.cluster)
    graph = _cost_graph(args, cluster)
    with Spinner(f"planning {graph.number_of_nodes()} nodes on {cluster.workers} workers"):
        result = plan(graph, cluster, planner=args.planner, cost_model=args.cost_model,
                      straight=args.straight, memory=args.memory, time_limit=args.time_limit,
                      schedule=args.schedule, microbatches=args.microbatches)
    if args.json:
        print(result.to_json())
    else:
        print(f"{graph.graph.get('name') or 'model'} on {cluster.describe()}")
        print(result.summary())
    return 0


def _cost_graph(args: argparse.Namespace, cluster: Any) -> nx.DiGraph:
    if args.profile:
        from pdcompile.profiles import load_pipedream

        return load_pipedream(args.profile)
    if args.costgraph:
        from pdcompile.costgraph import load

        return load(args.costgraph)
    import torch

    torch.set_num_threads(1)
    from pdcompile.passes.cost import annotate_costs, to_cost_graph
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.passes.trace import trace

    model, inputs = load_factory(args.model)
    gm = trace(model)
    annotate_shapes(gm, inputs)
    if args.analytic:
        annotate_costs(gm, inputs, source="analytic", device=cluster.device)
    else:
        annotate_costs(gm, inputs)
    return to_cost_graph(gm, name=args.model)


class Spinner:
    """Progress on stderr once the work has taken more than `delay` seconds: a spinner with the
    elapsed time on a terminal, one line otherwise."""

    def __init__(self, label: str, *, delay: float = 1.0) -> None:
        self.label = label
        self.delay = delay
        self.tty = sys.stderr.isatty()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._shown = False
        self._started = 0.0

    def __enter__(self) -> Spinner:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        if self._shown:
            elapsed = time.perf_counter() - self._started
            start = "\r" if self.tty else ""
            sys.stderr.write(f"{start}{self.label}: done in {elapsed:.1f} s\n")
            sys.stderr.flush()

    def _spin(self) -> None:
        if self._done.wait(self.delay):
            return
        self._shown = True
        if not self.tty:
            sys.stderr.write(f"{self.label} ...\n")
            sys.stderr.flush()
            return
        for char in itertools.cycle("|/-\\"):
            elapsed = time.perf_counter() - self._started
            sys.stderr.write(f"\r{self.label} {char} {elapsed:.0f} s")
            sys.stderr.flush()
            if self._done.wait(0.2):
                return
