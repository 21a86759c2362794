"""Any valid cut of any model trains like one process under every shipped schedule.

A drawn model (a random model of tests/helpers/random_models.py, or a third-party one of
tests/helpers/third_party.py: torchvision, timm, Hugging Face transformers), a drawn valid cut
(a random topological order cut into K stages; replicas where the schedule takes them; 2-3 chunks
per rank on a random permutation of the ranks for the interleaved schedules, a V for ZB-V and
DualPipeV: tests/helpers/schedule_cuts.py), a drawn schedule among all shipped ones but '1f1b'
(GPipe, 1F1B-flush, ZB-H1, interleaved 1F1B and zero bubble, ZB-V, DualPipeV, 2BW) and a
microbatch count its order runs with: three updates give the losses and every parameter and
buffer of single-process training in float64 (gradient accumulation over the same microbatches;
2BW's delayed rule for '2bw'). The flush schedules also leave the gradients of one process.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.plan import Plan
from pdcompile.schedule.kinds import kind
from tests.helpers.random_models import random_models, squared_error
from tests.helpers.schedule_cuts import (
    SCHEDULES,
    Inputs,
    Loss,
    cut_graph,
    delayed_reference,
    fits,
    flush_reference,
    micro_options,
    placed_cut,
)
from tests.helpers.third_party import POOL
from tests.helpers.tied_models import assert_every_copy
from tests.helpers.transparency import momentum, replicated_buffers

STEPS = 3
BATCH = 12  # divides into 1, 2, 3, 4 and 6 microbatches


def _args(inputs: Inputs) -> tuple[Any, ...]:
    return (inputs,) if isinstance(inputs, dict) else tuple(inputs)


def trains_like_one_process(model: torch.nn.Module, inputs: Inputs, target: torch.Tensor,
                            loss_fn: Loss, *, schedule: str, plan: Plan, micro: int) -> None:
    """The pipeline's losses, weights, buffers (and gradients, for flush schedules) after
    STEPS updates equal one process's."""
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule=schedule, microbatches=micro,
                             plan=plan)
    if kind(schedule).flush:
        losses = [pipe.step(*_args(inputs), target=target) for _ in range(STEPS)]
        want, state = flush_reference(model, inputs, target, loss_fn, micro, STEPS, momentum)
    else:
        data = [(inputs, target)] * STEPS
        losses = pipe.train([(_args(inputs), target) for _ in range(STEPS)])
        want, state = delayed_reference(model, data, loss_fn, micro, momentum)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64))
    got = pipe.state_dict()
    assert set(got) == set(state)
    # a replicated stage's BatchNorm statistics are the mean over its replicas of statistics
    # each kept from its own microbatches (README, Limits)
    left_out = replicated_buffers(pipe)
    for name, value in state.items():
        if name in left_out:
            continue
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")
    assert_every_copy(pipe, state, schedule)  # a tied parameter's copies on every chunk too


def _random_model(draw: st.DrawFn) -> tuple[torch.nn.Module, Inputs, torch.Tensor, Loss]:
    model, inputs = draw(random_models())
    torch.manual_seed(draw(st.integers(0, 2**16)))
    xs = tuple(torch.randn(BATCH, *x.shape[1:], dtype=x.dtype) for x in inputs)
    try:  # an in-place change autograd itself refuses, pipelined or not
        squared_error(copy.deepcopy(model)(*xs), torch.zeros(())).backward()
    except RuntimeError as err:
        if "modified by an inplace operation" in str(err):
            reject()
        raise
    target = torch.randn(BATCH, 1, xs[0].shape[-1], dtype=torch.float64)
    return model, xs, target, squared_error


@st.composite
def cases(draw: st.DrawFn, models: tuple[str, ...]) -> dict[str, Any]:
    name = draw(st.sampled_from(models))
    if name == "random":
        model, inputs, target, loss_fn = _random_model(draw)
    else:
        model, inputs, target, loss_fn = POOL[name](BATCH)
    schedule = draw(st.sampled_from(SCHEDULES))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    plan = placed_cut(cut_graph(model, inputs), rng, schedule)
    if not fits(plan, schedule):
        reject()  # too few operations for the chunks
    options = micro_options(schedule, plan, BATCH)
    if not options:
        reject()
    micro = draw(st.sampled_from(options))
    return {"name": name, "model": model, "inputs": inputs, "target": target,
            "loss_fn": loss_fn, "schedule": schedule, "plan": plan, "micro": micro}


def check_case(case: dict[str, Any]) -> None:
    trains_like_one_process(case["model"], case["inputs"], case["target"], case["loss_fn"],
                            schedule=case["schedule"], plan=case["plan"], micro=case["micro"])


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                        HealthCheck.filter_too_much]}


@settings(max_examples=20, **SETTINGS)
@given(cases(("random",)))
def test_random_cuts_of_random_models_under_every_schedule(case: dict[str, Any]) -> None:
    check_case(case)


@pytest.mark.slow
@settings(max_examples=200, **SETTINGS)
@given(cases(("random",)))
def test_random_cuts_of_random_models_under_every_schedule_many(case: dict[str, Any]) -> None:
    check_case(case)


@pytest.mark.slow
@settings(max_examples=60, **SETTINGS)
@given(cases(tuple(POOL)))
def test_random_cuts_of_third_party_models_under_every_schedule(case: dict[str, Any]) -> None:
    check_case(case)
