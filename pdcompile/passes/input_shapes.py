"""The input shapes a graph from torch.export runs on, and the refusal of any other, in words.

torch.export records a model for inputs whose sizes may vary where the export front end asked
(`Dim.AUTO`, every dimension) and the model does not depend on them; a size the model's code
depends on (a branch on it, a Python `int` of it) is fixed at the example's, and a size the
model bounds (a slice of a 64-row buffer) gets a range. torch.export keeps a size free under
other tests (`x.shape[1] % 2 == 0`, one input 3 longer than another), which hold only for some
sizes; those sizes are fixed here (`_pinned_sizes`). The recorded graph runs only on inputs
that fit: one with another fixed size may run and compute something else (a `view(-1, 8)`), so
the pipeline refuses it before any rank starts, naming the expected and the given shapes.

torch.export assumes every free size is at least 2 (sizes 0 and 1 would be specialised), but
the aten graph it records runs on size 1 too (a microbatch of one sample), so a lower bound of
2 is read as 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Range of a size that may vary: (lowest, highest or None for unbounded)
SizeRange = tuple[int, int | None]


@dataclass(frozen=True)
class InputShape:
    """One input: per dimension its fixed size, or the name of a size that may vary (inputs
    that share a name must agree on it); and its dtype ("int64")."""

    dims: tuple[int | str, ...]
    dtype: str


@dataclass(frozen=True)
class InputShapes:
    """What every input of a graph may be (`inputs`, by placeholder name; inputs that are not
    tensors are absent) and the range of each size that may vary (`ranges`)."""

    inputs: dict[str, InputShape]
    ranges: dict[str, SizeRange]

    @classmethod
    def of_program(cls, program: torch.export.ExportedProgram,
                   names: Mapping[str, str]) -> InputShapes:
        """Read from an ExportedProgram: the symbolic sizes of its user inputs (`names`: the
        program's placeholder name -> the graph's input name) and their range constraints."""
        inputs: dict[str, InputShape] = {}
        used: dict[str, str] = {}  # a symbol -> its name here ("n1", "n2"... in order)
        pinned, example = _pinned_sizes(program)
        for node in program.graph.nodes:
            value = node.meta.get("val")
            if node.op != "placeholder" or node.name not in names \
                    or not isinstance(value, torch.Tensor):
                continue
            dims: list[int | str] = []
            for size in value.shape:
                expr = size.node.expr if isinstance(size, torch.SymInt) else size
                if isinstance(expr, int) or expr.is_number:  # fixed (a constant expression)
                    dims.append(int(expr))
                elif not expr.is_Symbol or expr in pinned:  # at the example's size
                    dims.append(int(expr.subs(example)))
                else:
                    dims.append(used.setdefault(str(expr), f"n{len(used) + 1}"))
            inputs[names[node.name]] = InputShape(tuple(dims),
                                                  str(value.dtype).removeprefix("torch."))
        ranges: dict[str, SizeRange] = {}
        for symbol, bounds in program.range_constraints.items():
            name = used.get(str(symbol))
            if name is None:
                continue
            low, high = float(bounds.lower), float(bounds.upper)  # int_oo reads as inf
            ranges[name] = (1 if low <= 2 else int(low), None if math.isinf(high) else int(high))
        for name in used.values():
            ranges.setdefault(name, (1, None))
        return cls(inputs, ranges)

    def to_json(self) -> dict[str, Any]:
        """A JSON form (an export's pipeline.json keeps it)."""
        return {"inputs": {n: {"dims": list(s.dims), "dtype": s.dtype}
                           for n, s in self.inputs.items()},
                "ranges": {n: list(r) for n, r in self.ranges.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InputShapes:
        """Inverse of `to_json`."""
        return cls({n: InputShape(tuple(s["dims"]), str(s["dtype"]))
                    for n, s in data["inputs"].items()},
                   {n: (int(r[0]), None if r[1] is None else int(r[1]))
                    for n, r in data["ranges"].items()})

    def describe(self, name: str, *, microbatches: int = 1) -> str:
        """"(any, 1..64) int64": input `name` in words (dimension 0 as a minibatch's when it
        is cut into `microbatches`)."""
        shape = self.inputs[name]
        words = []
        for dim, size in enumerate(shape.dims):
            if isinstance(size, int):
                words.append(f"{size} per microbatch" if dim == 0 and microbatches > 1
                             else str(size))
                continue
            low, high = self.ranges[size]
            shared = sum(d == size for s in self.inputs.values() for d in s.dims) > 1
            span = "any" if high is None and low <= 1 else f"{low}..{high if high else ''}"
            words.append(f"{size}={span}" if shared else span)
        inner = ", ".join(words) + ("," if len(words) == 1 else "")
        return f"({inner}) {shape.dtype}"

    def refusal(self, minibatch: Mapping[str, Any], microbatch: Mapping[str, Any], *,
                microbatches: int) -> str | None:
        """Why these inputs cannot run (None if they can): the first input that does not fit,
        its shape and the expected one in words, and the fix. `minibatch`: the inputs by
        name; `microbatch`: its first microbatch (whose dimension 0 the graph sees)."""
        seen: dict[str, tuple[str, int]] = {}  # a size that may vary -> (input, its size)
        for name, shape in self.inputs.items():
            value, cut = minibatch.get(name), microbatch.get(name)
            if not isinstance(value, torch.Tensor) or not isinstance(cut, torch.Tensor):
                continue
            given = (f"input {name!r} is {tuple(value.shape)} "
                     f"{str(value.dtype).removeprefix('torch.')} but the model, as torch.export "
                     f"captured it, runs on {self.describe(name, microbatches=microbatches)}")
            if value.dim() != len(shape.dims):
                return (f"{given}: give it {len(shape.dims)} dimensions, not {value.dim()}")
            if str(value.dtype).removeprefix("torch.") != shape.dtype:
                return f"{given}: convert it with .to(torch.{shape.dtype})"
            for dim, want in enumerate(shape.dims):
                size = int(cut.shape[dim])
                if isinstance(want, int):
                    if size != want:
                        return (f"{given}: the model's code depends on the size of dimension "
                                f"{dim}, so torch.export fixed it at {want}; pass that size or "
                                "compile the pipeline at the size to train on")
                    continue
                low, high = self.ranges[want]
                if size < low or (high is not None and size > high):
                    return (f"{given}: dimension {dim} must be {low} to "
                            f"{high if high is not None else 'any size'} (the model's limit)")
                if want in seen and seen[want][1] != size:
                    other, other_size = seen[want]
                    return (f"{given}: dimension {dim} must equal the size {want} of input "
                            f"{other!r}, which is {other_size}")
                seen.setdefault(want, (name, size))
        return None



def _pinned_sizes(program: torch.export.ExportedProgram) -> tuple[set[Any], dict[Any, int]]:
    """The sizes that must stay at the example's, and the example's sizes (symbol -> int).

    torch.export keeps a size free even where the model's code tests it beyond a range
    (`x.shape[1] % 2 == 0`, `2 * len(z) != x.shape[1] + 1`, one input's size 3 more than
    another's): the graph it records holds only for the sizes that pass those tests, and
    `refusal` checks ranges and shared sizes, not such tests. So the sizes a test reads are
    fixed at the example's where the test fails for some sizes a minibatch could have
    (`_restricts`), as is every size whose dimension is an expression of others: another size
    is refused in words instead of training on a branch the model would not take. Tests that
    only exclude degenerate sizes (a reshape's `h // 2 != 1`) leave the sizes free."""
    shape_env = next((size.node.shape_env for node in program.graph.nodes
                      if node.op == "placeholder" and isinstance(node.meta.get("val"),
                                                                 torch.Tensor)
                      for size in node.meta["val"].shape if isinstance(size, torch.SymInt)),
                     None)
    if shape_env is None:
        return set(), {}
    example = {symbol: int(hint) for symbol, hint in shape_env.backed_var_to_val.items()}
    pinned: set[Any] = set()
    for guard in shape_env.guards:
        # with the sizes fixed since the test was made (its replacements): maybe just true
        expr = shape_env.simplify(guard.expr)
        if not _is_bound(expr) and _restricts(expr, example):
            pinned |= set(expr.free_symbols)
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt) and not size.node.expr.is_Symbol:
                    pinned |= set(size.node.expr.free_symbols)
    return pinned, example


def _is_bound(expr: Any) -> bool:
    """Whether a test of torch.export's is a bound on one size (`s <= 64`, `s > 1`, `s != 1`),
    which the ranges hold, rather than a test of its value (`s % 2 == 0`) or of several."""
    import sympy

    if not isinstance(expr, sympy.core.relational.Relational) or len(expr.free_symbols) != 1:
        return expr is sympy.true
    sides = (expr.lhs, expr.rhs)
    symbol = next((side for side in sides if side.is_Symbol), None)
    number = next((side for side in sides if side.is_number), None)
    if symbol is None or number is None:
        return False
    if isinstance(expr, sympy.Ne):  # only sizes below the ranges' least may be excluded
        return bool(number <= 1)
    return not isinstance(expr, sympy.Eq)


# sizes a test is tried at: every size from 4 to 40, then powers of two and their neighbours
# (a test failing only at 2 or 3 excludes degenerate sizes, as a reshape's do)
_TRIED = (*range(4, 41), 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 1024)
_DRAWS = 400  # assignments tried for a test of several sizes


def _restricts(expr: Any, example: dict[Any, int]) -> bool:
    """Whether the test fails for some sizes a minibatch could have: each size it reads tried
    at `_TRIED` (alone, the others at the example's), then `_DRAWS` assignments of all of
    them at once from a fixed seed. Any failure, or a test that cannot be evaluated, counts."""
    import random

    import sympy

    symbols = sorted(expr.free_symbols, key=str)
    if not symbols or any(s not in example for s in symbols):
        return bool(symbols)

    def holds(values: dict[Any, int]) -> bool:
        try:
            return bool(expr.xreplace({s: sympy.Integer(v) for s, v in values.items()}))
        except (TypeError, ValueError, ZeroDivisionError):
            return False

    base = {s: example[s] for s in symbols}
    for symbol in symbols:
        for size in _TRIED:
            if not holds({**base, symbol: size}):
                return True
    draw = random.Random(0)
    return any(not holds({s: draw.choice(_TRIED) for s in symbols})
               for _ in range(_DRAWS if len(symbols) > 1 else 0))


__all__ = ["InputShape", "InputShapes", "SizeRange"]
