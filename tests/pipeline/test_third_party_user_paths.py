"""README user paths on real third-party models, in combinations nobody chose: Hugging Face
models given inputs of no samples by name (`position_ids` of shape (1, seq), a 0-d
temperature), a model that computes its own loss from `labels=`, a torchvision ResNet trained
in eval mode; `stages=K` balanced by the planner's analytic costs under a drawn schedule and
microbatch count. Each trains as one process does: losses and weights after two updates of
gradient accumulation (tests/helpers/third_party.py, USER_PATHS).

`position_ids` of shape (1, seq) was cut like a batch and refused ('input 'position_ids' has
batch size 1, too small to cut into 2 microbatches'); a (k,) or (seq, seq) input was cut too
(tests/pipeline/test_unbatched_inputs.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.schedule.kinds import kind
from tests.helpers.third_party import USER_PATHS

BATCH, STEPS = 6, 2
SCHEDULES = ("1f1b-flush", "gpipe", "zb-h1", "interleaved-zb", "zb-v")


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _cut(inputs: dict[str, Any] | tuple[Any, ...], micro: int, i: int) -> Any:
    """Microbatch i: tensors whose first dimension is the batch cut, the rest whole."""
    def part(v: Any) -> Any:
        held = isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == BATCH
        return v.tensor_split(micro)[i] if held else v
    if isinstance(inputs, dict):
        return {k: part(v) for k, v in inputs.items()}
    return tuple(part(v) for v in inputs)


def _one_process(model: torch.nn.Module, inputs: Any, target: torch.Tensor, loss_fn: Any,
                 micro: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = _sgd(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i, piece in enumerate(target.tensor_split(micro)):
            given = _cut(inputs, micro, i)
            output = model(**given) if isinstance(given, dict) else model(*given)
            loss = loss_fn(output, piece) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def _microbatch_counts(schedule: str, workers: int) -> list[int]:
    """Counts the schedule's order takes on `workers` that cut BATCH samples."""
    if kind(schedule).chunked:  # rounds of one per worker (zb-h1 too)
        return [m for m in (1, workers, 2 * workers) if BATCH % m == 0 and m <= BATCH]
    return [1, 2, 3]


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    schedule = draw(st.sampled_from(SCHEDULES))
    workers = draw(st.sampled_from([2, 3]))
    return {"name": draw(st.sampled_from(sorted(USER_PATHS))), "schedule": schedule,
            "workers": workers,
            "micro": draw(st.sampled_from(_microbatch_counts(schedule, workers)))}


def _trains_like_one_process(name: str, schedule: str, workers: int, micro: int) -> None:
    model, inputs, target, loss_fn = USER_PATHS[name](BATCH)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=_sgd, stages=workers, schedule=schedule,
                             microbatches=micro, cost="analytic")
    given = (inputs,) if isinstance(inputs, dict) else inputs
    losses = [pipe.step(*given, target=target) for _ in range(STEPS)]
    want, state = _one_process(model, inputs, target, loss_fn, micro)
    assert losses == pytest.approx(want, rel=1e-9, abs=1e-12)
    got = pipe.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-11, msg=key)


def test_gpt2_given_position_ids_of_one_row_trains_like_one_process() -> None:
    _trains_like_one_process("hf-gpt2-positions", "1f1b-flush", 2, 2)


@pytest.mark.slow
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_user_paths_of_third_party_models_train_like_one_process(case: dict[str, Any]) -> None:
    _trains_like_one_process(**case)
