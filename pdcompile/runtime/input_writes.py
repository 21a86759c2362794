"""Which inputs of a stage module only operators that never write them read.

A received activation becomes a leaf that collects its gradient; a stage that writes its input
in place (`ReLU(inplace=True)` as its first layer, or a leaf module doing `x.add_(...)` unseen
by the split pass) must get a copy, since autograd refuses in-place changes of a leaf that
requires grad, so the stage runtime clones every received activation (`StageRuntime._arguments`).
Where the stage's graph feeds an input only to operators known to read it (a Linear layer, a
convolution), the copy is work for nothing: 1 MB a minibatch on the last stage of the benchmark's
asynchronous 1F1B, one for every microbatch and chunk of the interleaved and V schedules
(docs/runtime-profile.md, eighth round). The gradient is the same: a copy's backward hands
the gradient on unchanged.

The test is an allowlist, so anything unknown (a call to a module, whose forward may write its
input; a view, through which a later operator may; a stage that returns the input as it is; a
module with forward hooks, which see its inputs) keeps the copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import fx

from pdcompile.runtime.conv_grads import conv_deferrable
from pdcompile.runtime.linear_grads import linear_accumulate

# functions that read their tensor arguments and return a new tensor (no view, no write)
READS_ONLY: frozenset[Any] = frozenset({
    linear_accumulate, conv_deferrable, F.linear, torch._C._nn.linear, torch.matmul,
    F.conv1d, F.conv2d, F.conv3d})


# layers whose forward reads its input and returns a new tensor, where no hook sees the input
READ_ONLY_LAYERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def read_only_inputs(module: torch.nn.Module) -> frozenset[int]:
    """Positions of `module`'s inputs that no operator of its graph may write or alias: every
    user of the placeholder calls a READS_ONLY function or a READ_ONLY_LAYERS layer (that
    class exactly, without hooks). Empty for a module that is not a GraphModule, or that has
    forward hooks."""
    if not isinstance(module, fx.GraphModule) or _hooked(module):
        return frozenset()
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, node in enumerate(placeholders)
                     if node.users and all(_reads_only(module, user) for user in node.users))


def _reads_only(module: fx.GraphModule, user: fx.Node) -> bool:
    if user.op == "call_function":
        return user.target in READS_ONLY
    if user.op == "call_module":
        layer = module.get_submodule(str(user.target))
        return type(layer) in READ_ONLY_LAYERS and not _hooked(layer)
    return False


def _hooked(layer: torch.nn.Module) -> bool:
    return bool(layer._forward_pre_hooks or layer._forward_hooks)


__all__ = ["READS_ONLY", "READ_ONLY_LAYERS", "read_only_inputs"]
