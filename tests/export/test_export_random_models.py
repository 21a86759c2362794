"""Exports of models nobody chose run as exported: random models (branches, skips, tuple outputs,
LSTMs, shared modules, in-place changes, constants built in forward) through both front ends,
planned on random clusters with random schedules and costs, exported, loaded and trained, give
the losses and weights of the pipeline they were exported from, at the example's batch size and
at another one, and evaluate as the compiled pipeline does (the model's eval forward)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.errors import PipelineInputError
from tests.helpers.random_models import (
    RandomNet,
    Step,
    random_models,
    squared_error,
    trains_in_one_process,
)
from tests.helpers.transparency import momentum


def _trained(pipe: Any, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
             rows: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps on the example minibatch, then one of `rows` rows (refused in one line where
    they are fewer than the pipeline's microbatches)."""
    more = tuple(torch.cat([x, x])[:rows] for x in inputs)
    losses = [pipe.step(*inputs, target=target) for _ in range(2)]
    if rows < pipe.per_minibatch:
        with pytest.raises(PipelineInputError, match=f"batch size {rows}, too small to cut "
                                                     f"into {pipe.per_minibatch} microbatches"):
            pipe.step(*more, target=torch.cat([target, target])[:rows])
    else:
        losses.append(pipe.step(*more, target=torch.cat([target, target])[:rows]))
    return losses, pipe.state_dict()


def _round_trip(model: nn.Module, inputs: tuple[torch.Tensor, ...], folder: Path,
                rows: int, **options: Any) -> None:
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=squared_error,
                             optimizer=momentum, **options)
    pipe.export(str(folder))
    loaded = pdcompile.load(str(folder), loss_fn=squared_error, optimizer=momentum, trust=True)
    target = torch.randn(inputs[0].shape[0], 1, inputs[0].shape[-1])
    got, got_state = _trained(loaded, inputs, target, rows)
    want, want_state = _trained(pipe, inputs, target, rows)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, msg=lambda m, n=name: f"{n}: {m}")
    # validation: the loaded stage graphs in eval mode give the model's own eval output
    torch.testing.assert_close(loaded.evaluate(*inputs), pipe.evaluate(*inputs))


class _LSTMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


@pytest.mark.parametrize("rows", [8, 4, 12])
def test_an_exported_lstm_from_torch_export_loads_with_its_free_batch(tmp_path: Path,
                                                                       rows: int) -> None:
    """torch.export writes the LSTM's zero state as aten.zeros([1, batch, 4]) with the batch a
    traced size: loading the export traces that call back (it failed with 'Expected a value of
    type List[int] ... found type list')."""
    inputs = (torch.randn(8, 3, 4),)
    _round_trip(_LSTMHead(), inputs, tmp_path / "out", rows, frontend="export", plan=[1, 1],
                schedule="1f1b-flush", microbatches=2)


