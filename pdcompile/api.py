"""`pdcompile.compile` and `pdcompile.load`: the passes chained into one call.

compile: trace -> shapes -> cost -> plan (or a given plan / stage count) -> split -> Pipeline
(whose schedule is generated, lowered and turned into rank code on first use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import PipelineInputError
from pdcompile.machine.cluster import Cluster
from pdcompile.pipeline import OptimizerFactory, ParamGroups, Pipeline
from pdcompile.plan import Plan
from pdcompile.runtime.microbatch_cut import checked_batch_dims
from pdcompile.schedule.kinds import KINDS, unknown


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
    frontend: str = "auto",
    clip_grad_norm: float | None = None,
    param_groups: ParamGroups | None = None,
    autocast: torch.dtype | str | None = None,
    unbatched: Sequence[str] | str | None = (),
    batch_dim: int | Mapping[str, int] | None = None,
    target_batch_dim: int | None = None,
) -> Pipeline:
    """Compile `model` into a pipeline for `cluster` (see DESIGN.md).

    `plan`: a Plan to use as is (priced on `cluster`'s costs when a cluster is given); `stages`:
    a stage count K (K straight stages, one worker each, balanced by measured or analytic cost:
    the planner's DP restricted to K stages, on `cluster` or local-K; with an interleaved or
    V-shaped schedule, K workers holding two chunks each) or a list of replica
    counts per stage (an even cut into that many stages); otherwise the planner partitions the
    measured (or analytic) costs over `cluster`. `schedule`: one of '1f1b', '1f1b-flush',
    'gpipe', '2bw', or 'auto' (the planner chooses it and its microbatches).
    `microbatches`: microbatches per minibatch for '1f1b-flush', 'gpipe' and '2bw' (None with
    the planner: it chooses); for '1f1b' the length of the exported schedule. `stash=False`
    turns weight stashing off (comparison only); `vertical_sync` makes every stage use stage 0's
    weight version ('1f1b').
    `clip_grad_norm`: scale each minibatch's gradients so that their norm over the whole
    model is at most this, as `torch.nn.utils.clip_grad_norm_` on one process (flush
    schedules; runtime/grad_clip.py).
    `param_groups(name, param)`: the options of the parameter's optimizer param group under
    its name in the model (e.g. `lambda name, p: {"weight_decay": 0.0} if p.ndim < 2 else {}`);
    each stage's `optimizer` factory then gets torch's list of param groups.
    `autocast`: torch.bfloat16 or torch.float16 runs every stage's forward and the loss under
    `torch.autocast` (weights and gradients stay float32), as a one-process loop with
    `with torch.autocast(...): loss = loss_fn(model(x), y)` does; kept in exports.
    `example_target`: the target of the example minibatch (optional; exported with it, so that
    `pdcompile run` can train on the example when no data is given). Without it, the first
    target `step` / `train` receive with a minibatch shaped like `example_inputs` is kept.
    `optimizer` and `loss_fn` may be anything callable (a lambda too); an export records the
    optimizers they made by class and hyper-parameters, and the loss function by import path.
    `fuse`: rewrite the stages' Linear layers so that their backward adds the weight gradient
    straight into `.grad` (passes/fuse.py; faster with microbatches; off: plain autograd).
    `example_inputs` given as a dict binds the model's inputs by name (`step` then takes a dict
    too). `frontend`: "fx" (symbolic tracing), "export" (torch.export) or "auto" (fx, and
    torch.export where fx cannot trace); an `fx.GraphModule` is taken as it is
    (passes/frontend.py).
    Minibatches are cut along the first dimension of the inputs that hold samples: those whose
    first dimension is the batch size (that of the first input tensor); the rest (a 0-d
    temperature, a (seq, seq) mask, (k,) class weights) reach every microbatch whole.
    `unbatched`: names of inputs given whole even where their first dimension equals the batch
    size (k class weights at batch size k; runtime/microbatch_cut.py); kept in exports.
    `batch_dim`: the dimension that holds the samples, where it is not the first: an int for
    every input (1 for a sequence-first model, `nn.TransformerEncoder` or `nn.LSTM` without
    `batch_first` fed `(seq, batch, d)`), or {input name: dimension} (the others: 0). Inputs
    that hold samples are then those whose size along it is the batch size, cut along it into
    microbatches and replicas' shares. `target_batch_dim`: the target's (None: an int
    `batch_dim`, else 0; a seq-first LM's `(seq, batch)` target: 1, class labels `(batch,)`:
    0). Both kept in exports. Without `batch_dim`, where the pipeline cuts minibatches, compile
    runs the model in eval mode on the example's halves and refuses a sequence-first layout
    (rows of dimension 0 mixed, those of dimension 1 apart), naming the input and the fix
    (passes/batch_check.py).
    """
    from pdcompile.passes.frontend import capture, unwrapped
    from pdcompile.passes.fuse import fuse_grad_accumulation
    from pdcompile.passes.inplace import make_mutations_explicit
    from pdcompile.passes.input_devices import check_input_devices
    from pdcompile.passes.shapes import annotate_shapes
    from pdcompile.passes.split import check_plan_nodes, even_plan, split
    from pdcompile.runtime.grad_clip import check_max_norm
    from pdcompile.runtime.precision import autocast_region, check_autocast

    if not isinstance(model, torch.nn.Module):
        raise PipelineInputError(f"compile() takes an nn.Module, got {type(model).__name__}")
    model = unwrapped(model)  # torch.compile's, DataParallel's or DDP's model
    check_max_norm(clip_grad_norm)  # before any tracing or profiling
    _check_callables(loss_fn=loss_fn, optimizer=optimizer, param_groups=param_groups)
    precision = check_autocast(autocast)  # "bfloat16", or None
    if schedule != "auto" and schedule not in KINDS:  # before any tracing or profiling
        raise PipelineInputError(unknown(schedule, auto=True))
    named = dict(example_inputs) if isinstance(example_inputs, Mapping) else None
    inputs = (named,) if named is not None else tuple(example_inputs) \
        if isinstance(example_inputs, tuple | list) else (example_inputs,)
    given = _checked_stages(plan if plan is not None else stages,
                            "plan" if plan is not None else "stages")
    if isinstance(cluster, str):  # before any tracing or profiling
        cluster = Cluster.parse(cluster)
    elif cluster is not None and not isinstance(cluster, Cluster):
        raise PipelineInputError(f"cluster must be a pdcompile.Cluster or a cluster string such "
                                 f"as 'local-2' or '4x4@1e10,1.25e9', not "
                                 f"{type(cluster).__name__} {cluster!r}")
    if cluster is not None:  # one it could not plan for: refused before any profiling
        from pdcompile.planner import check_plannable

        check_plannable(cluster)
    dims = checked_batch_dims(batch_dim, target_batch_dim, None)  # names: after the capture
    check_input_devices(model, () if named is not None else inputs, named)
    captured = capture(model, () if named is not None else inputs, named,
                       leaf_modules=leaf_modules, frontend=frontend, autocast=precision,
                       batch_dim=dims.default)
    gm = captured.graph
    samples = _example_samples(captured.inputs, gm, batch_dim, target_batch_dim, unbatched,
                               example_target)
    buffers = {name: b.clone() for name, b in gm.named_buffers() if b.device.type != "meta"}
    try:  # on fake tensors: what every node outputs, and so what each stage would send
        with torch.random.fork_rng(), autocast_region(precision, gm):
            annotate_shapes(gm, captured.inputs)
    finally:  # the model's code may count batches on its real buffers (BatchNorm)
        for name, b in gm.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    if isinstance(given, Plan):
        # in-place order made explicit first (idempotent; the cost pass and split do it too):
        # a plan names the nodes it adds. A plan of another model, priced, lost its nodes
        make_mutations_explicit(gm)
        check_plan_nodes(gm, given)
        chosen = given
        if cluster is not None:  # priced like a planned one
            chosen = _planned(gm, captured.inputs, cluster, cost=cost, given=given,
                              schedule=schedule, microbatches=microbatches,
                              autocast=precision, samples=samples)
    elif isinstance(given, int) and not isinstance(given, bool):
        if given < 1:
            raise PipelineInputError(f"stages must be a positive integer ({given} < 1)")
        # K straight stages balanced by cost: the planner's DP restricted to K stages
        chosen = _planned(gm, captured.inputs, cluster or Cluster.preset(f"local-{given}"),
                          cost=cost,
                          planner="dp", cost_model=cost_model, schedule=schedule,
                          microbatches=microbatches, stages=given, time_limit=time_limit,
                          autocast=precision, samples=samples)
    elif given is not None and not isinstance(given, bool):
        replicas = [int(r) for r in given]
        chosen = even_plan(gm, len(replicas), replicas=replicas)
    else:
        if cluster is None:
            raise PipelineInputError("compile() needs a cluster to plan for (e.g. "
                                     "Cluster.preset('local-2') or 'local-2'), or plan=/stages=")
        chosen = _planned(gm, captured.inputs, cluster, planner=planner, cost=cost,
                          cost_model=cost_model, schedule=schedule,
                          microbatches=microbatches, time_limit=time_limit,
                          autocast=precision, samples=samples)
    if schedule == "auto":  # the planner's choice; '1f1b' keeps the default stream length
        schedule = chosen.schedule
        microbatches = chosen.microbatches if chosen.microbatches > 1 else None
    parts = split(gm, chosen, model=model)
    if fuse:
        for program in parts.stages:
            fuse_grad_accumulation(program.module)
    pipe = Pipeline(graph=gm, plan=chosen, parts=parts, schedule=schedule,
                    microbatches=microbatches, loss_fn=loss_fn, optimizer=optimizer,
                    stash=stash, vertical_sync=vertical_sync, name=type(model).__name__,
                    example_inputs=inputs, example_target=example_target,
                    model=None if captured.frontend == "given" else model,
                    clip_grad_norm=clip_grad_norm, param_groups=param_groups,
                    autocast=precision, unbatched=unbatched, batch_dim=batch_dim,
                    target_batch_dim=target_batch_dim)
    _check_batch_dim(pipe, inputs)
    return pipe


def _example_samples(values: Sequence[Any], gm: fx.GraphModule, batch_dim: Any,
                     target_batch_dim: Any, unbatched: Any, target: Any) -> int | None:
    """The example's batch size along the batch dimension (the planner's bound on the
    microbatch count), `batch_dim=`, `target_batch_dim=` and `unbatched=` checked against the
    captured inputs and the example target (None: not given)."""
    from pdcompile.runtime.microbatch_cut import (
        batch_size,
        check_dims_held,
        checked_whole,
        inferred_whole,
    )

    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    dims = checked_batch_dims(batch_dim, target_batch_dim, names)
    whole = checked_whole(unbatched, names)
    named = dict(zip(names, values, strict=False))
    check_dims_held(named, whole, dims, target)
    return batch_size(named, whole + inferred_whole(named, whole, dims), dims)


def _check_batch_dim(pipe: Pipeline, inputs: tuple[Any, ...]) -> None:
    """Refuse a sequence-first model where the pipeline would cut its inputs along dimension
    0 without the user having named the batch dimension (passes/batch_check.py)."""
    from pdcompile.passes.batch_check import check_samples_apart

    model = pipe.model
    cuts = pipe.per_minibatch > 1 or any(s.replicas > 1 for s in pipe.plan.stages)
    if model is None or pipe.batch_dims.given or not cuts:
        return
    named = pipe._named(inputs)
    by_name = len(inputs) == 1 and isinstance(inputs[0], Mapping)

    def call(values: Mapping[str, Any]) -> Any:
        if by_name:
            return model(**values)
        return model(*(values[name] for name in pipe.parts.data_inputs))

    check_samples_apart(model, named, call, pipe.whole_inputs)


_CALLABLE_EXAMPLES = {
    "loss_fn": "torch.nn.functional.cross_entropy",
    "optimizer": "lambda params: torch.optim.SGD(params, lr=0.1) (each stage makes its own from "
                 "its parameters)",
    "param_groups": "lambda name, p: {'weight_decay': 0.0} if p.ndim < 2 else {}",
}


def _check_callables(**given: Any) -> None:
    """`loss_fn`, `optimizer` and `param_groups` are functions (or None): an optimizer made
    from the model's parameters, or a loss function's name, was called per stage and failed
    with a raw TypeError deep inside (or blamed the target)."""
    for name, value in given.items():
        if value is not None and not callable(value):
            what = f"an object of type {type(value).__name__}" if not isinstance(value, str) \
                else repr(value)
            raise PipelineInputError(f"{name} must be a function, got {what}; e.g. "
                                     f"{name}={_CALLABLE_EXAMPLES[name]}")


def _checked_stages(given: Any, name: str) -> Any:
    """`plan=` / `stages=` as compile() takes them: a Plan, a stage count, replicas per stage."""
    if given is None or isinstance(given, Plan):
        return given
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    if isinstance(given, (list, tuple)) and given and all(
            isinstance(r, int) and not isinstance(r, bool) for r in given):
        return given
    raise PipelineInputError(f"{name}={given!r}: give a stage count (e.g. {name}=2), replicas "
                             f"per stage (e.g. {name}=[3, 1]: 3 workers on stage 0, 1 on stage "
                             f"1){', or a Plan' if name == 'plan' else ''}")


def _planned(gm: fx.GraphModule, inputs: tuple[Any, ...], cluster: Cluster | str, *,
             cost: str, given: Plan | None = None, schedule: str = "1f1b",
             microbatches: int | None = None, autocast: str | None = None,
             samples: int | None = None, **planning: Any) -> Plan:
    """The planner's Plan for the costed graph (copies of the model are measured, not it), or
    `given` priced on it; a plan already priced on this cluster for this schedule (one the
    planner made) is kept as it is, so a second measurement cannot change its figures."""
    from pdcompile.cost.costed_graph import costed
    from pdcompile.cost.costgraph import grouped
    from pdcompile.passes.buffer_state import buffers_kept_together
    from pdcompile.planner import plan as make_plan
    from pdcompile.planner import price_plan

    if cost not in ("measured", "analytic"):
        raise PipelineInputError(f"cost must be 'measured' or 'analytic', got {cost!r}")
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    if given is not None and given.time_per_minibatch > 0 and \
            given.cluster == cluster.to_dict() and schedule in ("auto", given.schedule) and \
            microbatches in (None, given.microbatches):
        return given
    # profiled as the workers will find their caches (cold when they take turns on cores)
    measured, graph = costed(gm, inputs, cluster, cost=cost, autocast=autocast)
    if samples is not None:  # along the batch dimension (the cost pass reads dimension 0)
        graph.graph["batch_size"] = samples
    if given is not None:
        return price_plan(graph, given, cluster,
                          schedule=None if schedule == "auto" else schedule,
                          microbatches=microbatches)
    kept = buffers_kept_together(gm, graph)  # a changed buffer's nodes: one block each
    if planning.get("stages"):  # K stages of whole layers where the model has enough of them
        return _planned_in_blocks(measured, graph, cluster, kept, schedule=schedule,
                                  microbatches=microbatches, **planning)
    if not kept:
        return make_plan(graph, cluster, schedule=schedule, microbatches=microbatches,
                         **planning)
    coarse, mapping = grouped(graph, [names for _, names in kept])
    return make_plan(coarse, cluster, schedule=schedule, microbatches=microbatches,
                     **planning).expanded(mapping)


# `stages=K` keeps whole layer blocks unless cutting inside them is this much faster
BLOCKS_PREFERRED_WITHIN = 0.1


def _planned_in_blocks(gm: fx.GraphModule, graph: Any, cluster: Cluster,
                       kept: list[tuple[str, list[str]]], **planning: Any) -> Plan:
    """`stages=K`: the planner's K stages on the graph with each numbered layer block (a
    transformer layer, `encoder.layer.3`) fused into one node, so that every cut falls between
    layers, when the model has at least K blocks and they are convex; else on the graph. The
    groups `kept` (a changed buffer's nodes) are fused either way, merged with the blocks they
    share nodes with. Raises PlanError where K exceeds the blocks left to cut between."""
    from pdcompile.cost.costgraph import grouped
    from pdcompile.errors import CostGraphError, PlanError
    from pdcompile.passes.split import layer_block
    from pdcompile.planner import plan as make_plan

    blocks: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        name = layer_block(node) if node.name in graph else None
        if name is not None:
            blocks.setdefault(name, []).append(node.name)
    if len(blocks) >= planning["stages"]:
        try:
            groups = _merged([*blocks.values(), *(names for _, names in kept)], graph) \
                if kept else list(blocks.values())
            coarse, mapping = grouped(graph, groups)
        except CostGraphError:  # a block that is not convex: plan the nodes themselves
            pass
        else:
            if coarse.number_of_nodes() >= planning["stages"]:
                by_blocks = make_plan(coarse, cluster, **planning).expanded(mapping)
                # whole blocks are a preference, not a rule: where they are few and unequal
                # they cannot balance (timm's shvit_s2 in 4 stages: 21.47 ms, an even cut of
                # its nodes 10.67 ms), so the plan of the nodes themselves is priced too, and
                # taken where it is clearly faster
                try:
                    by_nodes = _planned_in_nodes(graph, cluster, kept, **planning)
                except PlanError:
                    return by_blocks
                faster = by_nodes.time_per_minibatch < \
                    by_blocks.time_per_minibatch * (1 - BLOCKS_PREFERRED_WITHIN)
                return by_nodes if faster else by_blocks
    return _planned_in_nodes(graph, cluster, kept, **planning)


def _planned_in_nodes(graph: Any, cluster: Cluster, kept: list[tuple[str, list[str]]],
                      **planning: Any) -> Plan:
    """`stages=K` on the graph's nodes, each changed buffer's nodes (`kept`) fused."""
    from pdcompile.cost.costgraph import grouped
    from pdcompile.planner import plan as make_plan

    if not kept:
        return make_plan(graph, cluster, **planning)
    coarse, mapping = grouped(graph, [names for _, names in kept])
    _check_enough(coarse, graph, kept, planning["stages"])
    return make_plan(coarse, cluster, **planning).expanded(mapping)


def _merged(groups: list[list[str]], graph: Any) -> list[list[str]]:
    """`groups` with those that share a node merged, each made convex in `graph`."""
    from pdcompile.passes.buffer_state import convex_hull

    merged: list[set[str]] = []
    pending = [set(group) for group in groups]
    while pending:  # a hull may reach into another group: merged again until none overlap
        names = pending.pop()
        overlapping = [m for m in merged if m & names]
        if overlapping:
            for other in overlapping:
                merged.remove(other)
                names |= other
            pending.append(convex_hull(graph, names))
        else:
            hull = convex_hull(graph, names)
            (pending if hull != names else merged).append(hull)
    return [sorted(names) for names in merged]


def _check_enough(coarse: Any, graph: Any, kept: list[tuple[str, list[str]]],
                  stages: int) -> None:
    """PlanError where the graph has fewer blocks than `stages` once each changed buffer's
    nodes are one block (the planner's own message would not say why)."""
    from pdcompile.errors import PlanError

    blocks = sum(1 for n, d in coarse.nodes(data=True)  # as the planner counts operations
                 if coarse.in_degree(n) or d["fwd"] or d["bwd"])
    if blocks < stages:
        buffers = ", ".join(label for label, _ in kept)
        raise PlanError(f"the model has {graph.number_of_nodes()} nodes to cut between but the "
                        f"nodes that change or read buffer {buffers} (whose value carries over "
                        f"between microbatches) run in one stage, which leaves {blocks} blocks, "
                        f"too few for {stages} stages; use at most {blocks} stages")


def load(path: str, *, loss_fn: Callable[..., torch.Tensor] | None = None,
         optimizer: OptimizerFactory | None = None, trust: bool = False) -> Pipeline:
    """Read a pipeline written by `Pipeline.export` (see pdcompile.export.read.load_pipeline).
    An export is code that runs here: every file is checked against its manifest first, and
    `trust=True` lets it import modules outside torch, pdcompile and those it recorded."""
    from pdcompile.export.read import load_pipeline

    _check_callables(loss_fn=loss_fn, optimizer=optimizer)
    return load_pipeline(path, loss_fn=loss_fn, optimizer=optimizer, trust=trust)


__all__ = ["compile", "load"]
