"""Fused weight-gradient accumulation: a stage's Linear calls become `linear_accumulate`, whose
backward adds dW into `weight.grad` (runtime/linear_grads.py).

A pipeline that cuts a minibatch into microbatches accumulates every weight gradient once per
microbatch. Plain autograd computes each microbatch's dW = gy^T x into a fresh tensor and then
adds it to `.grad`: for a 1024 x 1024 layer and 32-row microbatches that is 8 MiB of extra
memory traffic per layer and microbatch, about as much as the product itself moves. The fused
backward does it in one `addmm_`. On this project's 2-core CPU the 2-process 1F1B-flush
benchmark (8 microbatches of 32, Linear(1024, 1024) layers) trains 1.20x faster with it
(benchmarks/results/runtime.md).

The rewrite is applied to stage modules after the split (`fuse_grad_accumulation`): every
`nn.Linear` submodule call (and `F.linear` on a module's own parameters) becomes
`linear_accumulate(x, weight, bias)`. Submodules and their parameters stay where they were, so
state-dict names, optimizers, checkpoints and `functional_call` with stashed weight versions
work unchanged. The same rewrite is the B/W split of zero-bubble schedules
(`split_weight_gradients`): the runtime then defers the weight gradients of those calls to W.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx

from pdcompile.passes.inplace import mutated_input
from pdcompile.runtime.linear_grads import linear_accumulate


def fusable_linears(gm: fx.GraphModule) -> list[fx.Node]:
    """The `nn.Linear` calls of `gm` that `fuse_grad_accumulation` rewrites: each owns its
    parameters, which the graph reads nowhere else, and no user changes its output in place.
    Their weight gradients are the work the runtime can defer (the cost pass prices it: W)."""
    uses = Counter(id(p) for _name, p in gm.named_parameters(remove_duplicate=False))
    get_attr_uses = Counter(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.kwargs or len(node.args) != 1:
            continue
        module = gm.get_submodule(str(node.target))
        if type(module) is not torch.nn.Linear:
            continue
        own = [module.weight] + ([module.bias] if module.bias is not None else [])
        if any(uses[id(p)] != 1 for p in own):
            continue  # shared with another module of the stage: left to autograd
        if any(get_attr_uses[f"{node.target}.{n}"] for n in ("weight", "bias")):
            continue  # the graph also reads the parameter directly
        if any(mutated_input(user, gm) is node for user in node.users):
            continue  # changed in place: autograd forbids it on a custom Function's output view
        out.append(node)
    return out


def fuse_grad_accumulation(gm: fx.GraphModule) -> int:
    """Rewrite the Linear calls of `gm` in place (module docstring); returns how many."""
    fused = 0
    for node in fusable_linears(gm):
        module = gm.get_submodule(str(node.target))
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None \
                else None
            call = gm.graph.call_function(linear_accumulate, (node.args[0], weight, bias))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def split_weight_gradients(gm: fx.GraphModule) -> int:
    """The B/W split pass: every Linear call of `gm` that owns its parameters becomes one whose
    weight gradient can wait for W (`deferring_weight_grads`); idempotent after
    `fuse_grad_accumulation`, which makes the same calls. Returns how many calls can defer."""
    fuse_grad_accumulation(gm)
    return sum(1 for node in gm.graph.nodes
               if node.op == "call_function" and node.target is linear_accumulate)


__all__ = ["fusable_linears", "fuse_grad_accumulation", "linear_accumulate",
           "split_weight_gradients"]
