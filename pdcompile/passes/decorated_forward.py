"""A forward wrapped by a decorator that takes `(*args, **kwargs)` (`functools.wraps`: a
logging or argument-renaming decorator, transformers' `deprecate_kwarg`), given to torch.fx with
the signature of the function it wraps.

torch.fx reads the root forward's parameters from the wrapped function (`inspect.unwrap`) but
rewrites the wrapper's code object to take that many positional arguments, which the wrapper's
two-name code cannot hold: every such model failed with "code: co_varnames is too small",
whatever leaf_modules= said. The wrapper is handed to fx inside a function of the wrapped
signature that calls it, so that fx names one placeholder per parameter and traces through the
wrapper's own Python as it runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_VARIADIC = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
_WRAPPER = "_pd_decorated_forward"


def named_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` itself, or, where `fn` wraps a function of other parameters through `*args` /
    `**kwargs`, a function of the wrapped one's named parameters (and defaults) that calls
    `fn` (the wrapped one's own `*args` / `**kwargs` are left out: no input reaches them)."""
    inner = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if inner is fn or code is None or not code.co_flags & _VARIADIC:
        return fn
    params = list(inspect.signature(inner).parameters.values())
    if any(p.name == _WRAPPER for p in params):
        return fn
    last_positional_only = max((i for i, p in enumerate(params)
                                if p.kind is p.POSITIONAL_ONLY), default=None)
    heads, calls, starred = [], [], False
    for index, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue  # receives nothing (inputs bind to named parameters): fx would hand it
            # a Proxy, which `**kwargs` cannot unpack
        if p.kind is p.KEYWORD_ONLY:
            if not starred:
                heads.append("*")
                starred = True
            calls.append(f"{p.name}={p.name}")
        else:
            calls.append(p.name)
        heads.append(p.name)
        if index == last_positional_only:
            heads.append("/")
    namespace: dict[str, Any] = {_WRAPPER: fn}
    exec(f"def forward({', '.join(heads)}):\n"  # noqa: S102 - identifiers from a signature
         f"    return {_WRAPPER}({', '.join(calls)})\n", namespace)
    named = namespace["forward"]
    named.__name__ = inner.__name__  # set, not written into the code: any string may be one
    named.__defaults__ = inner.__defaults__
    named.__kwdefaults__ = inner.__kwdefaults__
    named.__qualname__ = inner.__qualname__
    return named


__all__ = ["named_forward"]
