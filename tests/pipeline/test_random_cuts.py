"""Every valid cut splits and trains like one process: random models (branches, skips, tuple
outputs read with getitem, LSTMs, a module called several times, in-place changes, constants
built in forward, several inputs and outputs) cut at random topological orders into stages of
random sizes with random replicas, under the flush schedules, give the losses, gradients and
weights of single-process training with gradient accumulation (tests/helpers/transparency.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from pdcompile.errors import PlanError
from pdcompile.meta import get_stage
from pdcompile.passes.split import split
from pdcompile.runtime.grad_mode import detached
from tests.helpers.random_models import (
    RandomNet,
    explicit_graph,
    random_cut,
    random_models,
    squared_error,
    trains_in_one_process,
)
from tests.helpers.transparency import check


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    model, inputs = draw(random_models())
    if not trains_in_one_process(model, inputs):
        reject()
    stages = draw(st.integers(1, 4))
    replicas = draw(st.lists(st.integers(1, 2), min_size=4, max_size=4))
    plan = random_cut(explicit_graph(model, inputs), draw(st.randoms(use_true_random=False)),
                      stages=stages, replicas=replicas)
    return {"model": model, "inputs": inputs, "plan": plan,
            "schedule": draw(st.sampled_from(["1f1b-flush", "gpipe"])),
            "micro": draw(st.sampled_from([2, 4]))}


def _check(case: dict[str, Any]) -> None:
    target = torch.randn(8, 1, case["inputs"][0].shape[-1], dtype=case["inputs"][0].dtype)
    pipe = check((case["model"], case["inputs"], target, squared_error),
                 schedule=case["schedule"], micro=case["micro"], plan=case["plan"])
    assert len(pipe.stage_modules) == len(case["plan"].stages)


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=30, **SETTINGS)
@given(cases())
def test_random_cuts_of_random_models(case: dict[str, Any]) -> None:
    _check(case)


@pytest.mark.slow
@settings(max_examples=300, **SETTINGS)
@given(cases())
def test_random_cuts_of_random_models_many(case: dict[str, Any]) -> None:
    _check(case)


@st.composite
def even_cuts(draw: st.DrawFn) -> dict[str, Any]:
    """`compile(stages=[replicas per stage])`: the even cut by weight (`split.even_plan`)."""
    model, inputs = draw(random_models())
    if not trains_in_one_process(model, inputs):
        reject()
    return {"model": model, "inputs": inputs,
            "replicas": draw(st.lists(st.integers(1, 2), min_size=1, max_size=5)),
            "schedule": draw(st.sampled_from(["1f1b-flush", "gpipe"])),
            "micro": draw(st.sampled_from([2, 4]))}


def _check_even(case: dict[str, Any]) -> None:
    target = torch.randn(8, 1, case["inputs"][0].shape[-1], dtype=case["inputs"][0].dtype)
    try:
        pipe = check((case["model"], case["inputs"], target, squared_error),
                     schedule=case["schedule"], micro=case["micro"], plan=None,
                     stages=case["replicas"])
    except PlanError as err:  # the one refusal an even cut may give: too few operations
        assert "too few for" in str(err), err
        reject()
    assert len(pipe.stage_modules) == len(case["replicas"])


@settings(max_examples=30, **SETTINGS)
@given(even_cuts())
def test_an_even_cut_of_any_random_model_splits_and_trains(case: dict[str, Any]) -> None:
    """Every stage of an even cut has an operation to run: the first operation is on stage 0
    (a heavy first layer once left stage 0 empty), and no cut falls before an item of a tuple,
    which runs where the tuple is made (an LSTM's `out, state` once left a stage of items)."""
    _check_even(case)


@pytest.mark.slow
@settings(max_examples=300, **SETTINGS)
@given(even_cuts())
def test_an_even_cut_of_any_random_model_splits_and_trains_many(case: dict[str, Any]) -> None:
    _check_even(case)


def test_a_value_changed_through_views_in_two_stages() -> None:
    """Found by the random cuts: a value changed through a view in stage 0, then through a new
    view of the changed value in stage 1; stage 1 must change its copy of the value it received
    changed, not a copy of the value before the first change."""
    from pdcompile.passes.split import manual_plan
    from tests.helpers.random_models import Step

    steps = (Step("linear", 0, 0), Step("add_", 1, 0), Step("constant", 0, 0),
             Step("view_mul_", 1, 0), Step("add", 0, 1), Step("view_mul_", 1, 0),
             Step("add", 0, 1))
    torch.manual_seed(0)
    model = RandomNet(steps, 1, (-1, -2, -3)).double()
    inputs = (torch.randn(8, 3, 4, dtype=torch.float64),)
    first = {"x", "embed_0", "layers_0", "mean", "add_", "narrow", "mul_", "changed_alias",
             "narrow_1", "mean_1", "add_2"}
    plan = manual_plan(explicit_graph(model, inputs), lambda n: 0 if n.name in first else 1)
    _check({"model": model, "inputs": inputs, "plan": plan, "schedule": "1f1b-flush",
            "micro": 2})


def test_an_lstm_output_changed_in_place_after_a_linear_read_it() -> None:
    """Found by the random cuts: a batch-first LSTM's output (not contiguous) read by a Linear,
    then changed in place. Eager mode trains it, since its matmul keeps a contiguous copy for
    the weight gradient; the fused Linear kept the output itself and its backward failed
    ("modified by an inplace operation"). It now keeps what eager keeps."""
    from pdcompile.passes.split import manual_plan
    from tests.helpers.random_models import Step

    torch.manual_seed(0)
    model = RandomNet((Step("lstm", 0, 0), Step("linear", 1, 0), Step("mul_", 1, 0)), 1,
                      (-1,)).double()
    inputs = (torch.randn(8, 3, 4, dtype=torch.float64),)
    plan = manual_plan(explicit_graph(model, inputs), lambda n: 0)
    _check({"model": model, "inputs": inputs, "plan": plan, "schedule": "1f1b-flush",
            "micro": 2})


def test_a_detach_alone_in_its_stage_sends_no_gradient() -> None:
    """The `detached` that ends a module called under the model's `no_grad`, alone in a stage
    (random cuts make such stages): it trains like one process, and what crosses to it is
    detached where it is made, so no zero gradient comes back to run the module's backward,
    which eager mode never runs."""
    from pdcompile.passes.split import manual_plan
    from tests.helpers.random_models import Step

    torch.manual_seed(0)
    model = RandomNet((Step("no_grad", 0, 1), Step("linear", 0, 0), Step("add_", 1, 0)), 2,
                      (-1,)).double()
    inputs = tuple(torch.randn(8, 3, 4, dtype=torch.float64) for _ in range(2))
    gm = explicit_graph(model, inputs)
    gate = next(n for n in gm.graph.nodes if n.name.startswith("detached")
                and n.args[0].op == "call_module")  # type: ignore[union-attr]
    after, todo = set(), list(gate.users)  # what reads the gate: stage 2; the rest (the
    while todo:  # in-place change of the module's input included) stage 0
        node = todo.pop()
        if node.name not in after:
            after.add(node.name)
            todo.extend(node.users)
    plan = manual_plan(gm, lambda n: 1 if n is gate else 2 if n.name in after else 0)
    assert plan.stages[1].nodes == (gate.name,)
    assert "add_" in plan.stages[0].nodes
    _check({"model": model, "inputs": inputs, "plan": plan, "schedule": "1f1b-flush",
            "micro": 2})
    split(gm, plan)
    sent = gate.args[0]
    assert isinstance(sent, fx.Node) and sent.target is detached
    assert get_stage(sent) == 0 and get_stage(gate) == 1


def test_a_view_of_a_tuple_item_changed_two_stages_later() -> None:
    """Found by the random cuts: a view of an LSTM's transposed state, made in stage 1 and
    changed in stage 2, where later readers of the transposed state read it changed."""
    from pdcompile.passes.split import manual_plan
    from tests.helpers.random_models import Step

    steps = (Step("mul_", 0, 0), Step("add", 0, 0), Step("lstm", 0, 0), Step("linear", 1, 0),
             Step("mul_", 0, 0), Step("view_mul_", 46, 0), Step("linear", 0, 0))
    torch.manual_seed(0)
    model = RandomNet(steps, 2, (-1, -2, -3)).double()
    inputs = tuple(torch.randn(8, 3, 4, dtype=torch.float64) for _ in range(2))
    first = {"x", "y", "embed_0"}
    last = {"mul__2", "changed_alias_1", "changed_alias", "add_3", "mean_3", "add_4", "mean_4",
            "add_5", "add_6", "add_7", "add_8", "add_9", "add_10"}
    plan = manual_plan(explicit_graph(model, inputs),
                       lambda n: 0 if n.name in first else 2 if n.name in last else 1)
    _check({"model": model, "inputs": inputs, "plan": plan, "schedule": "1f1b-flush",
            "micro": 2})


def test_a_tuple_sent_before_a_change_of_its_item(tmp_path: Path) -> None:
    """Found by random cuts under every schedule: an LSTM's `(out, (h, c))` whose state a stage
    of its own reads, and whose `out` the LSTM's stage then changes in place. The tuple is sent
    as a copy taken before the change, and `torch.clone` of a tuple failed compile ("clone():
    argument 'input' must be Tensor, not tuple"); it is now copied item by item and sent as its
    leaves, and the export loads and trains alike."""
    import pdcompile
    from pdcompile.passes.split import manual_plan
    from tests.helpers.random_models import Step

    torch.manual_seed(0)
    model = RandomNet((Step("lstm", 0, 0), Step("relu_inplace", 1, 0)), 1, (-1, -2)).double()
    inputs = (torch.randn(8, 3, 4, dtype=torch.float64),)
    first = {"x", "embed_0", "layers_0", "getitem", "relu"}
    plan = manual_plan(explicit_graph(model, inputs),
                       lambda n: 0 if n.name in first else 1 if n.name == "getitem_1" else 2)
    assert plan.stages[1].nodes == ("getitem_1",)
    target = torch.randn(8, 1, 4, dtype=torch.float64)
    _check({"model": model, "inputs": inputs, "plan": plan, "schedule": "1f1b-flush",
            "micro": 2})
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, plan=plan,
                             loss_fn=squared_error, schedule="1f1b-flush", microbatches=2)
    pipe.export(str(tmp_path / "export"))
    loaded = pdcompile.load(str(tmp_path / "export"), loss_fn=squared_error)
    assert loaded.step(*inputs, target=target) == pipe.step(*inputs, target=target)
