"""Trace check: the fx graph's outputs are shaped as the model's own on the example inputs.

torch.fx answers Python's questions about a traced value from its Proxy, not from the value it
stands for: `isinstance(state, tuple)` is False for an LSTM's `(h, c)`, so a forward that asks
it was traced down the other branch (`state[-1]` read `c` where `state[0][-1]` was meant) and
trained another function without a word. The model and its graph each run once on the example
inputs (no gradients, the random state and buffers left as they were); outputs that differ in
their tensors' count, shapes or dtypes are refused in one line (`auto` then takes torch.export,
which runs the forward's Python on tensors). Values are not compared: dropout, and rounding
that depends on the order of operations, differ between two runs of one function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pdcompile.errors import TraceError
from pdcompile.passes.shapes import shape_of


def check_traced_outputs(model: nn.Module, gm: fx.GraphModule, args: Sequence[Any],
                         kwargs: Mapping[str, Any], graph_inputs: Sequence[Any]) -> None:
    """Raise TraceError where `gm` (traced from `model`) outputs other tensors than `model`
    does on the example inputs. Models or inputs on the `meta` device, and forwards that fail
    on their own (the passes after the trace say why), are not checked."""
    tensors = [t for t in (*model.parameters(), *model.buffers(), *_tensors(args),
                           *_tensors(kwargs.values())) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        return
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng():
            try:
                expected = shape_of(model(*args, **kwargs))
                traced = shape_of(gm(*graph_inputs))
            except Exception:
                return  # not this check's to explain
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    if traced != expected:
        raise TraceError(
            f"torch.fx traced {type(model).__name__}.forward to other outputs than it returns on "
            f"the example inputs (traced {_shown(traced)}, the model {_shown(expected)}): the "
            "forward asks Python about a traced value (isinstance, type or len on a tensor or "
            "a tuple of them), which fx answers from a stand-in; use frontend='export' (the "
            "default 'auto' does) or make that check not depend on the value")


def _tensors(values: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor)]


def _shown(shape: Any) -> str:
    return ", ".join(str(s) for s in shape) or "no tensors"


__all__ = ["check_traced_outputs"]
