"""`pdcompile demo`: the whole path on this machine in a few minutes.

    pdcompile demo                          # 2 worker processes, 48 minibatches, ./pdcompile-demo
    pdcompile demo --workers 4 --out /tmp/demo
    pdcompile demo --quick --json           # the reduced setting CI runs; figures as JSON

Profiles a wide MLP (pdcompile.models.demomlp: weights large against their compute, where a
pipeline beats data parallelism) on this CPU, plans it for local-N, prints the plan and why the
planner chose it, trains it on N real processes (torch.distributed, gloo) with a progress line
per few minibatches (a bar on a terminal), writes the predicted and measured timelines (Gantt
PNG/SVG, Chrome trace, timeline JSON) and the drawn plan to --out, prints predicted against
measured time per minibatch, then plans the same model for PipeDream's cluster A and prints the
predicted speed-up over data parallelism. The report is also written to OUT/demo.md.
Exit status: 0 ok, 1 a user error or bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Any

from pdcompile.cli.common import check_sgd_options
from pdcompile.errors import PdcompileError


def register(subparsers: Any) -> None:
    """Add the `demo` parser."""
    parser = subparsers.add_parser(
        "demo", help="profile, plan, train on local processes and compare with the prediction",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, choices=(1, 2, 3, 4),
                        help="worker processes of the local cluster (default 2), e.g. "
                        "--workers 4")
    parser.add_argument("--out", default="pdcompile-demo", metavar="DIR",
                        help="folder for the timelines, pictures and plan (default "
                        "./pdcompile-demo), e.g. --out /tmp/demo")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="minibatches to train (default 48; --quick: 12), e.g. --steps 96")
    parser.add_argument("--quick", action="store_true",
                        help="the reduced setting for CI: 12 small minibatches of a narrower "
                        "model (under a minute)")
    parser.add_argument("--backend", default="distributed", choices=("distributed", "local"),
                        help="distributed: one process per worker over gloo (default); local: "
                        "all workers in this process (the reference semantics)")
    parser.add_argument("--straight", action="store_true",
                        help="ask the planner for a straight pipeline (one worker per stage); "
                        "default: it may replicate stages, data parallelism included")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="Adam learning rate (default 0.0001), e.g. --lr 3e-4")
    parser.add_argument("--timeout", type=float, default=600, metavar="S",
                        help="seconds before the training processes are stopped (default 600)")
    parser.add_argument("--json", action="store_true",
                        help="print only the figures as JSON (the report still goes to "
                        "OUT/demo.md)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report (or its figures as JSON)."""
    from dataclasses import replace

    from pdcompile.demo import DemoSize, run_demo

    check_sgd_options(args.lr)
    size = DemoSize.quick() if args.quick else DemoSize()
    if args.steps is not None:
        if args.steps < 1:
            raise PdcompileError(f"--steps takes a positive number of minibatches, not "
                                 f"{args.steps}")
        size = replace(size, steps=args.steps)
    stream = io.StringIO() if args.json else sys.stdout
    command = " ".join(["pdcompile demo", f"--workers {args.workers}", f"--out {args.out}",
                        *(["--quick"] if args.quick else []),
                        *([f"--steps {args.steps}"] if args.steps is not None else []),
                        *([f"--backend {args.backend}"] if args.backend != "distributed" else []),
                        *(["--straight"] if args.straight else [])])
    result = run_demo(workers=args.workers, out=args.out, size=size, backend=args.backend,
                      stream=stream, timeout=args.timeout, lr=args.lr,
                      straight=args.straight, command=command)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    return 0
