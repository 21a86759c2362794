"""`pdcompile export MODEL --cluster C --schedule S --out DIR`: compile a model and write it out.

    pdcompile export pdcompile.models.vgg16:factory --cluster local-2 --schedule 1f1b --out vgg/
    pdcompile export examples/net.py:factory --stages 1,2,1 --schedule gpipe --microbatches 4 \\
        --out net/

Writes what `Pipeline.export` writes (stage sources and weights, rank loops, plan, schedule,
launch command) and prints the pipeline's summary. The loss function is the `loss_fn` defined
beside the factory, if there is one (otherwise the model must return its loss).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path
from typing import Any

import torch

from pdcompile.cli.common import add_cluster_option, load_cluster, load_factory
from pdcompile.errors import PdcompileError
from pdcompile.passes.schedule import SCHEDULES
from pdcompile.plan import Plan


def register(subparsers: Any) -> None:
    """Add the `export` parser."""
    parser = subparsers.add_parser(
        "export", help="compile a model into a pipeline and write it to a folder",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="path/to/file.py:factory or package.module:factory "
                        "returning (model, example inputs)")
    add_cluster_option(parser)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per minibatch (1f1b-flush, gpipe, 2bw); for 1f1b the "
                        "length of the exported stream")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--plan", dest="plan_file", help="use this plan.json instead of planning")
    parser.add_argument("--stages", help="skip the planner: a stage count ('3') or replicas per "
                        "stage ('2,1,1'), cut evenly")
    parser.add_argument("--planner", default="auto", choices=("auto", "dp", "ilp"))
    parser.add_argument("--cost", default="measured", choices=("measured", "analytic"))
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    parser.set_defaults(func=run)


def _factory_module(spec: str) -> Any:
    path = spec.rpartition(":")[0]
    if path.endswith(".py"):
        return sys.modules.get(f"pdcompile_user_{Path(path).stem}")
    return importlib.import_module(path)


def run(args: argparse.Namespace) -> int:
    """Compile and export; prints the summary and where the files went."""
    from pdcompile.api import compile as compile_pipeline

    torch.set_num_threads(1)
    model, inputs = load_factory(args.model)
    loss_fn = getattr(_factory_module(args.model), "loss_fn", None)
    plan: Any = None
    if args.plan_file:
        plan = Plan.from_json(Path(args.plan_file).read_text())
    elif args.stages:
        try:
            parts = [int(p) for p in args.stages.split(",")]
        except ValueError:
            raise PdcompileError(f"--stages {args.stages!r}: write a stage count like 3 or "
                                 "replicas per stage like 2,1,1") from None
        plan = parts[0] if len(parts) == 1 else parts
    pipe = compile_pipeline(
        model, load_cluster(args.cluster), example_inputs=inputs, loss_fn=loss_fn,
        optimizer=functools.partial(torch.optim.SGD, lr=args.lr, momentum=args.momentum),
        schedule=args.schedule, microbatches=args.microbatches, planner=args.planner,
        cost=args.cost, plan=plan)
    pipe.export(args.out)
    print(pipe.summary())
    print(f"\nwrote {args.out}: stage_<i>.py/.safetensors, rank_<r>.py, plan.json, "
          f"schedule.txt, pipeline.json, launch.sh\nrun it with: pdcompile run {args.out} "
          f"--nproc {pipe.plan.workers}")
    return 0