class _Decaying(nn.Module):
    """A buffer changed in place from constants alone, then read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.scale.mul_(0.9)
        return self.b(h * self.scale)


def test_an_exported_buffer_change_from_constants_runs_on_every_forward_when_loaded(
        tmp_path: Path) -> None:
    """Loading traces the stage code back: with buffers as plain tensors, `scale.mul_(0.9)` ran
    once on the loaded buffer while tracing and was left out of the loaded graph (a loaded
    pipeline's losses differed from the one it was exported from at the first step)."""
    torch.manual_seed(0)
    _round_trip(_Decaying(), (torch.randn(8, 3, 4),), tmp_path / "out", 8, plan=[1, 1],
                schedule="1f1b-flush", microbatches=2)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_an_exported_no_grad_region_stays_cut_off_when_loaded(tmp_path: Path,
                                                               frontend: str) -> None:
    """A gate computed by a Linear under the model's `torch.no_grad()`: the loaded stage code,
    traced back, keeps its `detached` calls (traced through, they saw a Proxy and returned it
    as it was: the gate's Linear trained after loading, not before)."""
    torch.manual_seed(0)
    model = RandomNet([Step("linear", 0, 0), Step("no_grad", 1, 1), Step("linear", 2, 0)],
                      inputs=1, outputs=(-1,)).double()
    inputs = (torch.randn(8, 3, 4, dtype=torch.float64),)
    _round_trip(model, inputs, tmp_path / "out", 8, frontend=frontend, plan=[1, 1],
                schedule="1f1b-flush", microbatches=2)
    loaded = pdcompile.load(str(tmp_path / "out"), loss_fn=squared_error, optimizer=momentum,
                            trust=True)
    before = loaded.state_dict()["layers.1.weight"].clone()
    loaded.step(*inputs, target=torch.randn(8, 1, 4, dtype=torch.float64))
    torch.testing.assert_close(loaded.state_dict()["layers.1.weight"], before)


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    model, inputs = draw(random_models())
    if not trains_in_one_process(model, inputs, also_rows=(1,)):
        reject()
    schedule = draw(st.sampled_from(["1f1b", "1f1b-flush", "gpipe", "2bw", "auto"]))
    return {"model": model, "inputs": inputs, "schedule": schedule,
            "microbatches": None if schedule in ("1f1b", "auto")
            else draw(st.sampled_from([2, 4])),
            "cluster": draw(st.sampled_from(["2@10GB/s", "4@10GB/s", "3@1GB/s~1ms",
                                             "2x2@10GB/s,1GB/s"])),
            "cost": draw(st.sampled_from(["analytic", "measured"])),
            "frontend": draw(st.sampled_from(["fx", "export"])),
            "rows": draw(st.sampled_from([4, 8, 12]))}


def _check(case: dict[str, Any], folder: Path) -> None:
    torch.manual_seed(0)
    _round_trip(case["model"], case["inputs"], folder, case["rows"], schedule=case["schedule"],
                microbatches=case["microbatches"], cost=case["cost"],
                frontend=case["frontend"], cluster=case["cluster"])


SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck)}


@settings(max_examples=6, **SETTINGS)
@given(case=_cases())
def test_planned_random_models_run_as_exported(case: dict[str, Any],
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(case, tmp_path_factory.mktemp("export") / "out")


@pytest.mark.slow
@settings(max_examples=100, **SETTINGS)
@given(case=_cases())
def test_planned_random_models_run_as_exported_many(
        case: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(case, tmp_path_factory.mktemp("export") / "out")


def test_a_view_changed_in_a_later_stage_than_its_base_loads(tmp_path: Path) -> None:
    """Found by the `_many` draws: a view (`narrow`) of a value made in stage 1 (`transpose`)
    changed in place in stage 2 is made again in stage 2 under a new name, so the exported
    graph no longer has the plan's `narrow`; loading refused the export ('plan.json does not
    fit the export's other files: it names the node 'narrow', which the exported graph does
    not have')."""
    from pdcompile.passes.split import manual_plan
    from tests.helpers.random_models import explicit_graph

    steps = [Step("max", 6, 6, 7), Step("shared", 28, 43, 7), Step("lstm", 49, 40, 2),
             Step("view_mul_", 24, 7, 3)]
    torch.manual_seed(0)
    model = RandomNet(steps, 1, (-1, -2)).double()
    inputs = (torch.randn(8, 3, 4, dtype=torch.float64),)
    first = {"x", "embed_0", "max_1", "getitem", "sub", "shared", "mean", "add", "mean_2"}
    second = {"layers_2", "getitem_1", "getitem_2", "getitem_3", "getitem_4", "transpose",
              "mean_1", "add_1", "add_2"}
    plan = manual_plan(explicit_graph(model, inputs),
                       lambda n: 0 if n.name in first else 1 if n.name in second else 2)
    assert "narrow" in plan.stages[2].nodes
    _round_trip(model, inputs, tmp_path / "out", 8, plan=plan, schedule="1f1b")
    kw: dict[str, Any] = {"loss_fn": squared_error, "optimizer": momentum, "trust": True}
    loaded = pdcompile.load(str(tmp_path / "out"), **kw)
    assert loaded.plan.stage_of() == plan.stage_of()
    loaded.export(str(tmp_path / "again"))  # exported again, it loads again
    assert pdcompile.load(str(tmp_path / "again"), **kw).plan.stage_of() == plan.stage_of()
