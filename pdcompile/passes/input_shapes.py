"""The input shapes a graph from torch.export runs on, and the refusal of any other, in words.

torch.export records a model for inputs whose sizes may vary where the export front end asked
(`Dim.AUTO`, every dimension) and the model does not depend on them; a size the model's code
depends on (a branch on it, a Python `int` of it) is fixed at the example's, and a size the
model bounds (a slice of a 64-row buffer) gets a range. torch.export keeps a size free under
other tests (`x.shape[1] % 2 == 0`, one input 3 longer than another, a batch compared with 3
to 83), which hold only for some sizes: those tests are kept (`InputShapes.tests`, trees of
size_tests.py) and evaluated exactly on the sizes of every microbatch; a test with no exact
counterpart there fixes the sizes it reads at the example's (`_captured_tests`). The recorded
graph runs only on inputs that fit: one with another fixed size, or sizes that fail a test, may
run and compute something else (a `view(-1, 8)`, the branch of another length), so the pipeline
refuses it before any rank starts, naming the expected and the given shapes, or the test.

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

from pdcompile.passes import size_tests
from pdcompile.passes.size_tests import SizeTest

MAX_TESTS = 10_000  # size tests an export may hold (a model makes a few)

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
    tensors are absent), the range of each size that may vary (`ranges`), and the tests the
    model's code makes of those sizes beyond their ranges (`tests`: size_tests.py trees over
    the sizes' names, e.g. `("==", ("%", "n2", 2), 0)`), each of which the sizes must pass."""

    inputs: dict[str, InputShape]
    ranges: dict[str, SizeRange]
    tests: tuple[SizeTest, ...] = ()

    @classmethod
    def of_program(cls, program: torch.export.ExportedProgram,
                   names: Mapping[str, str]) -> InputShapes:
        """Read from an ExportedProgram: the symbolic sizes of its user inputs (`names`: the
        program's placeholder name -> the graph's input name), their range constraints and the
        tests its code made of them."""
        inputs: dict[str, InputShape] = {}
        used: dict[str, str] = {}  # a symbol -> its name here ("n1", "n2"... in order)
        tests, pinned, example = _captured_tests(program)
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
        kept: list[SizeTest] = []
        for expr in tests:  # the sizes fixed since (another test's) at the example's
            tree = size_tests.from_sympy(
                expr, lambda s: used.get(str(s), example.get(s)))  # type: ignore[arg-type]
            if tree is not None and size_tests.names_in(tree) and tree not in kept:
                kept.append(tree)
        return cls(inputs, ranges, tuple(kept))

    def to_json(self) -> dict[str, Any]:
        """A JSON form (an export's pipeline.json keeps it)."""
        return {"inputs": {n: {"dims": list(s.dims), "dtype": s.dtype}
                           for n, s in self.inputs.items()},
                "ranges": {n: list(r) for n, r in self.ranges.items()},
                "tests": [_as_lists(t) for t in self.tests]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InputShapes:
        """Inverse of `to_json` (an export written before the tests were kept has none).
        ValueError (size_tests.SizeTestError for a test, in words) for anything `to_json`
        does not write: an export may come from a folder nobody here wrote."""
        inputs = {str(n): InputShape(tuple(s["dims"]), str(s["dtype"]))
                  for n, s in data["inputs"].items()}
        ranges = {str(n): (int(r[0]), None if r[1] is None else int(r[1]))
                  for n, r in data["ranges"].items()}
        for name, shape in inputs.items():
            for size in shape.dims:
                if isinstance(size, bool) or not isinstance(size, int | str) \
                        or (isinstance(size, str) and size not in ranges):
                    raise ValueError(f"input {name!r} has a dimension {size!r}, neither a "
                                     "size nor the name of a range")
        stored = data.get("tests", [])
        if not isinstance(stored, list) or len(stored) > MAX_TESTS:
            raise size_tests.SizeTestError(f"the size tests are not a list of at most "
                                           f"{MAX_TESTS}")
        return cls(inputs, ranges, tuple(size_tests.checked(t, set(ranges)) for t in stored))

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
        name; `microbatch`: its first microbatch (whose dimension 0 the graph sees). The
        graph runs on every microbatch, so the tests of the model's code (`tests`) must hold
        for the sizes of each: dimension 0 of the last is one less where `microbatches` does
        not divide the batch."""
        seen: dict[str, tuple[str, int]] = {}  # a size that may vary -> (input, its size)
        for name, shape in self.inputs.items():
            value, cut = minibatch.get(name), microbatch.get(name)
            if not isinstance(value, torch.Tensor) or not isinstance(cut, torch.Tensor):
                continue
            given = self._given(name, value, microbatches)
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
        return self.test_refusal(minibatch, microbatch, microbatches=microbatches) if seen \
            else None

    def _given(self, name: str, value: torch.Tensor, microbatches: int) -> str:
        return (f"input {name!r} is {tuple(value.shape)} "
                f"{str(value.dtype).removeprefix('torch.')} but the model, as torch.export "
                f"captured it, runs on {self.describe(name, microbatches=microbatches)}")

    def test_refusal(self, minibatch: Mapping[str, Any], microbatch: Mapping[str, Any], *,
                     microbatches: int) -> str | None:
        """The first test of `tests` that fails for the sizes of a microbatch, in words (None
        if all hold); the inputs as for `refusal`, whose other checks they are taken to pass.
        A minibatch shaped like the example needs this alone: the model was captured at the
        example's whole batch, and the graph runs on its microbatches."""
        carriers: dict[str, tuple[str, int]] = {}  # a size -> its first (input, dimension)
        for name, shape in self.inputs.items():
            if isinstance(minibatch.get(name), torch.Tensor):
                for dim, want in enumerate(shape.dims):
                    if isinstance(want, str):
                        carriers.setdefault(want, (name, dim))
        words = {size: f"{name}.shape[{dim}]" for size, (name, dim) in carriers.items()}
        for last in sorted({False, microbatches > 1}):  # each distinct microbatch
            sizes: dict[str, int] = {}
            batches: dict[str, int] = {}  # a size read on the batch dimension -> the minibatch's
            for size, (name, dim) in carriers.items():
                sizes[size] = int(microbatch[name].shape[dim])
                # an input that holds no samples reaches every microbatch whole; one that
                # does is cut along its batch dimension (0 unless compile was told another)
                if microbatches > 1 and microbatch[name].shape[dim] != minibatch[name].shape[dim]:
                    batches[size] = int(minibatch[name].shape[dim])
                    if last:
                        sizes[size] = batches[size] // microbatches
            for test in self.tests:
                read = [s for s in size_tests.names_in(test) if s in sizes]
                if len(read) < len(size_tests.names_in(test)):
                    continue  # a size of an input not given as a tensor
                try:
                    holds, why = bool(size_tests.evaluate(test, sizes)), ""
                except ArithmeticError as err:
                    holds, why = False, f" (it cannot be evaluated there: {err})"
                if holds:
                    continue
                name = carriers[read[0]][0]
                where = " and ".join(
                    f"dimension {carriers[s][1]} of {carriers[s][0]!r} is {sizes[s]}"
                    + (f" per microbatch (a minibatch of {batches[s]} cut into {microbatches})"
                       if s in batches else "") for s in read)
                return (f"{self._given(name, minibatch[name], microbatches)}: {where}; the "
                        f"model was captured for sizes where "
                        f"{size_tests.render(test, words)}{why}, which its code tests: pass "
                        "sizes where that holds or compile the pipeline at the sizes to train "
                        "on")
        return None


def _as_lists(tree: SizeTest) -> Any:
    """A size test as JSON writes it (lists for tuples)."""
    return [tree[0], *map(_as_lists, tree[1:])] if isinstance(tree, tuple) else tree


def _captured_tests(program: torch.export.ExportedProgram
                    ) -> tuple[list[Any], set[Any], dict[Any, int]]:
    """torch.export's tests of the free sizes that are more than a bound (sympy booleans), the
    sizes that must stay at the example's, and the example's sizes (symbol -> int).

    torch.export keeps a size free even where the model's code tests it beyond a range
    (`x.shape[1] % 2 == 0`, `2 * len(z) != x.shape[1] + 1`, one input's size 3 more than
    another's): the graph it records holds only for the sizes that pass those tests. Each test
    is kept and checked exactly on every minibatch (`InputShapes.refusal`); one with a part
    that has no exact counterpart in size_tests.py (a float, a true division) fixes the sizes
    it reads at the example's instead, as does a dimension that is an expression of other
    sizes: another size is refused in words instead of training on a branch the model would
    not take."""
    shape_env = next((size.node.shape_env for node in program.graph.nodes
                      if node.op == "placeholder" and isinstance(node.meta.get("val"),
                                                                 torch.Tensor)
                      for size in node.meta["val"].shape if isinstance(size, torch.SymInt)),
                     None)
    if shape_env is None:
        return [], set(), {}
    example = {symbol: int(hint) for symbol, hint in shape_env.backed_var_to_val.items()}
    dims: set[Any] = set()
    pinned: set[Any] = set()
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    expr = size.node.expr
                    (dims if expr.is_Symbol else pinned).update(expr.free_symbols)
    tests = []
    for guard in shape_env.guards:
        # with the sizes fixed since the test was made (its replacements): maybe just true
        expr = shape_env.simplify(guard.expr)
        if _is_bound(expr):
            continue
        symbols = set(expr.free_symbols)
        exact = size_tests.from_sympy(expr, lambda s: str(s) if s in dims else None)
        if exact is None or not symbols <= set(example):
            pinned |= symbols
        else:
            tests.append(expr)
    return tests, pinned, example


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


__all__ = ["InputShape", "InputShapes", "SizeRange"]
