"""`pdcompile.compile` and `pdcompile.load`: the passes chained into one call.

compile: trace -> shapes -> cost -> plan (or a given plan / stage count) -> split -> Pipeline
(whose schedule is generated, lowered and turned into rank code on first use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from pdcompile.cluster import Cluster
from pdcompile.errors import PipelineInputError
from pdcompile.pipeline import OptimizerFactory, Pipeline
from pdcompile.plan import Plan


def compile(  # noqa: A001 - the public name of the one-liner
    model: torch.nn.Module,
    cluster: Cluster | str | None = None,
    *,
    example_inputs: Sequence[Any] | Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = None,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    leaf_modules: Iterable[type[torch.nn.Module] | str] = (),
    planner: str = "auto",
    cost: str = "measured",
    cost_model: str = "native",
    plan: Plan | int | Sequence[int] | None = None,
    stages: int | Sequence[int] | None = None,
    stash: bool = True,
    vertical_sync: bool = False,
    time_limit: float | None = None,
    example_target: Any = None,
    fuse: bool = True,
) -> Pipeline:
    """Compile `model` into a pipeline for `cluster` (see DESIGN.md).

    `plan`: a Plan to use as is; or, like `stages`, a stage count (an even straight cut, one
    worker per stage) or a list of replica counts per stage (an even cut into that many stages);
    otherwise the planner partitions the measured (or analytic) costs over `cluster`.
    `microbatches`: microbatches per minibatch for '1f1b-flush', 'gpipe' and '2bw'; for '1f1b'
    the length of the exported schedule. `stash=False` turns weight stashing off (comparison
    only); `vertical_sync` makes every stage use stage 0's weight version ('1f1b').
    `example_target`: the target of the example minibatch (optional; exported with it, so that
    `pdcompile run` can train on the example when no data is given). Without it, the first
    target `step` / `train` receive with a minibatch shaped like `example_inputs` is kept.
    `optimizer` and `loss_fn` may be anything callable (a lambda too); an export records the
    optimizers they made by class and hyper-parameters, and the loss function by import path.
    `fuse`: rewrite the stages' Linear layers so that their backward adds the weight gradient
    straight into `.grad` (passes/fuse.py; faster with microbatches; off: plain autograd).
    """
    from pdcompile.passes.fuse import fuse_grad_accumulation
    from pdcompile.passes.split import even_plan, split
    from pdcompile.passes.trace import trace

    if not isinstance(model, torch.nn.Module):
        raise PipelineInputError(f"compile() takes an nn.Module, got {type(model).__name__}")
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple | list) \
        else (example_inputs,)
    given = plan if plan is not None else stages
    gm = trace(model, leaf_modules=leaf_modules, num_positional=len(inputs))
    if isinstance(given, Plan):
        chosen = given
    elif isinstance(given, int):
        chosen = even_plan(gm, given)
    elif given is not None:
        replicas = [int(r) for r in given]
        chosen = even_plan(gm, len(replicas), replicas=replicas)
    else:
        chosen = _planned(gm, inputs, cluster, planner=planner, cost=cost,
                          cost_model=cost_model, schedule=schedule,
                          microbatches=microbatches or 1, time_limit=time_limit)
    parts = split(gm, chosen, model=model)
    if fuse:
        for program in parts.stages:
            fuse_grad_accumulation(program.module)
    return Pipeline(graph=gm, plan=chosen, parts=parts, schedule=schedule,
                    microbatches=microbatches, loss_fn=loss_fn, optimizer=optimizer,
                    stash=stash, vertical_sync=vertical_sync, name=type(model).__name__,
                    example_inputs=inputs, example_target=example_target)


def _planned(gm: fx.GraphModule, inputs: tuple[Any, ...], cluster: Cluster | str | None, *,
             planner: str, cost: str, cost_model: str, schedule: str, microbatches: int,
             time_limit: float | None) -> Plan:
    """The planner's Plan for the costed graph (copies of the model are measured, not it)."""
    import copy

    from pdcompile.passes.cache_flush import caches_for
    from pdcompile.passes.cost import annotate_costs, to_cost_graph
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.planner import plan as make_plan

    if cluster is None:
        raise PipelineInputError("compile() needs a cluster to plan for (e.g. "
                                 "Cluster.preset('local-2') or 'local-2'), or plan=/stages=")
    if cost not in ("measured", "analytic"):
        raise PipelineInputError(f"cost must be 'measured' or 'analytic', got {cost!r}")
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    measured = copy.deepcopy(gm)
    with torch.random.fork_rng():
        annotate_shapes(measured, inputs)
        # profiled as the workers will find their caches (cold when they take turns on cores)
        annotate_costs(measured, inputs, source=cost,
                       caches=caches_for(cluster) if cost == "measured" else "warm")
    graph = to_cost_graph(measured, name=type(gm).__name__)
    return make_plan(graph, cluster, planner=planner, cost_model=cost_model, schedule=schedule,
                     microbatches=microbatches, time_limit=time_limit)


def load(path: str, *, loss_fn: Callable[..., torch.Tensor] | None = None,
         optimizer: OptimizerFactory | None = None) -> Pipeline:
    """Read a pipeline written by `Pipeline.export` (see pdcompile.export.load_pipeline)."""
    from pdcompile.export import load_pipeline

    return load_pipeline(path, loss_fn=loss_fn, optimizer=optimizer)


__all__ = ["compile", "load"]
