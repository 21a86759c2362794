"""Trace pass: a model to a torch.fx GraphModule, with a leaf-module policy and clear errors.

Leaves (kept whole as one `call_module` node): torch.nn's own operators as fx does by default
(Linear, Conv2d, BatchNorm2d, LSTM, MultiheadAttention, TransformerEncoderLayer...), plus
whatever the user names by type or qualified name. torch.nn's containers are traced through:
`nn.Sequential` (as fx does) and the layer stacks `nn.TransformerEncoder`,
`nn.TransformerDecoder` and `nn.Transformer` (through the forwards of `layer_stacks.py`), so
that a pipeline can cut between their layers. A GraphModule is taken as it is (e.g. one made by
transformers' own fx tracer): it is already a graph. A model fx cannot trace ends in one
TraceError that names the module, the source line and the fix, not an fx traceback.

Two things fx alone gets wrong without a word, and the trace mends: operations the forward
runs under `torch.no_grad()` (fx records the operations, not the grad mode) are cut off from
autograd (`runtime.grad_mode.detached` on what enters the region); and an in-place change of a
buffer from constants alone (`self.ema.mul_(0.9)`, `self.steps += 1`), which fx would run once
on the real buffer while tracing and leave out of the graph, is traced again with buffers as
graph values, so that it runs on every forward.
"""

from __future__ import annotations

import inspect
import linecache
import operator
import os
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pdcompile.errors import TraceError
from pdcompile.passes.custom_functions import custom_functions_seen
from pdcompile.passes.decorated_forward import named_forward
from pdcompile.passes.layer_stacks import traceable_forward
from pdcompile.passes.module_hooks import module_hooks
from pdcompile.passes.reentrant_checkpoint import reentrant_checkpoints_as_calls
from pdcompile.passes.variadic_inputs import variadic_refusal
from pdcompile.runtime.grad_mode import detached

DEFAULT_LEAVES: tuple[type[nn.Module], ...] = (nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention)

_TORCH_DIR = os.path.dirname(torch.__file__)
_NO_GRAD = "pd.no_grad"  # node.meta key: the operation ran with grad mode off while traced
_THIS_FILE = os.path.abspath(__file__)


class _InPlaceProxy(fx.Proxy):
    """A Proxy that records `x += y` as `operator.iadd` (in place on a tensor, as eager runs
    it). fx's own Proxy has no `__iadd__`, so Python falls back to `x = x + y`, and a reader
    of the old `x` through another name would see the value before the change."""


def _augmented(op: Any) -> Any:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    method.__name__ = f"__{op.__name__}__"
    return method


for _op in (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
            operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
            operator.ilshift, operator.irshift, operator.imatmul):
    setattr(_InPlaceProxy, f"__{_op.__name__}__", _augmented(_op))


def _set_item(self: fx.Proxy, index: Any, value: Any) -> None:
    """`x[i] = v`, and the store that ends `x[i] += v`, recorded as `operator.setitem` (which
    passes/inplace.py makes a change of `x`); fx's Proxy refuses item assignment."""
    self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})


setattr(_InPlaceProxy, "__setitem__", _set_item)  # noqa: B010 - fx.Proxy declares none


class _PolicyTracer(fx.Tracer):
    """fx.Tracer with the leaf policy and a record of the innermost module that failed."""

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)

    def __init__(self, leaf_types: tuple[type[nn.Module], ...], leaf_names: frozenset[str]) -> None:
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_names = leaf_names
        self.failed: tuple[str, nn.Module] | None = None
        self.started = _autocast_state()
        self.autocast: str | None = None  # the first node traced under the model's autocast

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind.startswith("call_") and not torch.is_grad_enabled():
            node.meta[_NO_GRAD] = True  # the trace runs with grad mode on: the model turned it off
        if kind.startswith("call_") and self.autocast is None and _autocast_state() != self.started:
            self.autocast = node.name  # the model's torch.autocast, which a graph cannot hold
        return node

    def create_args_for_root(self, root_fn: Any, is_module: bool,
                             concrete_args: Any = None) -> tuple[Any, list[Any]]:
        # a decorated forward: fx is given the wrapped signature (passes/decorated_forward.py)
        return super().create_args_for_root(named_forward(root_fn), is_module, concrete_args)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self._leaf_types) or module_qualified_name in self._leaf_names:
            return True
        if traceable_forward(m) is not None:
            return False  # a layer stack of torch.nn: traced through its layers
        return bool(super().is_leaf_module(m, module_qualified_name))

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            qualname = self.path_of_module(m)
        except NameError:
            qualname = ""
        backward = [k for k in module_hooks(m) if k.startswith("backward")]
        if backward and qualname and not self.is_leaf_module(m, qualname):
            raise TraceError(f"module {qualname!r} ({type(m).__name__}) has "
                             f"{' and '.join(backward)}, which torch.fx drops when it traces "
                             "through the module (the graph holds its operations, not its "
                             f"call); keep it whole: leaf_modules=[{qualname!r}] (its call then "
                             "runs them), or do their work in forward")
        stack_forward = traceable_forward(m)
        if stack_forward is not None and not self.is_leaf_module(m, qualname):
            forward = stack_forward
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed is None:
                try:
                    qualname = self.path_of_module(m)
                except NameError:
                    qualname = "?"
                self.failed = (qualname, m)
            raise


