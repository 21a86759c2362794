"""Training branches: operations the fx graph holds only because the model was traced in training
mode (`if self.training and self.aux_logits:` in torchvision's GoogLeNet and Inception).

torch.fx runs the forward's Python once, so a branch on `self.training` is taken as it was at
capture and then fixed in the graph. A compiled pipeline evaluates on the model's own forward;
a loaded export has only the graph, whose evaluation ran the training branch (GoogLeNet's
`evaluate` returned its three training outputs where `model.eval()` returns the logits). The
model is traced again with every module in eval mode (modes restored after); the operations
that trace lacks are recorded with the graph (`meta.set_training_branches`) and exported, and a
loaded pipeline refuses to evaluate naming them. torch.export's graphs are compared the same way
(passes/frontend.py), leaving out in-place updates of buffers (state, not output).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch.fx as fx
from torch import nn


def training_branches(model: nn.Module, traced: fx.GraphModule,
                      retrace: Callable[[], fx.GraphModule]) -> list[str]:
    """The nodes of `traced` (the training-mode graph) whose operation the graph `retrace()`
    makes with every module of `model` in eval mode does not hold, as "node (target)"; empty
    where the forward takes no branch on its modules' mode, or where it cannot be traced in
    eval mode (nothing is claimed then)."""
    if not model.training:
        return []
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        try:
            evaluated = retrace()
        except Exception:  # noqa: BLE001 - a forward fx cannot trace in eval mode: no claim
            return []
    finally:
        for module, mode in modes:
            module.training = mode
    left = Counter(_operation(n) for n in evaluated.graph.nodes)
    found = []
    for node in traced.graph.nodes:
        key = _operation(node)
        if left[key] > 0:
            left[key] -= 1
        elif node.op in ("call_module", "call_function", "call_method") and \
                not _updates_state(node):
            found.append(f"{node.name} ({_target_name(node.target)})")
    return found


def _updates_state(node: fx.Node) -> bool:
    """An in-place change of a buffer the graph reads (BatchNorm's `num_batches_tracked += 1`
    in torch.export's graph): state a training forward moves, which evaluation undoes, not a
    branch of the output."""
    name = _target_name(node.target).split(".")[0]  # "add_.Tensor" (aten), "add_" (a method)
    first = node.args[0] if node.args else None
    return name.endswith("_") and not name.endswith("__") and \
        isinstance(first, fx.Node) and first.op == "get_attr"


def _target_name(target: object) -> str:
    return target if isinstance(target, str) else str(getattr(target, "__name__", target))


def _operation(node: fx.Node) -> tuple[str, str]:
    return node.op, str(node.target)


__all__ = ["training_branches"]
