"""Errors raised by the model's own code while pdcompile runs a stage, explained in one line.

A stage runs the model's code on microbatches, which are smaller than the minibatch the model
was written for; BatchNorm, say, refuses a 1-sample microbatch in training. Torch's own error
names neither the stage nor the microbatch size, so the pipeline re-runs the failing stage node
by node to find the operation and reports it with the sizes and the way out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import PipelineInputError


class _Locator(fx.Interpreter):
    """Runs a stage node by node and remembers the node that raised."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.failed: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            if self.failed is None:
                self.failed = n
            raise


def stage_failure(stage: int, module: fx.GraphModule, args: Sequence[Any], error: Exception, *,
                  microbatch: int | None, minibatch: int | None,
                  microbatches: int, fix: str | None = None) -> PipelineInputError:
    """The error to raise when stage `stage` fails on `args` (the caller restores buffers);
    `fix`: the way out where the caller knows the cause (else one from the sizes)."""
    locator = _Locator(module)
    try:
        with torch.no_grad(), torch.random.fork_rng():
            locator.run(*args)
    except Exception:
        pass
    where = ""
    if locator.failed is not None:
        node = locator.failed
        if node.op == "call_module":
            kind = type(module.get_submodule(str(node.target))).__name__
            what = f"module {node.target!r}, {kind}"
        else:
            what = getattr(node.target, "__name__", str(node.target))
        where = f" in node {node.name!r} ({what})"
    reason = (str(error).strip().splitlines() or [""])[0]
    sizes = ""
    known = fix
    fix = "check that the example inputs have the shapes and dtypes the model expects"
    if microbatch is not None and minibatch is not None:
        sizes = (f"; its microbatches hold {microbatch} sample{'s' * (microbatch != 1)} "
                 f"(a minibatch of {minibatch} cut into {microbatches})")
        if microbatch < minibatch:
            fix = ("if the model needs more samples at once (BatchNorm needs 2 in training), "
                   "use larger minibatches or fewer microbatches (microbatches=)")
    fix = known or fix
    return PipelineInputError(f"stage {stage} fails{where}: {type(error).__name__}: {reason}"
                              f"{sizes}; {fix}")


__all__ = ["stage_failure"]
