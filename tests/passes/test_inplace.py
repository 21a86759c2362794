"""In-place operations made explicit: readers after a change read the changed value through a
data edge, so that no cut can move them before it."""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from pdcompile.passes.inplace import make_mutations_explicit, mutated_input, set_item
from pdcompile.passes.shapes import annotate_shapes
from pdcompile.passes.trace import trace


class Aliased(nn.Module):
    """`z` is another name of `y`: eager code reads the changed value through it."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = y
        z += x  # fx's own Proxy would record `z = z + x`, leaving y unchanged
        y.mul_(3)
        F.relu(y, inplace=True)
        self.relu(y)
        n = x.size(0)
        n += 1  # an int: a new value, not a change of x.size(0)
        return y * n


def test_traced_in_place_changes_read_like_eager() -> None:
    model, x = Aliased(), torch.randn(3, 2)
    gm = trace(model)
    annotate_shapes(gm, (x,))
    assert make_mutations_explicit(gm)
    assert not make_mutations_explicit(gm)  # idempotent
    torch.testing.assert_close(gm(x), model(x))
    changes = {n.name: mutated_input(n, gm) for n in gm.graph.nodes}
    names = {name: m.name for name, m in changes.items() if m is not None}
    assert names == {"iadd": "mul", "mul_": "iadd", "relu": "mul_", "relu_1": "relu"}
    final = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert final.args[0].name == "relu_1"  # type: ignore[union-attr] # reads the last change


def test_setitem_returns_the_changed_tensor() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(operator.mul, (x, 2.0))
    graph.call_function(operator.setitem, (y, 0, 0.0))
    graph.output(graph.call_function(operator.add, (y, 1.0)))
    gm = fx.GraphModule(nn.Module(), graph)
    make_mutations_explicit(gm)
    setitem = next(n for n in gm.graph.nodes if n.target is set_item)
    assert next(n for n in gm.graph.nodes if n.op == "output").args[0].args[0] is setitem  # type: ignore[union-attr]
    expected = torch.ones(2, 2) * 2
    expected[0] = 0.0
    torch.testing.assert_close(gm(torch.ones(2, 2)), expected + 1)


def test_aten_overloads_that_write_their_input() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    add_ = graph.call_function(torch.ops.aten.add_.Tensor, (x, x))
    add = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    graph.output((add_, add))
    gm = fx.GraphModule(nn.Module(), graph)
    assert mutated_input(add_, gm) is x and mutated_input(add, gm) is None


class ViewChange(nn.Module):
    """A change of a view of `a` changes `a`: `l3` reads the changed values."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l1(x)
        b = self.l2(x)
        a.narrow(-1, 0, 2).mul_(0.5)
        return b + self.l3(a)


def test_a_change_of_a_view_reaches_readers_of_its_base_in_every_cut() -> None:
    """Every cut of the graph into up to three stages, the change of the view included in any
    of them (before the change ran in its own stage only, and a third stage read `a` unchanged):
    the pipeline computes, and trains, like the model."""
    from pdcompile.passes.split import manual_plan
    from tests.helpers.transparency import check

    model, x, target = ViewChange(), torch.randn(8, 4), torch.randn(8, 4)
    gm = trace(model)
    make_mutations_explicit(gm)
    code = gm.code
    assert "changed_alias(l1, mul_)" in code and "self.l3(changed_alias)" in code
    assert make_mutations_explicit(gm) is False and gm.code == code  # idempotent
    body = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for first, second in itertools.combinations_with_replacement(range(len(body) + 1), 2):
        stage = {name: (i >= first) + (i >= second) for i, name in enumerate(body)}
        if set(stage.values()) not in ({0, 1}, {0, 1, 2}):
            continue  # an empty stage
        check((model, (x,), target, lambda out, t: ((out - t) ** 2).mean()),
              schedule="1f1b-flush", micro=2, plan=manual_plan(gm, stage))


class NumberReadAfterChange(nn.Module):
    """timm's Hiera: `B, _, C = x.shape` ... `B *= 4` in a loop, the old B read after it (here
    in a later stage). fx writes `operator.imul` as `getitem *= 3;  imul = getitem`, which on
    an int rebinds `getitem`: every later reader of the old value read the new one, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.size(0)
        n = b
        n *= 3
        h = torch.tanh(self.a(x)) * n
        return self.b(h) * b


def test_a_number_changed_by_an_augmented_assignment_keeps_its_old_readers() -> None:
    model, x = NumberReadAfterChange(), torch.randn(4, 4)
    gm = trace(model)
    annotate_shapes(gm, (x,))
    assert make_mutations_explicit(gm)
    torch.testing.assert_close(gm(x), model(x))
    assert not any(n.target is operator.imul for n in gm.graph.nodes)


def test_a_number_changed_by_an_augmented_assignment_crosses_stages_unchanged() -> None:
    import pdcompile
    from pdcompile.passes.split import manual_plan

    model, x = NumberReadAfterChange(), torch.randn(4, 4)
    gm = trace(model)
    plan = manual_plan(gm, lambda n: 1 if n.name in ("b", "mul_1", "output") else 0)
    pipe = pdcompile.compile(model, example_inputs=(x,), plan=plan, schedule="1f1b-flush",
                             microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
