"""A model's own `torch.autograd.Function` (a gradient reversal layer, a straight-through
estimator, a fused kernel with a hand-written backward), found while capturing.

`Function.apply` runs the Function's forward with gradients off and hands autograd its backward.
Neither front end keeps that backward: torch.fx records the forward's operations, traced with
gradients off, which the trace then cuts from autograd as it does a `torch.no_grad()` region
(no gradient passed the call: the layers before it never trained), and torch.export records
the forward's operations with autograd's own derivatives (a gradient reversal passed the
gradient unreversed). Both trained silently wrong. Under torch.export, a call on tensors alone
of a Function its module holds by name becomes one operator that runs the Function, backward
included (runtime/function_call.py); any other call is refused, and under torch.fx every
call is (a module that calls it kept whole, `leaf_modules=`, runs it, backward included).
torch's own Functions (`torch.*`) are left alone; the reentrant checkpoint is captured as the
call it checkpoints (passes/reentrant_checkpoint.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pdcompile.runtime.function_call import applied_as_operator, import_path


@dataclass
class CalledFunctions:
    """The user-defined Functions applied within `custom_functions_seen`, each as
    (qualified class name, `where()` at its first call)."""

    calls: list[tuple[str, str]] = field(default_factory=list)


@contextmanager
def custom_functions_seen(where: Callable[[], str] = lambda: "", *, as_operator: bool = False
                          ) -> Iterator[CalledFunctions]:
    """Within: every `apply` of a Function subclass defined outside torch is recorded (and
    still run); `where()`: what to record of the place it was called from. `as_operator`
    (torch.export): a call on tensors alone of a Function its module holds by name runs as
    the operator of runtime/function_call.py instead, which keeps its backward, and is not
    recorded."""
    seen = CalledFunctions()
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        module = getattr(cls, "__module__", "") or ""
        if not (module == "torch" or module.startswith("torch.")):
            path = import_path(cls) if as_operator and not kwargs and all(
                isinstance(a, torch.Tensor) for a in args) else None
            if path is not None:
                return applied_as_operator(path, args)
            name = f"{module}.{cls.__qualname__}"
            if all(name != seen_name for seen_name, _ in seen.calls):
                seen.calls.append((name, where()))
        return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield seen
    finally:
        base.apply = original  # type: ignore[method-assign]


def calling_module(model: nn.Module) -> Callable[[], str]:
    """A `where` for `custom_functions_seen` under torch.export, which has no module stack of
    its own: the innermost module of `model` on the Python stack, as
    "'qualified.name' (Type)" ("" where none is)."""
    paths = {id(m): name for name, m in model.named_modules()}

    def where() -> str:
        frame = inspect.currentframe()
        while frame is not None:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and paths.get(id(module)):
                return f"{paths[id(module)]!r} ({type(module).__name__})"
            frame = frame.f_back
        return ""

    return where


__all__ = ["CalledFunctions", "calling_module", "custom_functions_seen"]
