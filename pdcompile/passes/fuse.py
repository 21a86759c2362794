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
(`split_weight_gradients`): the runtime then defers the weight gradients of those calls to W,
and of the stage's convolutions, which that split rewrites to `conv_deferrable`
(runtime/conv_grads.py).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx

from pdcompile.passes.inplace import mutated_input
from pdcompile.passes.module_hooks import module_hooks
from pdcompile.runtime.conv_grads import conv_deferrable
from pdcompile.runtime.linear_grads import linear_accumulate


def fusable_linears(gm: fx.GraphModule) -> list[fx.Node]:
    """The `nn.Linear` calls of `gm` that `fuse_grad_accumulation` rewrites: each owns its
    parameters, which the graph reads nowhere else, and no user changes its output in place.
    Their weight gradients are the work the runtime can defer (the cost pass prices it: W)."""
    return _owning_calls(gm, (torch.nn.Linear,))


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


_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def deferrable_convs(gm: fx.GraphModule) -> list[fx.Node]:
    """The Conv1d/2d/3d calls of `gm` whose weight gradients the B/W split can defer
    (runtime/conv_grads.py): zero padding given in numbers (not "same"), one input, parameters
    of their own that the graph reads nowhere else, an output nobody changes in place."""
    return [node for node in _owning_calls(gm, _CONVS)
            if gm.get_submodule(str(node.target)).padding_mode == "zeros"
            and not isinstance(gm.get_submodule(str(node.target)).padding, str)]


def _owning_calls(gm: fx.GraphModule, kinds: tuple[type, ...]) -> list[fx.Node]:
    """Calls of submodules of exactly one of `kinds` (subclasses may change forward) on one
    input, each owning its weight and bias, which the graph reads nowhere else, whose output
    no user changes in place, and without hooks of its own (passes/module_hooks.py)."""
    uses = Counter(id(p) for _name, p in gm.named_parameters(remove_duplicate=False))
    get_attr_uses = Counter(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.kwargs or len(node.args) != 1:
            continue
        module = gm.get_submodule(str(node.target))
        if type(module) not in kinds:
            continue
        own = [module.weight] + ([module.bias] if module.bias is not None else [])
        if any(uses[id(p)] != 1 for p in own):
            continue  # shared with another module of the stage: left to autograd
        if any(get_attr_uses[f"{node.target}.{n}"] for n in ("weight", "bias")):
            continue  # the graph also reads the parameter directly
        if any(mutated_input(user, gm) is node for user in node.users):
            continue  # changed in place: autograd forbids it on a custom Function's output view
        if module_hooks(module):
            continue  # hooks run by the module's call, which a rewritten call would skip
        out.append(node)
    return out


def split_weight_gradients(gm: fx.GraphModule) -> int:
    """The B/W split pass: every Linear call of `gm` that owns its parameters becomes one whose
    weight gradient can wait for W (`deferring_weight_grads`), idempotent after
    `fuse_grad_accumulation`, which makes the same calls; so does every convolution of
    `deferrable_convs` (`conv_deferrable`). Returns how many calls can defer."""
    fuse_grad_accumulation(gm)
    convs = deferrable_convs(gm)
    for node in convs:
        module = gm.get_submodule(str(node.target))
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None \
                else None
            call = gm.graph.call_function(conv_deferrable, (
                node.args[0], weight, bias, tuple(module.stride), tuple(module.padding),
                tuple(module.dilation), module.groups))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    if convs:
        gm.graph.lint()
        gm.recompile()
    return sum(1 for node in gm.graph.nodes if node.op == "call_function"
               and node.target in (linear_accumulate, conv_deferrable))


__all__ = ["conv_deferrable", "deferrable_convs", "fusable_linears", "fuse_grad_accumulation",
           "linear_accumulate", "split_weight_gradients"]
