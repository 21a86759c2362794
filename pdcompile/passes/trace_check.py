"""Whether torch.fx's graph computes what the model computes, on the example inputs.

Symbolic tracing runs the forward's Python on Proxies, and Python that asks a Proxy what it is
takes a branch the real run does not: `h[0] if isinstance(h, tuple) else h` after an `nn.LSTM`
(whose hidden state is the tuple (h, c)) traced to `h[-1]` of the pair, i.e. the cell state of
every layer, and the pipeline then trained that other function silently (its output was
(layers, batch, classes) where the model's is (batch, classes); a loss that broadcasts took it).
torch.export runs the Python on fake tensors and takes the real branch. So the graph and the
model are both run once on the example inputs (no gradients; buffers and the random state put
back), and their outputs compared leaf by leaf in shape and dtype: a difference is reported as
one line naming the first output that differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree


def traced_difference(model: nn.Module, graph: fx.GraphModule, args: Sequence[Any],
                      kwargs: Mapping[str, Any], values: Sequence[Any]) -> str | None:
    """How the graph's output on `values` (its placeholders' example values) differs from the
    model's on `args`/`kwargs`, or None where they agree, or where either cannot be run here
    (meta tensors; a failure the later passes report in their own words)."""
    if _on_meta(model, (args, kwargs)):
        return None
    try:
        want = _run_unchanged(model, lambda: model(*_cloned(args), **_cloned(kwargs)))
        got = _run_unchanged(model, lambda: graph(*_cloned(values)))
    except Exception:  # noqa: BLE001 - the shape pass names a failing node itself
        return None
    return _first_difference(want, got)


def _on_meta(model: nn.Module, inputs: Any) -> bool:
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor))]
    return any(t.is_meta for t in tensors)


def _cloned(tree: Any) -> Any:
    """Inputs a forward may change in place, copied."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _run_unchanged(model: nn.Module, call: Any) -> Any:
    """`call()` without gradients, the model's buffers (BatchNorm's statistics, counters) and
    the random state as they were before it."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            return call()
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])


def _first_difference(want: Any, got: Any) -> str | None:
    want_leaves, got_leaves = pytree.tree_leaves(want), pytree.tree_leaves(got)
    if len(want_leaves) != len(got_leaves):
        return (f"the model returns {len(want_leaves)} value(s) and the traced graph "
                f"{len(got_leaves)}")
    for index, (w, g) in enumerate(zip(want_leaves, got_leaves, strict=True)):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            return f"output {index} is {_described(w)} from the model, {_described(g)} traced"
        if isinstance(w, torch.Tensor) and (w.shape != g.shape or w.dtype != g.dtype):
            return f"output {index} is {_described(w)} from the model, {_described(g)} traced"
    return None


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


__all__ = ["traced_difference"]
