"""A module's structure as JSON, rebuilt without pickle: for the submodules an export cannot
write as Python source (user leaf modules, containers) and for loss modules.

A record holds the module's class (by import path), its plain attributes (numbers, strings,
tuples, dtypes, functions by import path, small tensors; lists of its own weights or of weak
references to them, an RNN's, by the weights' names), the shapes of its parameters and
buffers (their values travel in the stage's safetensors file, or inline with `values=True`)
and its children's records. `rebuild_module` imports the class, makes an instance without
calling its constructor (whose arguments are unknown), and puts those attributes back, which
is what pickle does for a module, minus running whatever code a file names.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch
from torch.nn.utils import parametrize

from pdcompile.errors import PipelineInputError
from pdcompile.export.import_paths import NotReferable, find, import_path
from pdcompile.runtime.tensor_tree import TreeEncodeError, decode, dtype_name, dtype_of, encode

# attributes every nn.Module has (set by nn.Module.__init__): not recorded, except `training`
_BASE = frozenset(torch.nn.Module().__dict__)


def record_module(module: torch.nn.Module, *, values: bool = False,
                  tensors: dict[str, torch.Tensor] | None = None, where: str = "module"
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The record of `module` and the tensors it refers to (none when `tensors` is None: then
    tensors are written inline). `values`: also record parameter and buffer values.
    Raises PipelineInputError naming the submodule and the attribute that has no such form."""
    sink = tensors
    culprit = f"{where} ({type(module).__name__})"
    if isinstance(module, torch.fx.GraphModule) and type(module) is not torch.fx.GraphModule:
        raise PipelineInputError(f"cannot export {culprit}: it is a region torch.export keeps "
                                 "as a graph of its own (a torch.autocast block in the model's "
                                 "forward, say), which an export cannot write yet; move the "
                                 "autocast outside forward to export, or train the pipeline "
                                 "in this process")
    try:  # a parametrized layer's class is made at run time: record the layer it was made from
        cls = import_path(parametrize.type_before_parametrizations(module))
    except NotReferable as err:
        raise PipelineInputError(f"cannot export {culprit}: its class has no import path "
                                 f"({err}); define it at module level in an importable "
                                 "file") from None
    for name in _BASE:
        hooks = module.__dict__.get(name)
        if "hook" in name and isinstance(hooks, dict) and any(
                not _parametrization_hook(h) for h in hooks.values()):
            raise PipelineInputError(f"cannot export {culprit}: it has {name.strip('_')} "
                                     "registered (torch.nn.utils.prune registers one), which "
                                     "an export cannot keep; compile with frontend='export', "
                                     "whose graph records what they compute, or remove them")
    attributes: dict[str, Any] = {}
    own = {id(t): n for n, t in [*module._parameters.items(), *module._buffers.items()]
           if t is not None}
    for name, value in module.__dict__.items():
        if name in _BASE:
            continue
        refers = _own_tensors(value, own)
        attributes[name] = {"own": refers} if refers is not None else \
            _attribute(value, sink, f"{where}.{name}", culprit)
    non_persistent = sorted(module._non_persistent_buffers_set)
    record: dict[str, Any] = {
        "class": cls, "training": module.training, "attributes": attributes,
        "parameters": {n: None if p is None else _spec(p, values, sink, p.requires_grad)
                       for n, p in module._parameters.items()},
        "buffers": {n: None if b is None else _spec(b, values, sink, None)
                    for n, b in module._buffers.items()},
        "non_persistent": non_persistent,
        "children": {n: None if c is None else record_module(
            c, values=values, tensors=sink, where=f"{where}.{n}")[0]
            for n, c in module._modules.items()
            if not (n == "parametrizations" and parametrize.is_parametrized(module))},
    }
    if parametrize.is_parametrized(module):
        record["parametrizations"] = _parametrizations(module, values, sink, where)
    return record, sink if sink is not None else {}


def _parametrizations(module: torch.nn.Module, values: bool,
                      sink: dict[str, torch.Tensor] | None, where: str) -> dict[str, Any]:
    """Per parametrized tensor (weight_norm's, spectral_norm's `weight`): its shape and the
    records of its parametrizations, in order; the originals they hold travel with the layer's
    other tensors (`parametrizations.weight.original0`, ...)."""
    out: dict[str, Any] = {}
    for name, chain in module.parametrizations.items():  # type: ignore[union-attr, operator]
        modes = [(p, p.training) for p in chain.modules()]
        try:  # its shape, without a power iteration moving spectral_norm's vectors
            for p, _ in modes:
                p.training = False
            with torch.no_grad():
                value = getattr(module, name)
        finally:
            for p, mode in modes:
                p.training = mode
        out[name] = {"shape": list(value.shape), "dtype": dtype_name(value.dtype),
                     "unsafe": bool(chain.unsafe),
                     "chain": [record_module(p, values=values, tensors=sink,
                                             where=f"{where}.parametrizations.{name}.{i}")[0]
                               for i, p in enumerate(chain)]}
    return out


def _parametrization_hook(hook: Any) -> bool:
    """torch's own hook on a parametrized layer (weight_norm reads old state dicts with it):
    not the model's, and of no use to a rebuilt layer, whose state dicts are new."""
    function = getattr(hook, "hook", hook)
    return getattr(function, "__module__", "") == "torch.nn.utils.parametrizations"


