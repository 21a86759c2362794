"""`costed_graph`: a model traced, shaped and costed into the planner's CostGraph, in one call.

`compile()`, the `inspect`, `plan`, `simulate` and `export` commands and the demo all profile a
model this way, so they agree on what a node costs: every node timed (or costed analytically)
on a copy, with the caches as the cluster's workers will find them (`cache_flush.caches_for`:
cold where they take turns on too few cores), the random state left as it was. The cost pass
is looked up when called, so a test may wrap `node_costs.annotate_costs`.

A model (not yet a graph) is captured by the front end `compile()` uses (passes/frontend.py), on
inputs given as a tuple or, bound by name, as a dict: the commands traced it with fx alone and
bound nothing, so a factory's `{"input_ids": ids}` reached the model as one positional dict and
`(x, None, 3)` (a None and a number for defaulted parameters) was refused, where `compile()`
and `pdcompile export` take both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import networkx as nx
import torch
import torch.fx as fx

from pdcompile.cost import node_costs
from pdcompile.cost.cache_flush import caches_for
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.device import Device
from pdcompile.passes.frontend import capture
from pdcompile.passes.inplace import make_mutations_explicit
from pdcompile.passes.shapes import annotate_shapes
from pdcompile.runtime.precision import autocast_region
from pdcompile.util.module_copy import copy_module


class Costed(NamedTuple):
    """The costed GraphModule (a copy: every node has "pd.shape" and "pd.cost") and its
    CostGraph."""

    module: fx.GraphModule
    graph: nx.DiGraph


def costed(model: torch.nn.Module, inputs: Sequence[Any] | Mapping[str, Any],
           cluster: Cluster | None = None, *,
           cost: str = "measured", name: str | None = None,
           leaf_modules: Sequence[str] = (), device: Device | Cluster | str | None = None,
           caches: str | None = None, warmup: int = 2, repeats: int = 5, clock: str = "wall",
           progress: bool = False, autocast: str | None = None) -> Costed:
    """Capture `model` as `compile()` does (a GraphModule is copied instead, e.g. one
    `compile()` captured; `inputs` a tuple, or a dict bound by name), run the shapes pass on
    the inputs and cost every node: `cost` "measured" on this machine, with
    `caches` (default: as `cluster`'s workers meet them, warm without a cluster) or "analytic"
    on `device` (`annotate_costs`' default without one). `name`: the CostGraph's (default the
    model's class name). `autocast`: the dtype name the stages will run their forwards in
    (runtime/precision.py): shapes, message sizes and measured times are taken under it."""
    if isinstance(model, fx.GraphModule):
        gm = copy_module(model)
    else:  # as compile() captures it: inputs bound by position or, from a dict, by name
        named = dict(inputs) if isinstance(inputs, Mapping) else None
        captured = capture(model, () if named is not None else tuple(inputs), named,
                           leaf_modules=leaf_modules, autocast=autocast)
        gm, inputs = captured.graph, captured.inputs
    if cost != "measured":
        caches = "warm"
    elif caches is None:
        caches = caches_for(cluster) if cluster is not None else "warm"
    with torch.random.fork_rng(), autocast_region(autocast, gm):
        annotate_shapes(gm, tuple(inputs))
        make_mutations_explicit(gm)  # the planner sees in-place order as the split keeps it
        node_costs.annotate_costs(gm, tuple(inputs), source=cost, device=device, warmup=warmup,
                       repeats=repeats, clock=clock, progress=progress, caches=caches)
    return Costed(gm, node_costs.to_cost_graph(gm, name=name or type(model).__name__))


def costed_graph(model: torch.nn.Module, inputs: Sequence[Any] | Mapping[str, Any],
                 cluster: Cluster | None = None,
                 **options: Any) -> nx.DiGraph:
    """The CostGraph of `model` on `inputs` (`costed`, whose keyword options it takes)."""
    return costed(model, inputs, cluster, **options).graph


__all__ = ["Costed", "costed", "costed_graph"]