def trace(
    model: nn.Module,
    *,
    leaf_modules: Iterable[type[nn.Module] | str] = (),
    example_kwargs_names: Sequence[str] | None = None,
    num_positional: int | None = None,
    none_inputs: Sequence[str] = (),
) -> fx.GraphModule:
    """Trace `model` symbolically into a GraphModule (a GraphModule is returned as it is).

    `leaf_modules`: module types or qualified names ("encoder.rnn") to keep as one node, added to
    `DEFAULT_LEAVES`. Inputs: forward parameters without a default are traced as placeholders;
    a parameter with a default is fixed to its default (so `if mask is not None` branches are
    resolved) unless it is named in `example_kwargs_names` or lies among the first
    `num_positional` parameters (pass `len(example_inputs)` when inputs fill defaulted slots).
    `*args` and `**kwargs` parameters receive nothing (inputs are bound to named parameters).
    `none_inputs`: parameters the example gives as None (`forward(x, mask=None)` called with
    `(x, None)`): traced as None, so `if mask is not None` is resolved as it is at run time;
    each keeps its placeholder, unused, so that the inputs are still the ones given.
    Parameters, buffers and tied parameters stay the model's own objects (shared, not copied).
    """
    if isinstance(model, fx.GraphModule):
        return model  # already a graph: tracing it again would trace its generated code
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() takes an nn.Module, got {type(model).__name__}; wrap a "
                         "function in an nn.Module whose forward calls it")
    hooks = module_hooks(model)
    if hooks:  # fx traces `forward`, not the call that runs them
        backward = any(h.startswith("backward") for h in hooks)
        raise TraceError(f"{type(model).__name__} has {' and '.join(hooks)} registered on the "
                         "model itself, which torch.fx does not run (it traces the forward, "
                         "not the call); " + (
                             "register them on a submodule, or do their work in forward or "
                             "in the loss" if backward else
                             "compile with frontend='export' (torch.export runs forward "
                             "hooks), register them on a submodule, or do their work in "
                             "forward"))
    leaf_types: list[type[nn.Module]] = list(DEFAULT_LEAVES)
    leaf_names: set[str] = set()
    for item in leaf_modules:
        if isinstance(item, str):
            try:
                model.get_submodule(item)
            except AttributeError:
                names = [n for n, _ in model.named_modules() if n][:8]
                raise TraceError(f"leaf_modules names {item!r}, which is not a submodule of "
                                 f"{type(model).__name__}; submodules are named like "
                                 f"{', '.join(names) or '(none)'}") from None
            leaf_names.add(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            leaf_types.append(item)
        else:
            raise TraceError(f"leaf_modules takes nn.Module types or qualified names, got "
                             f"{item!r}; e.g. leaf_modules=[nn.LSTM, 'encoder.block0']")
    concrete = _concrete_args(model, example_kwargs_names, num_positional)
    concrete.update(dict.fromkeys(none_inputs))
    tracer = _PolicyTracer(tuple(leaf_types), frozenset(leaf_names))
    with _BuffersKept(model) as kept, custom_functions_seen(
            lambda: next(reversed(tracer.module_stack), "")) as functions:
        graph = _traced(model, tracer, concrete)
        changed = kept.changed()
        if changed:  # fx ran an in-place change of these buffers on the real ones, once
            kept.restore()
            tracer = _PolicyTracer(tuple(leaf_types), frozenset(leaf_names))
            tracer.proxy_buffer_attributes = True  # now the changes are graph operations
            graph = _traced(model, tracer, concrete)
            still = kept.changed()
            if still:
                raise TraceError(f"{type(model).__name__}.forward changes buffer(s) {still} in "
                                 "place in a way the trace cannot record (it ran while "
                                 "tracing, once); change them from a tensor the forward "
                                 "computes, or outside forward")
    if functions.calls:
        name, module = functions.calls[0]
        keep = (f"keep the module that calls it whole: leaf_modules=[{module!r}]" if module else
                "call it from a submodule and keep that whole (leaf_modules=[name])")
        raise TraceError(f"{type(model).__name__}.forward applies the autograd Function {name} "
                         "(a backward of its own), which torch.fx traces as its forward's "
                         f"operations with gradients off, so no gradient would pass it; {keep}, "
                         "whose call then runs it, backward included, or use "
                         "frontend='export', which keeps it as one operator with its backward")
    _cut_off_no_grad(graph)
    _drop_specialized(graph, model, concrete, keep=set(none_inputs))
    gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    # the root's flag only: the leaf modules are the model's own and keep their own modes (a
    # BatchNorm frozen in eval mode inside a training model stays frozen; `gm.train()` would
    # switch it, in the user's model too)
    gm.training = model.training
    return gm


class _BuffersKept:
    """The model's buffers as they were before a trace: which of them the trace changed in
    place (their version counters moved), and what they were (the values and the objects: a
    traced `self.steps += 1` would leave a Proxy where the buffer was)."""

    def __init__(self, model: nn.Module) -> None:
        self._held = [(module, name, b, b.detach().clone())
                      for module in model.modules() for name, b in module._buffers.items()
                      if b is not None]
        paths = {id(m): path for path, m in model.named_modules()}
        self._names = [f"{paths[id(m)]}.{name}".lstrip(".") for m, name, _, _ in self._held]
        self._versions: list[int] = []

    def __enter__(self) -> _BuffersKept:
        self._versions = [b._version for _, _, b, _ in self._held]
        return self

    def changed(self) -> list[str]:
        return [name for name, (_, _, b, _), version
                in zip(self._names, self._held, self._versions, strict=True)
                if b._version != version]

    def restore(self) -> None:
        with torch.no_grad():
            for (module, name, b, value), version in zip(self._held, self._versions,
                                                         strict=True):
                module._buffers[name] = b
                if b._version != version:
                    b.copy_(value)
        self._versions = [b._version for _, _, b, _ in self._held]

    def __exit__(self, *exc: object) -> None:
        self.restore()  # a failed trace may have run a change


def _autocast_state() -> tuple[bool, ...]:
    return tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def _traced(model: nn.Module, tracer: _PolicyTracer,
            concrete: dict[str, Any]) -> fx.Graph:
    """`tracer.trace(model)` with grad mode on (what is off was turned off by the model), its
    failures explained (`_explain`); a forward that turns `torch.autocast` on or off is refused
    (fx records the operations, not their precision: `capture` then takes torch.export, which
    records it)."""
    try:
        with torch.enable_grad(), reentrant_checkpoints_as_calls():
            graph = tracer.trace(model, concrete_args=concrete or None)
    except TraceError:
        raise
    except Exception as err:
        raise _explain(model, tracer, err) from None
    if tracer.autocast is not None:
        raise TraceError(f"{type(model).__name__}.forward runs {tracer.autocast!r} under "
                         "torch.autocast, which torch.fx does not record (the graph would run "
                         "it in the precision around it); use frontend='export' (compile's "
                         "default 'auto' does)")
    return graph


def _cut_off_no_grad(graph: fx.Graph) -> None:
    """Operations traced under the model's `torch.no_grad()` read every value from outside the
    region through `detached`, and the modules called there return detached values: nothing
    computed in the region requires a gradient, as in eager mode, wherever stages are cut."""
    inside = {n for n in graph.nodes if n.meta.get(_NO_GRAD)}
    entries: dict[fx.Node, fx.Node] = {}  # of the region being read: a later region reads a
    # value anew (an in-place change between the two is then seen in order)
    for node in list(graph.nodes):
        if node not in inside:
            if node.op.startswith("call_"):
                entries = {}
            continue
        for source in node.all_input_nodes:
            if source in inside:
                continue
            if source not in entries:
                with graph.inserting_before(node):
                    entries[source] = graph.call_function(detached, (source,))
                inside.add(entries[source])
            node.replace_input_with(source, entries[source])
        if node.op == "call_module":  # its own parameters would carry gradients out
            users = list(node.users)
            with graph.inserting_after(node):
                out = graph.call_function(detached, (node,))
            inside.add(out)
            for user in users:
                user.replace_input_with(node, out)


def _concrete_args(model: nn.Module, kwargs_names: Sequence[str] | None,
                   num_positional: int | None) -> dict[str, Any]:
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return {}
    wanted = set(kwargs_names or ())
    params = list(signature.parameters.values())
    known = {p.name for p in params}
    unknown = wanted - known
    star = next((p for p in params if p.kind == p.VAR_KEYWORD), None)
    if unknown and star is not None:
        raise variadic_refusal(model, star, unknown)
    rest = next((i for i, p in enumerate(params) if p.kind == p.VAR_POSITIONAL), None)
    if rest is not None and 0 < rest < (num_positional or 0):  # inputs past the named ones
        # fx made one placeholder of the tuple, and the pipeline fed it the next input whole:
        # xs[0] read that input's first row, silently
        raise variadic_refusal(model, params[rest], ())
    if unknown:
        raise TraceError(f"example_kwargs_names names {sorted(unknown)}, which "
                         f"{type(model).__name__}.forward does not take (its parameters: "
                         f"{', '.join(p.name for p in params)})")
    concrete: dict[str, Any] = {}
    variadic = [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic and len(variadic) == len(params):
        star = "**" if variadic[-1].kind == variadic[-1].VAR_KEYWORD else "*"
        raise TraceError(f"{type(model).__name__}.forward takes only {star}{variadic[-1].name}; "
                         "torch.fx needs named inputs: write forward(self, x, y, ...) with one "
                         "parameter per input")
    for index, param in enumerate(params):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            concrete[param.name] = () if param.kind == param.VAR_POSITIONAL else {}
            continue
        if param.default is param.empty or param.name in wanted:
            continue
        if num_positional is not None and index < num_positional:
            continue
        concrete[param.name] = param.default
    return concrete


_ASSERTS = {torch._assert, operator.eq, getattr(fx._symbolic_trace, "_assert_is_none", None)}


def _drop_specialized(graph: fx.Graph, model: nn.Module, concrete: dict[str, Any], *,
                      keep: set[str]) -> None:
    """Remove the placeholders fx makes for arguments fixed to their defaults, with the checks
    it hangs on them, so that the graph's inputs are exactly the traced ones (those in `keep`,
    given as None, keep their placeholder without the checks)."""
    if not concrete:
        return
    names = list(inspect.signature(model.forward).parameters)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for name, node in zip(names, placeholders, strict=False):
        if name not in concrete:
            continue
        checks: list[fx.Node] = []
        frontier = [node]
        while frontier:
            current = frontier.pop()
            for user in current.users:
                if user.op == "call_function" and user.target in _ASSERTS and user not in checks:
                    checks.append(user)
                    frontier.append(user)
        if any(u not in checks for c in [node, *checks] for u in c.users):
            continue  # the value is really used: keep the placeholder with its default
        order = {n: i for i, n in enumerate(graph.nodes)}
        for check in sorted(checks, key=order.__getitem__, reverse=True):
            graph.erase_node(check)
        if name in keep:  # named as the forward names it (fx calls it "mask_1")
            with graph.inserting_before(node):
                named = graph.placeholder(name)
            node.replace_all_uses_with(named)
            graph.erase_node(node)
        elif not node.users:
            graph.erase_node(node)
    graph.lint()


def _user_frame(tb: TracebackType | None) -> tuple[str, int] | None:
    """The innermost traceback frame outside torch and this file: the user's line."""
    found: tuple[str, int] | None = None
    while tb is not None:
        raw = tb.tb_frame.f_code.co_filename
        filename = os.path.abspath(raw)
        # generated code (fx's "<eval_with_key>.3") has no file to point at
        if not raw.startswith("<") and not filename.startswith(_TORCH_DIR) \
                and filename != _THIS_FILE:
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _explain(model: nn.Module, tracer: _PolicyTracer, err: Exception) -> TraceError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    frame = _user_frame(err.__traceback__)
    where = ""
    if frame is not None:
        filename, line = frame
        source = linecache.getline(filename, line).strip()
        where = f" at {filename}:{line}" + (f" ({source!r})" if source else "")
    if tracer.failed is not None and tracer.failed[0] not in ("", "?"):
        qualname, module = tracer.failed
        kind = type(module).__name__
        fix = (f"mark it as a leaf so it runs as one opaque node: pdcompile.compile(..., "
               f"leaf_modules=[{qualname!r}]) (or leaf_modules=[{kind}] for every {kind}), "
               "or rewrite the data-dependent code with tensor operations (torch.where)")
        culprit = f"module {qualname!r} ({kind})"
    else:
        fix = ("move the data-dependent part into a submodule and pass it in leaf_modules=, "
               "or rewrite it with tensor operations (torch.where)")
        culprit = f"{type(model).__name__}.forward"
    return TraceError(f"torch.fx cannot trace {culprit}{where}: {reason}. Fix: {fix}")
