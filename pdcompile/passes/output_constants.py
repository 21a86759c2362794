"""A constant leaf of the model's output (None, a number, a string), and a parameter or buffer
the model returns as it is, is made by the last stage.

A model may return `{"logits": x, "aux": None}`, `(out, None)` (`nn.MultiheadAttention` with
`need_weights=False`) or a tuple with a flag in it; in one process the loss function ignores the
constant or reads past it. The pipeline rebuilds the output from references to stage outputs and
model inputs (passes/split.py, `output_refs`), and a constant is neither, so `split` was refusing
such models. `constants_from_last_stage` replaces each constant leaf of the graph's output with a
node of the last stage that returns it: the last stage returns the constant as one of its
outputs, and the loss function, `evaluate` and an exported pipeline receive the structure the
model returned, constant included, with no change to the runtime or the export format.

A parameter or buffer returned as it is (learnable log variances that weight a multi-task loss,
a temperature, a prior the loss reads) is an attribute read that only the output uses: no stage
ran it, so the split had no stage to return it from (torch.fx's split_module failed on it, and
the planner, which saw the read as a node of its own, made a stage of it alone, which split
refused as a stage with nothing to run). It too is returned by the last stage through an
`output_constant` node, which reads the attribute there: a parameter that earlier stages also
use is then tied across stages (its gradients summed, passes/split.py), as one process sums
the loss's gradient and the forward's.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree

from pdcompile.errors import PlanError

# constants that the generated stage code can write down as literals
_LITERALS = (type(None), bool, int, float, complex, str, bytes)


def output_constant(value: Any) -> Any:
    """`value` itself: the node of the last stage that returns a constant leaf of the output.
    Called from the generated stage code, so it lives at module level."""
    return value


def constants_from_last_stage(gm: fx.GraphModule, stage_of: dict[str, int], last: int) -> None:
    """Replace each leaf of the graph's output that is no node, or an attribute read (a
    parameter or buffer returned as it is), with an `output_constant` node of stage `last`.
    Raises PlanError naming a leaf that is neither a node nor a literal."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    changed = False

    def made(leaf: Any) -> Any:
        nonlocal changed
        if isinstance(leaf, fx.Node) and leaf.op != "get_attr":
            return leaf
        if not isinstance(leaf, (*_LITERALS, fx.Node)):
            raise PlanError(f"the model's output holds {leaf!r} ({type(leaf).__name__}), which "
                            "is neither a tensor, an input nor a literal (None, a number, a "
                            "string); return tensors computed by the model, or literals")
        changed = True
        with gm.graph.inserting_before(out):
            node = gm.graph.call_function(output_constant, (leaf,))
        stage_of[node.name] = last
        return node

    leaves, spec = pytree.tree_flatten(out.args[0])
    leaves = [made(leaf) for leaf in leaves]
    if changed:
        out.args = (pytree.tree_unflatten(leaves, spec),)
        gm.graph.lint()
        gm.recompile()


__all__ = ["constants_from_last_stage", "output_constant"]
