"""A forward that changes one of its inputs in place (`x.add_(1)`, `x.relu_()`, `x += 1`,
`F.relu(x, inplace=True)`, `x[0] = 0`, or the same on a view of an input), refused.

One process changes the caller's tensor, so a later step given the same tensor sees the change
(and compile's own runs of the model on the example changed the user's example too). A
pipeline changes its own copy of each microbatch (a stage mutates a copy of what it receives),
so the two trained on different inputs from the second step on, silently. Matching one
process would mean sending every changed microbatch back into the caller's tensor from
whichever rank ran it; a change of a copy in the model costs one tensor and says what it means.
"""

from __future__ import annotations

import torch.fx as fx

from pdcompile.errors import TraceError
from pdcompile.passes.inplace import alias_classes, mutated_input


def refuse_input_changes(gm: fx.GraphModule, model_name: str) -> None:
    """Raise a TraceError naming the first operation that changes an input (or a view of one)
    in place and the fix; nothing where none does."""
    aliases = alias_classes(gm)
    for node in gm.graph.nodes:
        changed = mutated_input(node, gm)
        if changed is None:
            continue
        inputs = [n for n in aliases.get(changed, frozenset({changed})) | {changed}
                  if n.op == "placeholder"]
        if not inputs:
            continue
        what = node.target if node.op != "call_function" else getattr(
            node.target, "__name__", str(node.target))
        raise TraceError(
            f"{model_name}.forward changes its input {inputs[0].target!r} in place "
            f"({what!s} in node {node.name!r}): one process changes the caller's tensor, "
            "which a later step given the same tensor sees, while a pipeline changes its own "
            "copy of each microbatch, so the two would train on different inputs; change a "
            "copy instead (x = x + 1 for x += 1, x.relu() for x.relu_(), inplace=False)")


__all__ = ["refuse_input_changes"]
