"""The input shapes a graph from torch.export runs on, and the refusal of any other, in words.

torch.export records a model for inputs whose sizes may vary where the export front end asked
(`Dim.AUTO`, every dimension) and the model does not depend on them; a size the model's code
depends on (a branch on it, a Python `int` of it) is fixed at the example's, and a size the
model bounds (a slice of a 64-row buffer) gets a range. The recorded graph runs only on inputs
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


__all__ = ["InputShape", "InputShapes", "SizeRange"]