def _own_tensors(value: Any, own: dict[int, str]) -> dict[str, Any] | None:
    """A list or tuple of the module's own parameters and buffers, of weak references, and of
    Nones (an RNN's `_flat_weights` and `_flat_weight_refs`), as their names; None for any
    other value. A weak reference to anything but the module's own tensors (dead, as a loaded
    RNN's are until its next forward) is kept as a dead one: it tells the RNN that its weights
    changed. Recorded as values, the weights were written twice and a weak reference not at
    all: an nn.LSTM inside a leaf module could not be exported."""
    if not isinstance(value, list | tuple) or not value:
        return None
    names: list[list[Any]] = []
    for item in value:
        target = item() if isinstance(item, weakref.ref) else item
        if isinstance(target, torch.Tensor) and id(target) in own:
            names.append([own[id(target)], isinstance(item, weakref.ref)])
        elif item is None or isinstance(item, weakref.ref):
            names.append([None, item is not None])
        else:
            return None
    if all(name is None and not is_ref for name, is_ref in names):
        return None
    return {"items": names, "tuple": isinstance(value, tuple)}


def _rebuilt_own(entry: dict[str, Any], module: torch.nn.Module) -> list[Any] | tuple[Any, ...]:
    """An `_own_tensors` value made again from the rebuilt module's parameters and buffers (a
    weak reference to each where the module held one; a dead one where it held one to
    nothing of its own)."""
    own = {**module._parameters, **module._buffers}
    items = []
    for name, is_ref in entry["items"]:
        if name is not None and own.get(name) is None:
            raise ValueError(f"a module record names {name!r}, which is no parameter or "
                             f"buffer of its {type(module).__name__}")
        tensor = None if name is None else own[name]
        if is_ref:
            items.append(weakref.ref(tensor if tensor is not None else torch.empty(0)))
        else:
            items.append(tensor)
    return tuple(items) if entry["tuple"] else items


def _attribute(value: Any, sink: dict[str, torch.Tensor] | None, where: str,
               culprit: str) -> dict[str, Any]:
    if isinstance(value, enum.Enum):  # orthogonal's map, say: by its class and member name
        try:
            return {"enum": import_path(type(value)), "member": value.name}
        except NotReferable as err:
            raise PipelineInputError(f"cannot export {culprit}: attribute {where} is a member "
                                     f"of an enum without an import path ({err})") from None
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return {"empty": {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}}
    if callable(value) and not isinstance(value, torch.Tensor | torch.nn.Module):
        try:
            return {"function": import_path(value)}
        except NotReferable as err:
            raise PipelineInputError(f"cannot export {culprit}: attribute {where} is a function "
                                     f"without an import path ({err})") from None
    try:
        return {"value": encode(value, sink, where=where)}
    except TreeEncodeError as err:
        raise PipelineInputError(f"cannot export {culprit}: {err}; keep such attributes out of "
                                 "leaf modules, or let torch.fx trace through the module") \
            from None


def _spec(t: torch.Tensor, values: bool, sink: dict[str, torch.Tensor] | None,
          requires_grad: bool | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
    if requires_grad is not None:
        spec["requires_grad"] = requires_grad
    if values and t.device.type != "meta":
        spec["data"] = encode(t.detach(), sink)
    return spec


def rebuild_module(record: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None, *,
                   device: str | torch.device = "cpu") -> torch.nn.Module:
    """The module a record describes (parameters and buffers left empty unless the record
    holds their values). Raises PipelineInputError if the class cannot be imported."""
    try:
        cls = find(record["class"])
    except (ImportError, AttributeError) as err:
        raise PipelineInputError(f"cannot rebuild a {record['class']!r} module: {err}; install "
                                 "the package that defines it") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise PipelineInputError(f"{record['class']!r} is not a torch.nn.Module class")
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    module.training = bool(record["training"])
    for name, attr in record["attributes"].items():
        if "own" in attr:  # made once the parameters and buffers are in place
            continue
        if "function" in attr:
            value = find(attr["function"])
        elif "enum" in attr:
            value = _member(attr)
        elif "empty" in attr:
            spec = attr["empty"]
            value = torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]), device="meta")
        else:
            value = decode(attr["value"], tensors)
        module.__dict__[name] = value
    for name, spec in record["parameters"].items():
        module._parameters[name] = None if spec is None else torch.nn.Parameter(
            _tensor(spec, tensors, device), requires_grad=bool(spec["requires_grad"]))
    for name, spec in record["buffers"].items():
        module._buffers[name] = None if spec is None else _tensor(spec, tensors, device)
    module._non_persistent_buffers_set = set(record["non_persistent"])
    for name, attr in record["attributes"].items():
        if "own" in attr:
            module.__dict__[name] = _rebuilt_own(attr["own"], module)
    for name, child in record["children"].items():
        module._modules[name] = None if child is None else rebuild_module(child, tensors,
                                                                          device=device)
    for name, entry in record.get("parametrizations", {}).items():
        # a stand-in for the tensor: registering computes the originals from it, and loading
        # the stage's tensors then replaces them with the trained ones
        module._parameters[name] = torch.nn.Parameter(
            torch.zeros(entry["shape"], dtype=dtype_of(entry["dtype"]), device=device))
        for link in entry["chain"]:
            parametrize.register_parametrization(
                module, name, rebuild_module(link, tensors, device=device),
                unsafe=bool(entry["unsafe"]))
    return module


def _member(attr: dict[str, Any]) -> enum.Enum:
    try:
        members = find(attr["enum"])
        return members[attr["member"]]  # type: ignore[no-any-return]
    except (ImportError, AttributeError, KeyError, TypeError) as err:
        raise PipelineInputError(f"cannot rebuild the enum member {attr.get('member')!r} of "
                                 f"{attr.get('enum')!r}: {err}") from None


def _tensor(spec: dict[str, Any], tensors: dict[str, torch.Tensor] | None,
            device: str | torch.device) -> torch.Tensor:
    if "data" in spec:
        return torch.as_tensor(decode(spec["data"], tensors)).clone()
    return torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]), device=device)


__all__ = ["record_module", "rebuild_module"]
