"""The tests torch.export recorded on free sizes, as small expression trees evaluated exactly.

torch.export keeps a size free even where the model's code tests it beyond a range
(`x.shape[1] % 2 == 0`, a batch compared with 3 to 83): the graph it records holds only for the
sizes that pass those tests. Each such test is kept as a tree over the names of the free sizes,
built from torch.export's sympy expression (`from_sympy`), so that a minibatch's sizes can be
checked exactly (`evaluate`) and a failing test named in words (`render`).

A tree is JSON: an integer, a size's name (a string), or a list `[operation, operand, ...]`
whose operation is one of `OPERATIONS`. An export keeps its trees, and an export may come from
a folder nobody here wrote (export/trust.py), so a stored tree is never run as code: `checked`
accepts only the operations below, with their arities and types, bounded literals, exponents,
depth and size, and `evaluate` is a small interpreter that also bounds every intermediate
integer (no test a model makes of its sizes comes near these limits).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

# A tree: int | str | tuple[str, *trees] (lists where it comes from JSON)
SizeTest = Any

MAX_DEPTH = 32  # nesting of operations
MAX_NODES = 2000  # operations, names and integers in one test
MAX_LITERAL = 2**63  # |an integer in a test|
MAX_EXPONENT = 64  # `**` takes an integer exponent 0..64, written in the test
MAX_BITS = 4096  # |an intermediate value| < 2**4096 while evaluating


class SizeTestError(ValueError):
    """A stored test that is not one this module writes (the reason in words)."""


def _floordiv(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("division by zero")
    return a // b


def _mod(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("modulo by zero")
    return a % b


# operation -> (operand count: a number, or (least, None) for any count from least; operand kind;
# result kind; how it is computed; precedence in words, as Python's)
_INT, _BOOL = "int", "bool"
_ARITHMETIC: dict[str, tuple[Callable[..., int], int]] = {
    "+": (operator.add, 5), "-": (operator.sub, 5), "*": (operator.mul, 6),
    "//": (_floordiv, 6), "%": (_mod, 6), "**": (operator.pow, 8)}
_COMPARISONS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge}
_CALLS = {"min": min, "max": max}
_LOGIC = ("and", "or", "not")
OPERATIONS = frozenset((*_ARITHMETIC, *_COMPARISONS, *_CALLS, *_LOGIC))
_PRECEDENCE = {**{op: p for op, (_, p) in _ARITHMETIC.items()},
               **dict.fromkeys(_COMPARISONS, 4), "not": 3, "and": 2, "or": 1}


def checked(tree: Any, names: frozenset[str] | set[str]) -> SizeTest:
    """`tree` (from JSON) as a test over `names` (tuples for lists), or SizeTestError naming
    what is not allowed: an unknown operation, a wrong operand count or kind, an unknown size,
    an integer, exponent, depth or size past the limits above."""
    count = [0]
    result = _checked(tree, frozenset(names), 0, count)
    if _kind(result) != _BOOL:
        raise SizeTestError("a size test must be a comparison or a combination of "
                            f"comparisons, not {_short(tree)}")
    return result


def _checked(tree: Any, names: frozenset[str], depth: int, count: list[int]) -> SizeTest:
    count[0] += 1
    if count[0] > MAX_NODES:
        raise SizeTestError(f"a size test has more than {MAX_NODES} terms")
    if isinstance(tree, bool) or tree is None or isinstance(tree, float | dict):
        raise SizeTestError(f"a size test holds {_short(tree)}, which is neither an integer, "
                            "a size's name nor an operation")
    if isinstance(tree, int):
        if abs(tree) >= MAX_LITERAL:
            raise SizeTestError(f"a size test holds an integer of {tree.bit_length()} bits "
                                "(at most 63)")
        return tree
    if isinstance(tree, str):
        if tree not in names:
            raise SizeTestError(f"a size test reads {_short(tree)}, which is no size of the "
                                "inputs")
        return tree
    if not isinstance(tree, list | tuple) or not tree or not isinstance(tree[0], str):
        raise SizeTestError(f"a size test holds {_short(tree)}, which is not an operation")
    op, args = tree[0], tree[1:]
    if op not in OPERATIONS:
        raise SizeTestError(f"a size test uses the operation {_short(op)}, which is none of "
                            f"{' '.join(sorted(OPERATIONS))}")
    if depth >= MAX_DEPTH:
        raise SizeTestError(f"a size test is nested deeper than {MAX_DEPTH} operations")
    least, most = ((1, 1) if op == "not" else (2, None) if op in (*_CALLS, "and", "or", "+", "*")
                   else (2, 2))
    if len(args) < least or (most is not None and len(args) > most):
        raise SizeTestError(f"the operation {op!r} of a size test takes "
                            f"{least if least == most else f'{least} or more'} operands, "
                            f"not {len(args)}")
    kids = tuple(_checked(a, names, depth + 1, count) for a in args)
    want = _BOOL if op in _LOGIC else _INT
    if any(_kind(k) != want for k in kids):
        raise SizeTestError(f"the operation {op!r} of a size test takes "
                            f"{'comparisons' if want == _BOOL else 'integers'}: "
                            f"{_short(tree)}")
    if op == "**" and not (isinstance(kids[1], int) and 0 <= kids[1] <= MAX_EXPONENT):
        raise SizeTestError(f"a size test raises to {_short(args[1])}; exponents are integers "
                            f"0 to {MAX_EXPONENT}")
    return (op, *kids)


def _kind(tree: SizeTest) -> str:
    if isinstance(tree, tuple) and (tree[0] in _COMPARISONS or tree[0] in _LOGIC):
        return _BOOL
    return _INT


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def evaluate(tree: SizeTest, sizes: Mapping[str, int]) -> Any:
    """The value of a `checked` tree at `sizes` (a bool for a test). ArithmeticError where it
    divides by zero or a value passes 2**MAX_BITS."""
    if isinstance(tree, int):
        return tree
    if isinstance(tree, str):
        return sizes[tree]
    op, *args = tree
    if op == "and":
        return all(evaluate(a, sizes) for a in args)
    if op == "or":
        return any(evaluate(a, sizes) for a in args)
    if op == "not":
        return not evaluate(args[0], sizes)
    values = [evaluate(a, sizes) for a in args]
    if op in _COMPARISONS:
        return _COMPARISONS[op](values[0], values[1])
    if op in _CALLS:
        return _CALLS[op](values)
    compute = _ARITHMETIC[op][0]
    result = values[0]
    for value in values[1:]:
        bits = (result.bit_length() * value if op == "**" else
                result.bit_length() + value.bit_length() if op == "*" else 0)
        if bits > MAX_BITS:
            raise OverflowError(f"a value past 2**{MAX_BITS}")
        result = compute(result, value)
    if result.bit_length() > MAX_BITS:
        raise OverflowError(f"a value past 2**{MAX_BITS}")
    return result


def names_in(tree: SizeTest) -> list[str]:
    """The sizes a tree reads, in the order it reads them, each once."""
    found: dict[str, None] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            found.setdefault(node)
        elif isinstance(node, tuple):
            stack.extend(reversed(node[1:]))
    return list(found)


def render(tree: SizeTest, words: Mapping[str, str]) -> str:
    """The tree as Python reads it, each size as `words` names it (`x.shape[1] % 2 == 0`)."""
    if isinstance(tree, int):
        return str(tree)
    if isinstance(tree, str):
        return words.get(tree, tree)
    op, *args = tree
    if op in _CALLS:
        return f"{op}({', '.join(render(a, words) for a in args)})"
    if op == "not":
        return f"not {_operand(args[0], words, op, first=True)}"
    return f" {op} ".join(_operand(a, words, op, first=i == 0) for i, a in enumerate(args))


def _operand(tree: SizeTest, words: Mapping[str, str], parent: str, *, first: bool) -> str:
    """An operand of `parent`, in parentheses where Python would read it otherwise: an
    operation of lower precedence; one of the same but to the right (`a - (b - c)`), except
    `+` in `+` or `*` in `*` and the like; any base of `**`; comparisons never chain."""
    text = render(tree, words)
    outer = _PRECEDENCE[parent]
    if isinstance(tree, int):
        return f"({text})" if tree < 0 and outer >= 6 else text
    if not isinstance(tree, tuple) or tree[0] in _CALLS:
        return text
    inner = _PRECEDENCE[tree[0]]
    same_op = tree[0] == parent and parent in ("+", "*", "and", "or")
    if inner < outer or (inner == outer and (outer in (4, 8) or not (first or same_op))):
        return f"({text})"
    return text


def from_sympy(expr: Any, name_of: Callable[[Any], SizeTest | None]) -> SizeTest | None:
    """torch.export's test `expr` (a sympy boolean of integer sizes) as a tree, each symbol
    as `name_of` gives it (a size's name, or the integer it is fixed at; None: unknown); None
    where any part has no exact counterpart here (a float, a true division, a bitwise or
    rounding function, an exponent past MAX_EXPONENT) or the tree passes the limits."""
    try:
        tree = _from_sympy(expr, name_of, _sympy_operations())
    except _Untranslatable:
        return None
    try:
        return checked(tree, frozenset(names_in(tree)))
    except SizeTestError:
        return None


class _Untranslatable(Exception):
    pass


def _sympy_operations() -> dict[type, str]:
    """sympy's and torch's classes -> the operation here, for those that compute exactly that
    on integers (sympy's Mod and torch's PythonMod as Python's `%`; torch's Mod assumes
    operands of one sign, where it is Python's too)."""
    import sympy
    from torch.utils._sympy import functions as torch_sympy

    table: dict[type, str] = {sympy.Mod: "%", sympy.Max: "max", sympy.Min: "min",
                              sympy.Eq: "==", sympy.Ne: "!=", sympy.Lt: "<", sympy.Le: "<=",
                              sympy.Gt: ">", sympy.Ge: ">=", sympy.And: "and", sympy.Or: "or",
                              sympy.Not: "not"}
    for name, op in (("PythonMod", "%"), ("Mod", "%"), ("FloorDiv", "//"), ("CleanDiv", "//"),
                     ("Max", "max"), ("Min", "min"), ("PowByNatural", "**")):
        cls = getattr(torch_sympy, name, None)
        if isinstance(cls, type):
            table[cls] = op
    return table


def _from_sympy(expr: Any, name_of: Callable[[Any], SizeTest | None],
                table: dict[type, str]) -> SizeTest:
    import sympy

    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        name = name_of(expr)
        if name is None:
            raise _Untranslatable
        return name
    kids = [_from_sympy(a, name_of, table) for a in expr.args]  # raises first for unknowns
    if isinstance(expr, sympy.Add):
        return _sum(expr, kids)
    if isinstance(expr, sympy.Mul):
        return ("*", *kids)  # a fraction's coefficient is a Rational: untranslatable above
    if isinstance(expr, sympy.Pow) or table.get(type(expr)) == "**":
        if not isinstance(kids[1], int) or not 0 <= kids[1] <= MAX_EXPONENT:
            raise _Untranslatable
        return ("**", *kids)
    op = table.get(type(expr))
    if op is None:
        raise _Untranslatable
    return (op, *kids)


def _sum(expr: Any, kids: list[SizeTest]) -> SizeTest:
    """An Add as additions and subtractions (`s1 - 3`, not `-3 + s1`)."""
    plus: list[SizeTest] = []
    minus: list[SizeTest] = []
    for term, kid in zip(expr.args, kids, strict=True):
        if term.could_extract_minus_sign():
            negated = _negated(kid)
            (minus if negated is not None else plus).append(negated if negated is not None
                                                           else kid)
        else:
            plus.append(kid)
    plus.sort(key=lambda kid: isinstance(kid, int))  # `s1 + 3`, as one writes it
    tree: SizeTest = plus[0] if len(plus) == 1 else ("+", *plus) if plus else 0
    for term in minus:
        tree = ("-", tree, term)
    return tree


def _negated(tree: SizeTest) -> SizeTest | None:
    """-tree without a product by -1 (`-3` -> 3, `-1 * s` -> s, `-2 * s` -> 2 * s)."""
    if isinstance(tree, int):
        return -tree
    if isinstance(tree, tuple) and tree[0] == "*" and isinstance(tree[1], int) and tree[1] < 0:
        rest = tree[2:] if tree[1] == -1 else (-tree[1], *tree[2:])
        return rest[0] if len(rest) == 1 else ("*", *rest)
    return None


__all__ = ["MAX_DEPTH", "MAX_EXPONENT", "OPERATIONS", "SizeTest", "SizeTestError", "checked",
           "evaluate", "from_sympy", "names_in", "render"]
