"""A symbolic tracer that also records operator calls whose traced arguments sit inside lists.

An exported stage is Python code that `export/read.py` traces back into a graph. Graphs from the
torch.export front end call operators directly (`torch.ops.aten.zeros.default([1, n, 4])`), and
where a dimension is free its size is a traced value inside the list: the operator's own argument
parser rejects it before fx sees the call (fx records an operator call only through a traced
tensor argument). While this tracer runs, such a call is recorded as the graph node it was.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._ops import OpOverload


class OpsTracer(fx.Tracer):
    """fx.Tracer, and an operator call with a traced value nested in its arguments (none at the
    top level, where fx records it already) becomes a `call_function` node of that operator."""

    def trace(self, root: torch.nn.Module | Any, concrete_args: dict[str, Any] | None = None,
              ) -> fx.Graph:
        original = OpOverload.__call__
        tracer = self

        def call(op: OpOverload, /, *args: Any, **kwargs: Any) -> Any:
            top = (*args, *kwargs.values())
            if not any(isinstance(a, fx.Proxy) for a in top) and any(
                    isinstance(leaf, fx.Proxy) for leaf in pytree.tree_leaves((args, kwargs))):
                return tracer.create_proxy("call_function", op, args, kwargs)
            return original(op, *args, **kwargs)

        # as fx patches torch.nn.Module.__call__ while it traces: for this trace only
        OpOverload.__call__ = call  # type: ignore[method-assign]
        try:
            return super().trace(root, concrete_args)
        finally:
            OpOverload.__call__ = original  # type: ignore[method-assign]


__all__ = ["OpsTracer"]
