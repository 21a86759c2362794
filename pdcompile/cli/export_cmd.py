"""`pdcompile export MODEL --cluster C --schedule S --out DIR`: compile a model and write it out.

    pdcompile export pdcompile.models.vgg16:factory --cluster local-2 --schedule 1f1b --out vgg/
    pdcompile export pdcompile/models/democnn.py:factory --stages 1,2,1 --schedule gpipe \\
        --microbatches 4 --out net/

Writes what `Pipeline.export` writes (stage sources and weights, rank loops, plan, schedule,
launch command) and prints the pipeline's summary (--json: the plan and the folder as JSON).
The loss function is the `loss_fn` defined beside the factory, if there is one (otherwise the
model must return its loss); a factory's .py file is copied into the export (user_code/), so
that `pdcompile run` imports its loss_fn from there. Run the folder with `pdcompile run DIR
--nproc N` or torchrun.
Exit status: 0 ok, 1 a user error or bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import torch

from pdcompile.cli.common import (
    Spinner,
    add_cluster_option,
    call_factory,
    check_sgd_options,
    load_cluster,
    read_plan_file,
)
from pdcompile.errors import PdcompileError
from pdcompile.schedule.kinds import KINDS


def register(subparsers: Any) -> None:
    """Add the `export` parser."""
    parser = subparsers.add_parser(
        "export", help="compile a model into a pipeline and write it to a folder",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="path/to/file.py:factory or package.module:factory "
                        "returning (model, example inputs), e.g. pdcompile.models.vgg16:factory")
    add_cluster_option(parser)
    parser.add_argument("--schedule", default="1f1b", choices=tuple(KINDS),
                        help="the pipeline schedule (default 1f1b), e.g. --schedule gpipe")
    parser.add_argument("--microbatches", type=int, default=None, metavar="N",
                        help="microbatches per minibatch (1f1b-flush, gpipe, 2bw); for 1f1b the "
                        "length of the exported stream, e.g. --microbatches 4")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the folder to write, e.g. --out vgg/")
    parser.add_argument("--plan", dest="plan_file", metavar="PLAN.json",
                        help="use this plan (from `pdcompile plan --json`) instead of planning")
    parser.add_argument("--stages", metavar="SPEC",
                        help="skip the planner: a stage count or replicas per stage, cut evenly, "
                        "e.g. --stages 3 or --stages 2,1,1")
    parser.add_argument("--planner", default="auto", choices=("auto", "dp", "ilp"),
                        help="the partitioner (default auto), e.g. --planner dp")
    parser.add_argument("--cost", default="measured", choices=("measured", "analytic"),
                        help="costs measured on this machine (default) or analytic on the "
                        "cluster's device, e.g. --cost analytic")
    parser.add_argument("--cost-model", default="native", choices=("native", "pipedream"),
                        help="the planner's cost model (default native), e.g. --cost-model "
                        "pipedream")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="seconds for CP-SAT (default 10), e.g. --time-limit 30")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="SGD learning rate (default 0.01), e.g. --lr 0.1")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD momentum (default 0), e.g. --momentum 0.9")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="keep plain autograd weight-gradient accumulation in the stages "
                        "(default: Linear layers add dW into .grad in place, faster with "
                        "microbatches)")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                        help="run the stages' forwards and the loss under torch.autocast of "
                        "this dtype (mixed precision; weights stay float32)")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="C",
                        help="scale each minibatch's gradients to a global norm of at most C, "
                        "as torch.nn.utils.clip_grad_norm_ (flush schedules), e.g. 1.0")
    parser.add_argument("--unbatched", default="", metavar="NAMES",
                        help="inputs given whole to every microbatch although their first "
                        "dimension equals the batch size, comma-separated (e.g. "
                        "class_weights); others are cut or not by their sizes")
    parser.add_argument("--batch-dim", default=None, metavar="D",
                        help="the dimension of the inputs that holds the samples, where it is "
                        "not the first: 1 for a sequence-first model fed (seq, batch, ...), "
                        "or per input, comma-separated (e.g. src=1,mask=0)")
    parser.add_argument("--target-batch-dim", type=int, default=None, metavar="D",
                        help="the target's batch dimension (default: --batch-dim's where it "
                        "is one number, else 0)")
    parser.add_argument("--json", action="store_true",
                        help="print the folder, launch command and plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compile and export; prints the summary and where the files went."""
    from pdcompile.api import compile as compile_pipeline

    torch.set_num_threads(1)
    check_sgd_options(args.lr, args.momentum)  # before the factory runs: one line, at once
    module, model, inputs = call_factory(args.model)
    loss_fn = getattr(module, "loss_fn", None)
    # a factory module's make_target gives the export an example target, so that the exported
    # folder trains on synthetic data without --data (as the bundled models do)
    make_target = getattr(module, "make_target", None)
    example_target = make_target(inputs) if callable(make_target) else None
    plan: Any = None
    if args.plan_file:
        plan = read_plan_file(args.plan_file)
    elif args.stages:
        try:
            parts = [int(p) for p in args.stages.split(",")]
        except ValueError:
            raise PdcompileError(f"--stages {args.stages!r}: write a stage count like 3 or "
                                 "replicas per stage like 2,1,1") from None
        if any(p < 1 for p in parts):
            raise PdcompileError(f"--stages {args.stages!r}: counts must be positive")
        plan = parts[0] if len(parts) == 1 else parts
    cluster = load_cluster(args.cluster)
    batch_dim = _batch_dim(args.batch_dim)  # before compiling: a malformed one in one line
    with Spinner("compiling (trace, profile, plan, split)"):
        pipe = compile_pipeline(
            model, cluster, example_inputs=inputs, loss_fn=loss_fn, example_target=example_target,
            optimizer=functools.partial(torch.optim.SGD, lr=args.lr, momentum=args.momentum),
            schedule=args.schedule, microbatches=args.microbatches, planner=args.planner,
            cost=args.cost, cost_model=args.cost_model, time_limit=args.time_limit, plan=plan,
            fuse=args.fuse, autocast=args.autocast, clip_grad_norm=args.clip_grad_norm,
            unbatched=[name for name in args.unbatched.split(",") if name],
            batch_dim=batch_dim, target_batch_dim=args.target_batch_dim)
    pipe.export(args.out)
    command = f"pdcompile run {args.out} --nproc {pipe.plan.workers}"
    if args.json:
        print(json.dumps({"out": str(args.out), "workers": pipe.plan.workers,
                          "command": command, "plan": pipe.plan.to_dict()}, indent=1))
        return 0
    print(pipe.summary())
    print(f"\nwrote {args.out}: stage_<i>.py/.safetensors, rank_<r>.py, plan.json, "
          f"schedule.txt, pipeline.json, launch.sh\nrun it with: {command}")
    return 0


def _batch_dim(text: str | None) -> int | dict[str, int] | None:
    """--batch-dim as compile takes it: one number, or NAME=D pairs."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return int(text)
        return {name.strip(): int(dim) for name, dim in
                (pair.split("=", 1) for pair in text.split(",") if pair)}
    except ValueError:
        raise PdcompileError(f"--batch-dim {text!r}: write one dimension like 1, or one per "
                             "input like src=1,mask=0") from None
