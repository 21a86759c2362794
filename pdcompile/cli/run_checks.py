"""The checks `pdcompile run` makes before any worker starts, each refusal one line.

The workers would find each of these too, but only after seconds of start-up, and every rank
would repeat it: the options (`--steps`, `--checkpoint-every`, `--checkpoint-dir`, the run
folder), the data (`--data` gives at least one minibatch, and the first fits the pipeline: its
inputs, its target's type and length) and the checkpoints (`--steps` asks for no fewer
minibatches than the newest checkpoint already holds).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pdcompile.errors import PdcompileError


def check_options(args: argparse.Namespace) -> None:
    """The training options, alone and together."""
    if args.steps is not None and args.steps < 0:
        raise PdcompileError(f"--steps must be a non-negative number of minibatches "
                             f"({args.steps} < 0)")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise PdcompileError(f"--checkpoint-every must be a positive number of minibatches "
                             f"({args.checkpoint_every} < 1)")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise PdcompileError("--checkpoint-every needs --checkpoint-dir DIR (the folder to save "
                             "the checkpoints to)")
    _check_launch_options(args)
    for option, value in (("--checkpoint-dir", args.checkpoint_dir),
                          ("--run-dir", getattr(args, "run_dir", None))):
        if value and Path(value).exists() and not Path(value).is_dir():
            raise PdcompileError(f"{option} {value} is a file; name a folder (it is created "
                                 "if missing)")


def _check_launch_options(args: argparse.Namespace) -> None:
    """The numbers the workers and torchrun read. Each of these reached them before: a NaN
    --fault-timeout turned fault detection off (a dead rank hung the run), 0 or a negative one
    stopped it at start-up as "no progress for 0.0 s"; --threads 0, a --seed past torch's range
    and --max-restarts -1 failed in every worker's traceback; a --master-port outside 1-65535
    in a traceback, 0 and a --node-rank past --nnodes in a run that waited forever."""
    timeout = getattr(args, "fault_timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise PdcompileError(f"--fault-timeout {timeout!r}: give the seconds a rank may make no "
                             "progress before the run stops, a finite number > 0, e.g. "
                             "--fault-timeout 60")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise PdcompileError(f"--threads {threads}: give the threads of each worker, 1 or more "
                             "(e.g. --threads 1)")
    seed = getattr(args, "seed", None)
    if seed is not None and not -2**63 <= seed < 2**64:
        raise PdcompileError(f"--seed {seed}: torch takes seeds from -2**63 to 2**64-1; give "
                             "one there, e.g. --seed 0")
    restarts = getattr(args, "max_restarts", 0)
    if restarts is not None and restarts < 0:
        raise PdcompileError(f"--max-restarts {restarts}: give how many times torchrun may "
                             "restart the workers, 0 or more")
    port = getattr(args, "master_port", None)
    if port is not None and not 1 <= port <= 65535:
        raise PdcompileError(f"--master-port {port}: a TCP port is 1 to 65535, e.g. "
                             "--master-port 29500 (leave it out on one machine: a free one "
                             "is chosen)")
    rank = getattr(args, "node_rank", None)
    nodes = _most_nodes(str(getattr(args, "nnodes", "1")))
    if rank is not None and nodes is not None and not 0 <= rank < nodes:
        raise PdcompileError(f"--node-rank {rank}: with --nnodes {args.nnodes} a node's rank is "
                             f"0 to {nodes - 1}")


def _most_nodes(nnodes: str) -> int | None:
    """The most nodes --nnodes allows ('2', or '1:4' for an elastic run); None if unreadable
    (torchrun says why)."""
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        return None


def check_data(export_dir: Path, spec: str) -> None:
    """`--data`: importable, not empty, and its first minibatch one the pipeline can train
    (the data function is called here once, and its first minibatch read)."""
    from pdcompile.api import load
    from pdcompile.worker import load_data

    function = load_data(spec)
    stream = iter(function())
    first = next(stream, None)
    if first is None:
        raise PdcompileError(f"--data {spec} gives no minibatches; its function must return an "
                             "iterable of (inputs, target) pairs with at least one")
    pipe = load(str(export_dir))
    inputs, target = pipe.as_minibatch(first, 0)
    pipe.check_minibatch(0, inputs, target)


def check_resume(export_dir: Path, checkpoint_dir: str | None, steps: int | None,
                 workers: int | None) -> None:
    """`--steps` against the newest checkpoint every rank saved in `checkpoint_dir`."""
    if checkpoint_dir is None or steps is None or workers is None:
        return
    from pdcompile.runtime.checkpoint import Checkpointer

    done = Checkpointer(checkpoint_dir, rank=0, every=1).resume_step(workers)
    if done is not None and steps < done:
        raise PdcompileError(
            f"the checkpoints in {checkpoint_dir} already hold {done} minibatches of "
            f"{export_dir}, and --steps {steps} asks for fewer; pass --steps {done} or more "
            "to train on, or another --checkpoint-dir to start afresh")


__all__ = ["check_data", "check_options", "check_resume"]
