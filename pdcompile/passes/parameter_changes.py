"""A parameter the forward changes in place is kept by one stage on one worker.

`nn.Embedding(max_norm=...)` (and `nn.EmbeddingBag`) renormalises, in forward and in place, the
rows of its weight that the microbatch looks up. torch.fx keeps such a layer whole (a leaf), so
the change happens in the stage that calls it, on that worker's copy of the weight. Another copy
never sees it: a replica of the stage renormalises only the rows of its own microbatches, and a
stage holding the weight tied (a language model's head tied to its embedding) keeps the rows as
they were. The copies then drift apart while the optimizer steps them alike, silently (the losses
differed from one process from the first minibatch). Such a cut is refused naming the layer.
torch.export's graphs refuse a forward that changes a parameter at capture
(passes/export_frontend.py).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from pdcompile.errors import PlanError
from pdcompile.plan import Plan


def renormalising_layers(gm: fx.GraphModule) -> dict[str, nn.Parameter]:
    """The call_module nodes of `gm` whose layer changes its weight in forward, by node name."""
    found: dict[str, nn.Parameter] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.max_norm is not None:
            found[node.name] = module.weight
    return found


def check_parameter_changes(gm: fx.GraphModule, stage_of: dict[str, int], plan: Plan) -> None:
    """Raise PlanError where a weight that forward changes in place would have another copy:
    its stage replicated, or the weight (tied) read by another stage too."""
    changed = renormalising_layers(gm)
    if not changed:
        return
    for name, weight in changed.items():
        stage = stage_of[name]
        readers = sorted({stage_of[n.name] for n in gm.graph.nodes if n.name in stage_of
                          and any(p is weight for p in _parameters_read(gm, n))} - {stage})
        layer = f"layer {name!r} (stage {stage}, {_kind(gm, name)} with max_norm)"
        if readers:
            raise PlanError(
                f"{layer} renormalises rows of its weight in place in forward, and the weight "
                f"is tied to stage(s) {', '.join(map(str, readers))}, whose copy would never "
                "see the change: cut so that one stage holds every reader of the weight, or "
                "drop max_norm")
        replicas = plan.stages[stage].replicas
        if replicas > 1:
            raise PlanError(
                f"{layer} renormalises rows of its weight in place in forward; the stage's "
                f"{replicas} replicas would each renormalise only the rows of their own "
                "microbatches and drift apart: give that stage one replica, or drop max_norm")


def _kind(gm: fx.GraphModule, name: str) -> str:
    target = next(str(n.target) for n in gm.graph.nodes if n.name == name)
    return type(gm.get_submodule(target)).__name__


def _parameters_read(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The parameters a node reads: an attribute it fetches, or those of the layer it calls."""
    if node.op == "get_attr":
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return [value] if isinstance(value, nn.Parameter) else []
    if node.op == "call_module":
        return list(gm.get_submodule(str(node.target)).parameters())
    return []


__all__ = ["check_parameter_changes", "renormalising_layers"]
