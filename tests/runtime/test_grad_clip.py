"""`compile(..., clip_grad_norm=C)`: every minibatch's gradients scaled by the global norm over
all stages, as `torch.nn.utils.clip_grad_norm_(model.parameters(), C)` on one process does
(a replicated stage counted once, a tied parameter counted once, also where one worker holds
several of its copies as chunks), locally, after export, and over gloo; refused, in words,
where a minibatch's norm never exists at one time."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.passes.trace import trace
from pdcompile.planner.interleave import interleaved_plan
from tests.helpers.before_tracing import assert_refused_before_tracing
from tests.helpers.one_process import train_one_process
from tests.helpers.tied_models import (
    assert_every_copy,
    gpt2_case,
    interleaved_tie_plan,
    tied_lm_case,
    v_shaped,
)
from tests.helpers.transparency import (
    Case,
    crossed_ties,
    crossed_ties_plan,
    momentum,
    skip_plan,
    skipnet,
    tied_bn,
    tied_plan,
)

STEPS, MICRO = 3, 4
CASES: dict[str, tuple[Callable[[], Case], Callable[[nn.Module], pdcompile.Plan]]] = {
    "skip, replicated stage": (skipnet, skip_plan),  # stage 1 has 2 replicas
    "tied across stages": (tied_bn, tied_plan),
}


def _reference(case: Case, max_norm: float) -> tuple[list[float], list[float]]:
    """Gradient accumulation, clip_grad_norm_, step; the losses and the norms before clipping."""
    model, inputs, target, loss_fn = case
    return train_one_process(model, momentum(list(model.parameters())), inputs, target,
                             loss_fn, micro=MICRO, steps=STEPS, clip=max_norm)


def _pipeline(case: Case, plan: Any, schedule: str, max_norm: float | None
              ) -> pdcompile.Pipeline:
    model, inputs, target, loss_fn = case
    return pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule=schedule, microbatches=MICRO,
                             plan=plan(model), clip_grad_norm=max_norm, example_target=target)


def _assert_state(pipe: pdcompile.Pipeline, model: nn.Module) -> None:
    state = pipe.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("name", "schedule"), [
    (name, schedule) for name in sorted(CASES) for schedule in ("1f1b-flush", "gpipe", "zb-h1")
    if not (schedule == "zb-h1" and "replicated" in name)])  # zero bubble: no replicas
def test_clipping_matches_one_process(name: str, schedule: str) -> None:
    make, plan = CASES[name]
    torch.manual_seed(0)
    case = make()
    model, inputs, target, _ = case
    pipe = _pipeline(case, plan, schedule, max_norm=0.05)
    losses = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    want, norms = _reference(case, 0.05)
    assert min(norms) > 0.05 * 2  # the clipping really scaled every step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    _assert_state(pipe, model)


def test_a_limit_above_the_norm_changes_nothing() -> None:
    torch.manual_seed(0)
    case = skipnet()
    model, inputs, target, _ = case
    clipped = _pipeline(case, skip_plan, "1f1b-flush", max_norm=1e6)
    plain = _pipeline(case, skip_plan, "1f1b-flush", max_norm=None)
    for _ in range(STEPS):
        assert clipped.step(*inputs, target=target) == plain.step(*inputs, target=target)
    for name, value in plain.state_dict().items():
        assert torch.equal(clipped.state_dict()[name], value), name


def test_an_export_keeps_the_limit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    case = tied_bn()
    model, inputs, target, _ = case
    pipe = _pipeline(case, tied_plan, "1f1b-flush", max_norm=0.05)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    assert loaded.clip_grad_norm == 0.05
    losses = [loaded.step(*inputs, target=target) for _ in range(STEPS)]
    want, _ = _reference(case, 0.05)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    _assert_state(loaded, model)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_a_limit_that_is_not_a_positive_number_is_refused_before_tracing(value: Any) -> None:
    assert_refused_before_tracing("clip_grad_norm must be a positive number", clip_grad_norm=value)


@pytest.mark.parametrize(("schedule", "words"), [
    ("1f1b", "does not wait for"), ("2bw", "does not wait for")])
def test_asynchronous_schedules_are_refused(schedule: str, words: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(PipelineInputError, match=f"clip_grad_norm.*{words}.*flush schedule"):
        _pipeline(skipnet(), skip_plan, schedule, max_norm=1.0)


def _interleaved(model: nn.Module) -> pdcompile.Plan:
    return interleaved_plan(trace(model), ranks=2, chunks=2)


def _crossed() -> Case:
    model, x, y = crossed_ties()
    return model, (x,), y, nn.functional.mse_loss


CHUNKED: dict[str, tuple[Callable[[], Case], Callable[[nn.Module], pdcompile.Plan], str]] = {
    "skip, interleaved": (skipnet, _interleaved, "interleaved-1f1b"),
    "tied across ranks, interleaved zero bubble": (tied_bn, _interleaved, "interleaved-zb"),
    "GPT-2, tie within rank 0, ZB-V": (gpt2_case, v_shaped, "zb-v"),
    "GPT-2, tie within rank 0, DualPipeV": (gpt2_case, v_shaped, "dualpipev"),
    "GPT-2, tie within rank 1, interleaved": (gpt2_case, interleaved_tie_plan,
                                              "interleaved-1f1b"),
    "tie on two chunks of rank 0 and on rank 1, ZB-V": (tied_lm_case, v_shaped, "zb-v"),
    # `b` is read by stages 1 and 2 only: counted on stage 1, not on the first stage of its ranks
    "two ties in crossed chunk order": (_crossed, crossed_ties_plan, "interleaved-1f1b"),
}


@pytest.mark.parametrize("name", list(CHUNKED))
def test_clipping_where_workers_hold_several_stages_matches_one_process(name: str) -> None:
    """Each worker adds the squares of all its chunks' gradients (a tied parameter once, on
    the first stage holding it, wherever its other copies are) and joins one all-reduce per
    update; every chunk scales by the same factor. It was refused ("not supported yet"): each
    chunk joining its own all-reduce would have paired one worker's chunk with another's."""
    make, plan, schedule = CHUNKED[name]
    torch.manual_seed(0)
    case = make()
    model, inputs, target, _ = case
    pipe = _pipeline(case, plan, schedule, max_norm=0.05)
    losses = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    want, norms = _reference(case, 0.05)
    assert min(norms) > 0.05 * 2  # the clipping really scaled every step
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64))
    assert_every_copy(pipe, model.state_dict(), name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_clipping_matches_one_process(tmp_path: Path) -> None:
    """The same over gloo (`pdcompile run`, 5 processes: the replicated stage's two replicas
    each add half of their squares)."""
    from tests.helpers.processes import run_export_losses

    torch.manual_seed(0)
    case = skipnet()
    pipe = _pipeline(case, skip_plan, "1f1b-flush", max_norm=0.05)
    folder = tmp_path / "pipe"
    pipe.export(str(folder))
    want, _ = _reference(case, 0.05)
    assert run_export_losses(folder, nproc=5, steps=STEPS) == pytest.approx(want, rel=1e-5)
