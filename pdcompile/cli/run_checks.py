"""The checks `pdcompile run` makes before any worker starts, each refusal one line.

The workers would find each of these too, but only after seconds of start-up, and every rank
would repeat it: the options (`--steps`, `--checkpoint-every`, `--checkpoint-dir`, the run
folder), the data (`--data` gives at least one minibatch, and the first fits the pipeline: its
inputs, its target's type and length) and the checkpoints (`--steps` asks for no fewer
minibatches than the newest checkpoint already holds).
"""

from __future__ import annotations

import argparse
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
    for option, value in (("--checkpoint-dir", args.checkpoint_dir),
                          ("--run-dir", getattr(args, "run_dir", None))):
        if value and Path(value).exists() and not Path(value).is_dir():
            raise PdcompileError(f"{option} {value} is a file; name a folder (it is created "
                                 "if missing)")


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
