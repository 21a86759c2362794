"""The expression trees that keep torch.export's tests of free sizes (passes/size_tests.py): built
from torch.export's sympy expressions, they compute what sympy computes at every size; written
back as Python, they read as they compute; a stored tree that is not one the translation writes
(an unknown operation, a huge exponent, deep nesting) is refused in one line, and evaluating an
accepted one stays bounded."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sympy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils._sympy import functions as torch_sympy

from pdcompile.passes import size_tests
from pdcompile.passes.size_tests import MAX_DEPTH, SizeTestError, checked, evaluate, render

SYMBOLS = [sympy.Symbol(f"s{i}", integer=True, positive=True) for i in range(3)]
NAMES = {s: f"n{i + 1}" for i, s in enumerate(SYMBOLS)}


@st.composite
def _integer_expressions(draw: st.DrawFn, depth: int = 3) -> Any:
    """Integer sympy expressions over SYMBOLS of the kinds torch.export's tests hold, divisors
    never zero (positive constants or sizes)."""
    leaf = st.sampled_from(SYMBOLS) | st.integers(-5, 40).map(sympy.Integer)
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(leaf)
    a = draw(_integer_expressions(depth - 1))
    b = draw(_integer_expressions(depth - 1))
    divisor = draw(st.sampled_from(SYMBOLS) | st.integers(1, 12).map(sympy.Integer))
    kind = draw(st.sampled_from(["+", "-", "*", "//", "mod", "pymod", "max", "min", "pow"]))
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
            "//": lambda: torch_sympy.FloorDiv(a, divisor),
            "mod": lambda: sympy.Mod(a, divisor),
            "pymod": lambda: torch_sympy.PythonMod(a, divisor),
            "max": lambda: sympy.Max(a, b), "min": lambda: torch_sympy.Min(a, b),
            "pow": lambda: a ** draw(st.integers(0, 3))}[kind]()


@st.composite
def _tests(draw: st.DrawFn, depth: int = 2) -> Any:
    """sympy booleans over `_integer_expressions`: comparisons, and/or/not of them."""
    if depth == 0 or draw(st.booleans()):
        relation = draw(st.sampled_from([sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt,
                                         sympy.Ge]))
        return relation(draw(_integer_expressions()), draw(_integer_expressions()))
    parts = [draw(_tests(depth - 1)) for _ in range(2)]
    return draw(st.sampled_from([lambda: sympy.And(*parts), lambda: sympy.Or(*parts),
                                 lambda: sympy.Not(parts[0])]))()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expr=_tests(), sizes=st.lists(st.integers(1, 300), min_size=3, max_size=3))
def test_a_translated_test_computes_what_sympy_computes_at_any_sizes(
        expr: Any, sizes: list[int]) -> None:
    assume(not isinstance(expr, sympy.logic.boolalg.BooleanAtom) and expr.free_symbols)
    tree = size_tests.from_sympy(expr, NAMES.get)
    assert tree is not None, expr
    assert json.loads(json.dumps(tree)) is not None  # plain JSON
    at = dict(zip(SYMBOLS, sizes, strict=True))
    want = bool(expr.xreplace({s: sympy.Integer(v) for s, v in at.items()}))
    assert evaluate(tree, {NAMES[s]: v for s, v in at.items()}) is want, (expr, tree)
    # the words a refusal prints read as Python reads them (our own tree, not stored text)
    words = {name: name for name in NAMES.values()}
    namespace = {"__builtins__": {"min": min, "max": max}, **{NAMES[s]: v for s, v in at.items()}}
    assert eval(render(tree, words), namespace) is want, render(tree, words)  # noqa: S307


def test_parts_with_no_exact_counterpart_are_not_translated() -> None:
    s, t = SYMBOLS[:2]
    for expr in [sympy.Eq(s / 2, t),  # a fraction
                 sympy.Eq(torch_sympy.IntTrueDiv(s, t), 2),  # a true division, a float
                 sympy.Ne(s ** 65, 1),  # an exponent past the limit
                 sympy.Gt(torch_sympy.ToFloat(s), 2.5)]:
        assert size_tests.from_sympy(expr, NAMES.get) is None, expr
    assert size_tests.from_sympy(sympy.Eq(sympy.Mod(s, 2), 0), lambda _: None) is None


def test_the_words_for_a_test_are_pythons() -> None:
    s, t = SYMBOLS[:2]
    words = {"n1": "x.shape[1]", "n2": "z.shape[0]"}
    assert render(size_tests.from_sympy(sympy.Eq(sympy.Mod(s, 2), 0), NAMES.get), words) == \
        "x.shape[1] % 2 == 0"
    assert render(size_tests.from_sympy(sympy.Ne(2 * t, s - 3), NAMES.get), words) == \
        "2 * z.shape[0] != x.shape[1] - 3"


def _nested(depth: int) -> Any:
    tree: Any = "n1"
    for _ in range(depth):
        tree = ["+", tree, 1]
    return ["==", tree, 0]


@pytest.mark.parametrize(("stored", "reason"), [
    (["__import__", "os"], "the operation '__import__', which is none of"),
    (["==", ["eval", "n1"], 0], "the operation 'eval', which is none of"),
    (["==", ["**", "n1", 10 ** 6], 0], "exponents are integers 0 to 64"),
    (["==", ["**", "n1", "n1"], 0], "exponents are integers 0 to 64"),
    (["==", "n1", 2 ** 70], "an integer of 71 bits"),
    (_nested(MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} operations"),
    (["==", "__class__", 0], "'__class__', which is no size of the inputs"),
    (["==", "n1"], "takes 2 operands, not 1"),
    (["+", "n1", 1], "must be a comparison"),
    (["and", "n1", ["==", "n1", 1]], "takes comparisons"),
    (["==", True, 1], "neither an integer"),
    (["==", ["+", *(["n1"] * 3000)], 0], "more than 2000 terms"),
    ("n1", "must be a comparison"),
])
def test_a_stored_test_that_the_translation_never_writes_is_refused(stored: Any,
                                                                      reason: str) -> None:
    with pytest.raises(SizeTestError) as info:
        checked(stored, {"n1"})
    assert reason in str(info.value) and "\n" not in str(info.value)


def test_evaluation_of_an_accepted_test_stays_bounded() -> None:
    tree = checked(["==", ["**", ["**", ["**", "n1", 64], 64], 64], 0], {"n1"})
    with pytest.raises(OverflowError):  # before computing 2**(62 * 64**3)
        evaluate(tree, {"n1": 2 ** 62})
    with pytest.raises(ZeroDivisionError):
        evaluate(checked(["==", ["%", 5, ["-", "n1", 3]], 0], {"n1"}), {"n1": 3})
    deep = checked(_nested(MAX_DEPTH - 1), {"n1"})
    assert evaluate(deep, {"n1": 1}) is False
