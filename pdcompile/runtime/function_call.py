"""A model's own `torch.autograd.Function` as one operator, `pdcompile::function_call`, so that
torch.export keeps its backward.

torch.export records a Function's forward as its operations and differentiates those, which
drops the backward the Function defines (a gradient reversal passed the gradient unreversed).
The export front end routes such a call through this operator instead: the graph holds one
node naming the Function by import path ("module:Qualified.Name"), whose forward runs the
Function's forward and whose backward runs the Function's own backward (by running it again
with gradients on: the forward is computed twice, the gradient is the Function's).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

OPERATOR = "pdcompile::function_call"
_APPLY = torch.autograd.Function.__dict__["apply"].__func__  # before anyone patches it


def import_path(function: type) -> str | None:
    """"module:Qualified.Name" of a Function class that importing its module finds again, or
    None (a class defined inside a function, or one its module does not hold by that name)."""
    module, qualified = getattr(function, "__module__", None), function.__qualname__
    if not module or "<locals>" in qualified or module == "__main__":
        return None
    path = f"{module}:{qualified}"
    try:
        return path if resolve(path) is function else None
    except (ImportError, AttributeError, TypeError):
        return None


def resolve(path: str) -> type:
    """The Function class an import path names (see `import_path`)."""
    module, _, qualified = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualified.split("."):
        found = getattr(found, part)
    if not (isinstance(found, type) and issubclass(found, torch.autograd.Function)):
        raise TypeError(f"{path} is not a torch.autograd.Function")
    return found


def _listed(output: Any) -> list[torch.Tensor]:
    return list(output) if isinstance(output, tuple | list) else [output]


def _applied(path: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return _listed(_APPLY(resolve(path), *args))


@torch.library.custom_op(OPERATOR, mutates_args=())
def function_call(path: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Function `path` applied to `args`: its outputs as a list."""
    outputs = _applied(path, args)
    pointers = {a.untyped_storage().data_ptr() for a in args}
    # an operator's outputs may not alias its inputs (a Function returning `x.view_as(x)`)
    return [o.clone() if o.untyped_storage().data_ptr() in pointers else o for o in outputs]


@function_call.register_fake
def _fake(path: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(o) for o in _applied(path, args)]


def _setup_context(ctx: Any, inputs: tuple[str, list[torch.Tensor]], output: Any) -> None:
    ctx.path = inputs[0]
    ctx.save_for_backward(*inputs[1])


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[None, list[Any]]:
    args = [a.detach().requires_grad_(a.is_floating_point() or a.is_complex())
            for a in ctx.saved_tensors]
    with torch.enable_grad():
        outputs = _listed(_APPLY(resolve(ctx.path), *args))
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
             if g is not None and o.requires_grad]
    wanted = [a for a in args if a.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                     allow_unused=True) if pairs and wanted else ())
    return None, [next(found, None) if a.requires_grad else None for a in args]


function_call.register_autograd(_backward, setup_context=_setup_context)


def applied_as_operator(path: str, args: tuple[torch.Tensor, ...]) -> Any:
    """`resolve(path).apply(*args)` through the operator, while a graph is captured: one tensor
    back where the Function returns one, else a tuple."""
    with torch.no_grad():
        single = isinstance(_APPLY(resolve(path), *args), torch.Tensor)
    outputs = torch.ops.pdcompile.function_call.default(path, list(args))
    return outputs[0] if single else tuple(outputs)


__all__ = ["OPERATOR", "applied_as_operator", "function_call", "import_path", "resolve"]
