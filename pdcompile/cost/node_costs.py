"""Cost pass: a NodeCost (forward/backward seconds, activation, parameter and kept bytes) on every
node, from one of two sources behind one interface, and the CostGraph the planner reads.

- "measured": each node is run on its own with the inputs it received in a real forward pass,
  timed with CUDA events on a GPU or the wall clock (or the process's CPU time) on a CPU
  (warm-up, repeats, median); with warm caches its forward is then timed again where whole
  forward passes of the model meet it, and that time is kept. Its backward is measured alone:
  autograd of that node alone, from its recorded inputs, with the same requires_grad pattern
  as in the whole model (PipeDream's profiler records per-layer forward and backward times,
  Narayanan et al., SOSP 2019, section 3.1). What timing a node alone adds (one timed call,
  one autograd run, measured on a no-op) is subtracted, so that the node times add up to the
  whole model's time.
- "analytic": FLOPs from torch.utils.flop_counter.FlopCounterMode and bytes moved by every aten
  operation, forward and backward, on a roofline of a device model (max of compute time and
  memory time). Runs on fake tensors, so a model on the `meta` device is costed without memory.

In both, `keep` is what autograd saves for the node's backward (saved_tensors_hooks), parameters
excluded; `params` counts each parameter once, at the first node that uses it. The third source,
PipeDream's own profiles, is `pdcompile.profiles.load_pipedream`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_arg
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from pdcompile.cost.cache_flush import CACHES, CacheFlush, step_bytes
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.neighbours import TrainStep, busy_neighbours, check_count
from pdcompile.cost.timers import STATISTICS, Timer, measure, select_timer
from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.device import DEVICES, Device
from pdcompile.meta import NodeCost, get_cost, get_shape, has_shape, set_cost
from pdcompile.passes.inplace import mutated_input
from pdcompile.passes.shapes import annotate_shapes, bind_inputs
from pdcompile.runtime.allocator import tune_allocator
from pdcompile.util.attr_path import get_path

SOURCES = ("measured", "analytic")
_COMPUTE_OPS = ("call_module", "call_function", "call_method")
_LOWP = ("float16", "bfloat16")


# --------------------------------------------------------------------------------- entry points
def annotate_costs(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    source: str = "measured",
    device: Device | Cluster | str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = False,
    example_kwargs: dict[str, Any] | None = None,
    timer: Timer | None = None,
    clock: str = "wall",
    statistic: str = "median",
    neighbours: int = 0,
    caches: str = "warm",
) -> fx.GraphModule:
    """Write "pd.cost" on every node of `gm` and return it.

    `source`: "measured" (on the device the model and inputs live on: CUDA events on a GPU,
    else the wall clock, or with clock="cpu" this process's CPU time, which other processes on
    a busy machine do not disturb; `timer` overrides the choice; each node's time is the
    `statistic` of `repeats` runs after `warmup`) or "analytic" (on `device`: a Device, a
    Cluster whose device is used, or a device preset name; default v100). Runs the shapes pass
    on the same inputs first.

    `neighbours` (measured costs only): time every node while that many helper processes, one
    torch thread each, run this model's forward and backward on the same inputs in a loop
    (`pdcompile.cost.neighbours`). Workers of a pipeline on one host compute at the same time
    and share its caches and memory bandwidth, so a layer can run slower than in a profile taken
    on an idle machine (5-10% on the development VM; benchmarks/results/simulator.md): on a host
    where each pipeline worker shares the machine with N-1 other busy workers, profile with
    neighbours=N-1, or with min(N, cores)-1 when the workers outnumber the cores: the simulator
    shares the cores among them (`Level.cores`), and neighbours past the core count would count
    the time slicing twice (their wall clock includes it). The model and inputs
    must pickle (each neighbour gets a copy). 0, the default, profiles on an idle machine.

    `caches` (measured costs only): "warm" (default) times each forward inside whole forward
    passes of the model, after the nodes before it (as a stage's forward meets it), and each
    backward alone, right after the previous run, with its weights and inputs in the caches
    (`_forward_in_sequence` says why); "cold" evicts the last-level cache
    before every timed run (`cost/cache_flush.py`: as a pipeline meets a node, after the rest
    of the model and the other workers have used the caches; slower to profile, each flush
    writes a buffer the size of that cache, or of what a training step of the model touches
    where that is smaller). Warm profiles are optimistic for memory-bound
    nodes, cold ones pessimistic.

    Measuring applies `pdcompile.runtime.allocator.tune_allocator()` to this process first
    (glibc keeps freed memory for reuse, as pdcompile's workers run; PDCOMPILE_ALLOCATOR=system
    opts out), so the profile sees the allocator the pipeline will run with.
    """
    if source not in SOURCES:
        raise PdcompileError(f"unknown cost source {source!r}; use one of {', '.join(SOURCES)} "
                             "(PipeDream profiles: pdcompile.profiles.load_pipedream)")
    if repeats < 1 or warmup < 0:
        raise PdcompileError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    check_count(neighbours)
    if caches not in CACHES:
        raise PdcompileError(f"caches={caches!r}: use one of {', '.join(CACHES)} (\"cold\" "
                             "evicts the last-level cache before every timed run)")
    if caches != "warm" and source != "measured":
        raise PdcompileError(f"caches={caches!r} applies to measured costs only; use "
                             "caches='warm' with the analytic source")
    if neighbours and source != "measured":
        raise PdcompileError(f"neighbours={neighbours} applies to measured costs only (the "
                             f"{source} source runs nothing to slow down); use neighbours=0")
    values = bind_inputs(gm, tuple(example_inputs), example_kwargs)
    annotate_shapes(gm, tuple(example_inputs), example_kwargs)  # these inputs' shapes
    owners = param_owners(gm)
    if source == "measured":
        tune_allocator()  # time nodes with the allocator the workers will run with
        timer = timer or select_timer(_device_of(gm, values), clock=clock)
        with busy_neighbours(neighbours, TrainStep(gm, values) if neighbours else None):
            flush = (CacheFlush(_device_of(gm, values), touched=step_bytes(gm, _outputs(gm)))
                     if caches == "cold" else None)
            costs = _measured(gm, values, warmup=warmup, repeats=repeats, progress=progress,
                              timer=timer, statistic=statistic, flush=flush,
                              fallback=lambda: _fallback_device(device, _device_of(gm, values)))
    else:
        costs = _analytic(gm, values, _device_model(device), progress=progress)
    shares = weight_grad_shares(gm, values)
    for node in gm.graph.nodes:
        if node.op == "output":
            set_cost(node, NodeCost(0.0, 0.0, 0.0, 0.0, 0.0, source=source))
            continue
        fwd, bwd, keep, flops_f, flops_b = costs.get(node.name, (0.0, 0.0, 0.0, 0.0, 0.0))
        act = 0.0 if node.op == "get_attr" else float(get_shape(node).nbytes)
        set_cost(node, NodeCost(fwd=fwd, bwd=bwd, act=act, params=float(owners.get(node.name, 0)),
                                keep=keep, flops_fwd=flops_f, flops_bwd=flops_b, source=source,
                                wgrad=shares.get(node.name, 0.0) * bwd))
    return gm


def weight_grad_shares(gm: fx.GraphModule, values: Sequence[Any]) -> dict[str, float]:
    """Per node whose weight gradients the runtime can defer (the Linear calls the fuse pass
    rewrites, `passes.fuse.fusable_linears`, and the convolutions the B/W split rewrites,
    `deferrable_convs`), the part of its backward they take: dW = gy^T x (and db) costs the
    FLOPs of the input gradient gx = gy W (a convolution's dW as many as its gx), so 1/2 where
    the layer's input needs a gradient, all of it where it does not (a model input)."""
    from pdcompile.passes.fuse import deferrable_convs, fusable_linears

    needs: dict[str, bool] = {}
    placeholders = iter(values)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(placeholders, None)
            needs[node.name] = any(isinstance(t, torch.Tensor) and t.requires_grad
                                   for t in tree_leaves(value))
        elif node.op == "get_attr":
            value = get_path(gm, str(node.target))
            needs[node.name] = isinstance(value, torch.Tensor) and value.requires_grad
        else:
            own = node.op == "call_module" and any(
                p.requires_grad for p in gm.get_submodule(str(node.target)).parameters())
            needs[node.name] = own or any(needs.get(a.name, False)
                                          for a in node.all_input_nodes)
    shares = {}
    for node in fusable_linears(gm) + deferrable_convs(gm):
        source = node.args[0]
        shares[node.name] = 0.5 if isinstance(source, fx.Node) and needs[source.name] else 1.0
    return shares


def to_cost_graph(gm: fx.GraphModule, *, name: str = "") -> nx.DiGraph:
    """The CostGraph of a costed GraphModule: one node per fx node (ids are the fx node names;
    placeholders are zero-compute input nodes, those of inputs nothing reads and the output node
    are left out), one edge per use; `ties`: the parameters several nodes read
    (`shared_parameters`), which a plan may put on several stages (cost/ties.py).

    Attribute reads (get_attr: torch.export's weights, tensor constants) are not nodes: the split
    puts them in every stage that uses them, so a plan cannot place them apart; their parameter
    bytes count to their first user (a planner that could place them alone made stages of
    weights with nothing to run). One that only the model's output reads (a parameter returned
    as it is) is returned by the last stage (passes/output_constants.py): no node either."""
    graph = new_cost_graph(name=name or type(gm).__name__, batch_size=None)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    folded: set[str] = set()
    carried: dict[str, float] = {}  # parameter bytes of attribute reads, by their first user
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        folded.add(node.name)
        users = [u for u in node.users if u.op != "output"]
        if users:  # else only the output reads it: the last stage returns it
            first = min(users, key=position.__getitem__)
            carried[first.name] = carried.get(first.name, 0.0) + get_cost(node).params
    for node in gm.graph.nodes:
        if node.op == "output" or node.name in folded:
            continue
        if node.op == "placeholder" and not node.users:
            continue  # an input forward ignores (None in the example): nothing to place
        cost = get_cost(node)
        add_block(graph, node.name, fwd=cost.fwd, bwd=cost.bwd, act=cost.act,
                  params=cost.params + carried.get(node.name, 0.0), keep=cost.keep,
                  label=node_label(gm, node), wgrad=cost.wgrad)
        for source in node.all_input_nodes:
            if source.op != "output" and source.name not in folded:
                graph.add_edge(source.name, node.name)
    ties = shared_parameters(gm, folded)
    if ties:
        graph.graph["ties"] = ties
    # the inputs are the placeholders, not every source without weights (cost.crossing)
    graph.graph["inputs"] = [n.name for n in gm.graph.nodes if n.op == "placeholder"
                             and n.name in graph]
    for node in gm.graph.nodes:
        if node.op == "placeholder" and has_shape(node) and get_shape(node):
            first = get_shape(node)[0]
            if first.shape:
                graph.graph["batch_size"] = first.shape[0]
                graph.graph["input_bytes"] = float(get_shape(node).nbytes)
            break
    return graph


def shared_parameters(gm: fx.GraphModule, folded: set[str]) -> list[dict[str, Any]]:
    """The parameters read by several of the CostGraph's nodes (tied weights: GPT-2's token
    embedding and output head), each `{"bytes": ..., "nodes": [names]}`: a module call reads
    its module's parameters, an attribute read in `folded` (not a node of the CostGraph) is
    read by its users. Where a plan puts those nodes on several stages, the split copies the
    parameter into each and the runtime all-reduces its gradients at every update. The first
    name is the reader whose `params` count the bytes (`param_owners`, an attribute read's
    first user): cost/ties.py `copied_bytes` adds them to the other holders."""
    position = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    readers: dict[int, list[str]] = {}
    sizes: dict[int, float] = {}

    def read(p: torch.Tensor, names: Sequence[str]) -> None:
        sizes[id(p)] = float(p.numel() * p.element_size())
        for name in names:
            if name not in readers.setdefault(id(p), []):
                readers[id(p)].append(name)

    for node in gm.graph.nodes:
        if node.op == "call_module":
            for p in gm.get_submodule(str(node.target)).parameters():
                read(p, [node.name])
        elif node.op == "get_attr":
            value = get_path(gm, str(node.target))
            if isinstance(value, nn.Parameter):
                read(value, sorted((u.name for u in node.users if u.op != "output"),
                                   key=position.__getitem__)
                     if node.name in folded else [node.name])
    return [{"bytes": sizes[key], "nodes": names} for key, names in readers.items()
            if len(names) > 1]


def node_label(gm: fx.GraphModule, node: fx.Node) -> str:
    """What a node is, for tables and pictures: 'Conv2d(3, 64, ...)', 'add', 'input x'."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        text = repr(module).splitlines()[0]
        return text if len(text) <= 60 else text[:57] + "..."
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "placeholder":
        return f"input {node.target}"
    if node.op == "get_attr":
        return f"attr {node.target}"
    return node.op


def param_owners(gm: fx.GraphModule) -> dict[str, int]:
    """Parameter bytes per node name; a parameter used by several nodes (tied weights) belongs
    to the first of them in graph order, so the values sum to the model's parameter bytes."""
    seen: set[int] = set()
    owners: dict[str, int] = {}
    for node in gm.graph.nodes:
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params = list(gm.get_submodule(str(node.target)).parameters())
        elif node.op == "get_attr":
            value = get_path(gm, str(node.target))
            if isinstance(value, nn.Parameter):
                params = [value]
        total = 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        if total:
            owners[node.name] = total
    return owners


def measure_model(model: nn.Module, example_inputs: Sequence[Any], *, warmup: int = 2,
                  repeats: int = 5, example_kwargs: dict[str, Any] | None = None,
                  timer: Timer | None = None, clock: str = "wall",
                  statistic: str = "median") -> tuple[float, float]:
    """Median (forward, backward) seconds of the whole model, as one training step runs it:
    forward with autograd, then backward from all-ones gradients of its float outputs."""
    kwargs = dict(example_kwargs or {})
    tune_allocator()
    timer = timer or select_timer(_device_of(model, example_inputs), clock=clock)
    buffers = _snapshot_buffers(model)

    def forward(_: Any) -> Any:
        return model(*example_inputs, **kwargs)

    def backward(out: Any) -> None:
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    try:
        fwd = measure(timer, forward, warmup=warmup, repeats=repeats, statistic=statistic)
        bwd = measure(timer, backward, setup=lambda: forward(None), warmup=warmup,
                      repeats=repeats, statistic=statistic)
    finally:
        _restore_buffers(model, buffers)
        model.zero_grad(set_to_none=True)
    return fwd, bwd


# --------------------------------------------------------------------------------- helpers
def _device_model(device: Device | Cluster | str | None) -> Device:
    if device is None:
        return DEVICES["v100"]
    if isinstance(device, Cluster):
        return device.device
    if isinstance(device, Device):
        return device
    key = str(device).strip().lower()
    if key not in DEVICES:
        raise PdcompileError(f"unknown device model {device!r} for analytic costs; use one of "
                             f"{', '.join(DEVICES)}, a pdcompile.Device or a Cluster")
    return DEVICES[key]


def _fallback_device(device: Device | Cluster | str | None, where: torch.device) -> Device:
    """The device model that prices nodes the measured pass cannot time: `device` where given,
    else this machine's CPU (measured once, cached) for a model on the CPU."""
    if device is None and where.type == "cpu":
        from pdcompile.machine.local import local_device

        return local_device()
    return _device_model(device)


def _device_of(model: nn.Module, inputs: Sequence[Any]) -> torch.device:
    for p in model.parameters():
        return p.device
    for t in tree_leaves(list(inputs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _snapshot_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()
            if b.device.type != "meta"}


def _restore_buffers(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved:
                b.copy_(saved[name])


def _run_node(gm: fx.GraphModule, node: fx.Node, args: tuple[Any, ...],
              kwargs: dict[str, Any], params: dict[str, torch.Tensor] | None = None) -> Any:
    """Execute one fx node on given argument values (params: replacement module state)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if params is None:
            return module(*args, **kwargs)
        prefix = f"{node.target}."
        local = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        return torch.func.functional_call(module, local, args, kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)  # type: ignore[operator]
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    raise PdcompileError(f"cannot run node {node.name!r} of kind {node.op}")


def _is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether running the node changes one of its inputs (so each timed run gets copies):
    in-place methods, functions and modules, `x += y`, `x[i] = v`, aten overloads such as
    `aten.add_.Tensor` whose schema writes an argument, and `out=` calls. (An index tensor
    that T5's `aten.add_.Tensor` grew on every timed run sent a later embedding out of range.)"""
    if mutated_input(node, gm) is not None or "out" in node.kwargs:
        return True
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in target._schema.arguments)
    return False


@contextlib.contextmanager
def _saved_bytes(exclude: set[int], total: list[int]) -> Iterator[None]:
    """Add to total[0] the bytes of distinct storages autograd saves for backward."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key, size = storage._cdata, storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(t), t.numel() * t.element_size()
        if key not in exclude and key not in seen:
            seen.add(key)
            total[0] += int(size)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _storage_key(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return id(t)


def _grad_outputs(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


class _RecordInterpreter(fx.Interpreter):
    """A forward pass with autograd that keeps every node's output detached, with the
    requires_grad flag it had, so each node can later be re-run alone on exactly its inputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        mutated = mutated_input(n, self.module)
        if mutated is not None and mutated.name in self.values:  # keep the value it read
            self.values[mutated.name] = tree_map(_detach_clone_keep_flag,
                                                 self.values[mutated.name])
        result = super().run_node(n)
        self.values[n.name] = tree_map(_detach_keep_flag, result)
        return result


def _detach_keep_flag(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _detach_clone_keep_flag(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def _fresh(x: Any, clone: bool) -> Any:
    """A new autograd leaf with the same data and requires_grad flag (a clone of it when the
    node works in place, so the recorded value and the leaf stay untouched)."""
    if not isinstance(x, torch.Tensor):
        return x
    leaf = x.detach().requires_grad_(x.requires_grad)
    return leaf.clone() if clone else leaf


def _node_inputs(node: fx.Node, env: dict[str, Any], *, clone: bool) -> tuple[Any, Any]:
    """Fresh (args, kwargs) of a node from recorded values (see `_fresh`)."""
    args = map_arg(node.args, lambda a: tree_map(lambda v: _fresh(v, clone), env[a.name]))
    kwargs = map_arg(node.kwargs, lambda a: tree_map(lambda v: _fresh(v, clone), env[a.name]))
    return args, kwargs


def _progress(items: list[fx.Node], enabled: bool, desc: str) -> Any:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="node", leave=False)


# --------------------------------------------------------------------------------- measured
def _overheads(timer: Timer, device: torch.device, *, warmup: int, repeats: int,
               statistic: str) -> tuple[float, float]:
    """What timing one node alone adds that the whole model does not pay per node: the timed
    call itself (forward) and one autograd engine run from fresh leaves (backward), measured on
    an operation that does no work (a view). Subtracted from every node's times, so it is
    measured with at least 3 warm-up runs and 15 repeats whatever the nodes get (a cold first
    autograd run would otherwise be subtracted from everything)."""
    leaf = torch.ones(1, device=device, requires_grad=True)
    warmup, repeats = max(warmup, 3), max(repeats, 15)

    def setup_b() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return _grad_outputs(leaf.detach().requires_grad_().view_as(leaf))

    fwd = measure(timer, lambda a: a, setup=lambda: leaf, warmup=warmup, repeats=repeats,
                  statistic=statistic)
    bwd = measure(timer, lambda og: torch.autograd.backward(og[0], og[1]), setup=setup_b,
                  warmup=warmup, repeats=repeats, statistic=statistic)
    return fwd, bwd


def _outputs(gm: fx.GraphModule) -> int:
    """Bytes of every node's output, as the shape pass recorded them."""
    return sum(get_shape(n).nbytes for n in gm.graph.nodes
               if n.op not in ("output", "get_attr") and has_shape(n))


def _then(setup: Callable[[], Any], flush: Callable[[], None] | None) -> Callable[[], Any]:
    """`setup`, followed by a cache flush when one is given (so the timed run starts cold)."""
    if flush is None:
        return setup

    def run() -> Any:
        arg = setup()
        flush()
        return arg
    return run


def _measured(gm: fx.GraphModule, values: list[Any], *, warmup: int, repeats: int,
              progress: bool, timer: Timer, statistic: str, fallback: Callable[[], Device],
              flush: Callable[[], None] | None = None) -> dict[str, tuple[float, ...]]:
    """Every compute node timed alone; a node that cannot be timed gets its analytic cost on
    `fallback()` (with a warning naming it)."""
    buffers = _snapshot_buffers(gm)
    exclude = {_storage_key(t) for t in list(gm.parameters()) + list(gm.buffers())}
    costs: dict[str, tuple[float, ...]] = {}
    guessed: set[str] = set()  # nodes that could not be timed: their analytic cost
    try:
        recorder = _RecordInterpreter(gm)
        recorder.run(*values)
        env = recorder.values
        base_f, base_b = _overheads(timer, _device_of(gm, values), warmup=warmup,
                                    repeats=repeats, statistic=statistic)
        nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS]
        for node in _progress(nodes, progress, "measuring nodes"):
            try:
                costs[node.name] = _measure_node(gm, node, env, exclude, (base_f, base_b),
                                                 warmup=warmup, repeats=repeats, timer=timer,
                                                 statistic=statistic, flush=flush)
            except Exception as err:  # noqa: BLE001 - any op we cannot time gets a formula
                costs[node.name] = _fallback(gm, node, env, exclude, fallback, err)
                guessed.add(node.name)
        if flush is None:  # warm caches: each forward as the model's forward pass meets it
            timed = {n.name for n in nodes} - guessed
            in_sequence = _forward_in_sequence(gm, values, timer, warmup=warmup,
                                               repeats=repeats, statistic=statistic)
            for name, seconds in in_sequence.items():
                if name in timed:
                    costs[name] = (max(seconds - base_f, 0.0),) + costs[name][1:]
    finally:
        _restore_buffers(gm, buffers)
        gm.zero_grad(set_to_none=True)
    return costs


class _TimedPass(fx.Interpreter):
    """A forward pass with autograd that times every compute node where the pass meets it:
    after the nodes before it, with the caches as they left them."""

    def __init__(self, gm: fx.GraphModule, timer: Timer) -> None:
        super().__init__(gm)
        self.timer = timer
        self.seconds: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in _COMPUTE_OPS:
            return super().run_node(n)
        # the interpreter's own work (reading the arguments from its environment, finding the
        # module by its dotted name) stays outside the clock: generated stage code, like the
        # model's forward, pays none of it (about 6 us a node, 15-38% of small models' forwards)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call = _resolved_call(self, n, args)
            result: list[Any] = []
            self.seconds[n.name] = self.timer.time(lambda: result.append(call(args, kwargs)))
        return result[0]


def _resolved_call(interpreter: fx.Interpreter, n: fx.Node,
                   args: tuple[Any, ...]) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """The node's call with its target looked up: the module, the function, or the method of
    its first argument; called with the node's arguments."""
    if n.op == "call_module":
        module = interpreter.fetch_attr(str(n.target))
        return lambda a, k: module(*a, **k)
    if n.op == "call_method":
        method = getattr(args[0], str(n.target))
        return lambda a, k: method(*a[1:], **k)
    target = n.target
    return lambda a, k: target(*a, **k)  # type: ignore[operator]


def _forward_in_sequence(gm: fx.GraphModule, values: list[Any], timer: Timer, *, warmup: int,
                         repeats: int, statistic: str) -> dict[str, float]:
    """Each compute node's forward seconds inside whole forward passes of the model (the
    `statistic` of `repeats` passes after `warmup`; {} where a pass fails).

    Why: timed alone and again and again, a node finds its weights and inputs in the caches the
    previous run left; in a pipeline its stage's forward meets it after the nodes before it,
    whose weights and outputs went through the caches in between. An MLP of 8 x Linear(1024)
    at 64 rows on the development VM: forwards 11-16% slower in sequence than alone, backwards
    within 3% (docs/cost-model.md, "Compute as the runtime spends it"), so forwards are timed
    here and backwards alone."""
    samples: dict[str, list[float]] = {}
    try:
        for i in range(warmup + repeats):
            fresh = tree_map(lambda v: v.detach().clone().requires_grad_(v.requires_grad)
                             if isinstance(v, torch.Tensor) else v, list(values))
            timed = _TimedPass(gm, timer)
            with torch.enable_grad():
                timed.run(*fresh)
            if i >= warmup:
                for name, seconds in timed.seconds.items():
                    samples.setdefault(name, []).append(seconds)
    except Exception:  # noqa: BLE001 - the nodes keep their times alone
        return {}
    pick = STATISTICS[statistic]
    return {name: float(pick(v)) for name, v in samples.items()}


def _measure_node(gm: fx.GraphModule, node: fx.Node, env: dict[str, Any], exclude: set[int],
                  base: tuple[float, float], *, warmup: int, repeats: int, timer: Timer,
                  statistic: str, flush: Callable[[], None] | None) -> tuple[float, ...]:
    """(fwd, bwd, kept bytes, 0, 0) of one node timed alone on its recorded inputs."""
    base_f, base_b = base
    clone = _is_inplace(gm, node)

    def setup(node: fx.Node = node, clone: bool = clone) -> tuple[Any, Any]:
        return _node_inputs(node, env, clone=clone)

    def forward(ak: tuple[Any, Any], node: fx.Node = node) -> Any:
        return _run_node(gm, node, ak[0], ak[1])

    fwd = measure(timer, forward, setup=_then(setup, flush), warmup=warmup,
                  repeats=repeats, statistic=statistic)
    kept = [0]
    with _saved_bytes(exclude, kept):
        out = forward(setup())
    outs, _ = _grad_outputs(out)
    bwd = 0.0
    if outs:
        def setup_b(node: fx.Node = node) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return _grad_outputs(forward(setup(), node))

        bwd = measure(timer, lambda og: torch.autograd.backward(og[0], og[1]),
                      setup=_then(setup_b, flush), warmup=warmup, repeats=repeats,
                      statistic=statistic)
    return (max(fwd - base_f, 0.0), max(bwd - base_b, 0.0), float(kept[0]), 0.0, 0.0)


def _fallback(gm: fx.GraphModule, node: fx.Node, env: dict[str, Any], exclude: set[int],
              device_of: Callable[[], Device], err: Exception) -> tuple[float, ...]:
    """The analytic cost of a node the measured pass cannot time (on the real values it
    received), with one line saying which node and why."""
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    device = device_of()
    warnings.warn(f"cannot time node {node.name!r} ({node_label(gm, node)}): "
                  f"{type(err).__name__}: {reason}; it gets its analytic cost on {device.name}",
                  stacklevel=4)
    args, kwargs = _node_inputs(node, env, clone=_is_inplace(gm, node))
    try:
        _, flops_f, bytes_f, kept, flops_b, bytes_b = _count(gm, node, args, kwargs, None,
                                                             exclude)
    except Exception as again:
        why = (str(again).strip().splitlines() or [type(again).__name__])[0]
        raise PdcompileError(
            f"node {node.name!r} ({node_label(gm, node)}) cannot run on its own on the inputs it "
            f"received ({type(again).__name__}: {why}); mark the module that calls it as a "
            "leaf (leaf_modules=) or use cost='analytic'") from None
    lowp = any(s.dtype in _LOWP for s in get_shape(node)) if has_shape(node) else False
    return (_roofline(flops_f, bytes_f, device, lowp), _roofline(flops_b, bytes_b, device, lowp),
            kept, flops_f, flops_b)


# --------------------------------------------------------------------------------- analytic
class _ByteCounter(TorchDispatchMode):
    """Bytes read and written by every aten operation (views and metadata-only ops move none)."""

    _FREE = {"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze",
             "squeeze", "as_strided", "alias", "slice", "select", "reshape", "lift_fresh",
             "empty", "empty_like", "empty_strided", "new_empty", "sym_size", "sym_stride"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs and getattr(func, "namespace", "aten") == "aten" \
                and not getattr(func, "is_view", False) and name not in self._FREE:
            for t in tree_leaves((args, kwargs or {}, out)):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def _roofline(flops: float, moved: float, device: Device, low_precision: bool) -> float:
    return max(flops / device.peak_flops(low_precision), moved / device.mem_bandwidth)


def _count(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any,
           state: dict[str, torch.Tensor] | None,
           exclude: set[int]) -> tuple[Any, float, float, float, float, float]:
    """Run one node under the FLOP and byte counters, forward then backward:
    (output, flops_fwd, bytes_fwd, kept bytes, flops_bwd, bytes_bwd)."""
    from torch.utils.flop_counter import FlopCounterMode

    if _is_inplace(gm, node):
        args = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)
    kept = [0]
    counter, flops = _ByteCounter(), FlopCounterMode(display=False)
    with _saved_bytes(exclude, kept), flops, counter:
        out = _run_node(gm, node, args, kwargs, state)
    outs, grads = _grad_outputs(out)
    flops_b = bytes_b = 0.0
    if outs:
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  and t.requires_grad]
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if state is None:
                leaves += [p for p in module.parameters() if p.requires_grad]
            else:
                prefix = f"{node.target}."
                leaves += [v for k, v in state.items() if k.startswith(prefix)
                           and v.requires_grad]
        counter_b, flops_bm = _ByteCounter(), FlopCounterMode(display=False)
        if leaves:
            with flops_bm, counter_b:
                torch.autograd.grad(outs, leaves, grads, allow_unused=True)
        flops_b, bytes_b = float(flops_bm.get_total_flops()), float(counter_b.bytes)
    return (out, float(flops.get_total_flops()), float(counter.bytes), float(kept[0]),
            flops_b, bytes_b)


def _analytic(gm: fx.GraphModule, values: list[Any], device: Device, *,
              progress: bool) -> dict[str, tuple[float, ...]]:
    """Count every node on fake tensors. A node fake tensors cannot run (a leaf module whose
    control flow reads tensor values) is counted on the real values it receives instead, when
    the model and inputs are real."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    costs: dict[str, tuple[float, ...]] = {}
    real_env: dict[str, Any] | None = None
    real_exclude = {_storage_key(t) for t in list(gm.parameters()) + list(gm.buffers())}
    with mode:
        state: dict[str, torch.Tensor] = {}
        for name, p in gm.named_parameters():
            state[name] = mode.from_tensor(p).requires_grad_(p.requires_grad)
        for name, b in gm.named_buffers():
            state[name] = mode.from_tensor(b)
        exclude = {_storage_key(t) for t in state.values()}
        env: dict[str, Any] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, values, strict=True):
            env[node.name] = tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, value)
        nodes = [n for n in gm.graph.nodes if n.op in ("get_attr",) + _COMPUTE_OPS]
        for node in _progress(nodes, progress, "costing nodes"):
            if node.op == "get_attr":
                target = str(node.target)
                value = state.get(target)
                if value is None:
                    raw = get_path(gm, target)
                    value = mode.from_tensor(raw) if isinstance(raw, torch.Tensor) else raw
                env[node.name] = value
                continue
            args = map_arg(node.args, lambda a: env[a.name])
            kwargs = map_arg(node.kwargs, lambda a: env[a.name])
            try:
                out, flops_f, bytes_f, kept, flops_b, bytes_b = _count(
                    gm, node, args, kwargs, state, exclude)
            except Exception as err:
                with unset_fake_temporarily():
                    if real_env is None:
                        real_env = _real_values(gm, values, node, err)
                    rargs, rkwargs = _node_inputs(node, real_env,
                                                  clone=_is_inplace(gm, node))
                    real_out, flops_f, bytes_f, kept, flops_b, bytes_b = _count(
                        gm, node, rargs, rkwargs, None, real_exclude)
                out = tree_map(lambda v: mode.from_tensor(v.detach()).requires_grad_(
                    v.requires_grad) if isinstance(v, torch.Tensor) else v, real_out)
            lowp = any(s.dtype in _LOWP for s in get_shape(node))
            fwd = _roofline(flops_f, bytes_f, device, lowp)
            bwd = _roofline(flops_b, bytes_b, device, lowp)
            costs[node.name] = (fwd, bwd, kept, flops_f, flops_b)
            env[node.name] = tree_map(_detach_keep_flag, out)
    return costs


def _real_values(gm: fx.GraphModule, values: list[Any], node: fx.Node,
                 err: Exception) -> dict[str, Any]:
    """Every node's real output, for nodes that fake tensors cannot run."""
    on_meta = any(t.device.type == "meta" for t in list(gm.parameters()) + [
        v for v in tree_leaves(values) if isinstance(v, torch.Tensor)])
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if on_meta:
        raise PdcompileError(
            f"node {node.name!r} ({node_label(gm, node)}) cannot be costed on meta tensors: "
            f"{reason}; its result depends on tensor values, so build the model on a real "
            "device or make that part shape-only") from None
    recorder = _RecordInterpreter(gm)
    buffers = _snapshot_buffers(gm)
    try:
        recorder.run(*values)
    finally:
        _restore_buffers(gm, buffers)
    return recorder.values


def total_cost(gm: fx.GraphModule) -> NodeCost:
    """Sums of every node's cost (params counted once by construction)."""
    items = [get_cost(n) for n in gm.graph.nodes if n.op != "output"]
    return NodeCost(fwd=sum(c.fwd for c in items), bwd=sum(c.bwd for c in items),
                    act=sum(c.act for c in items), params=sum(c.params for c in items),
                    keep=sum(c.keep for c in items), flops_fwd=sum(c.flops_fwd for c in items),
                    flops_bwd=sum(c.flops_bwd for c in items),
                    source=items[0].source if items else "")
