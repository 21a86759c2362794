"""Random models of unusual but valid structure (tests/helpers/structured_models.py: in-place
chains, a layer called at several depths, buffers changed in forward, integer and bool values
crossing a cut, detach, no_grad, a zero-width slice, dict / tuple / list outputs holding a
parameter as it is, None and numbers, inputs by name with an int and an optional mask, a never
used layer, batch sizes 1 to 8 that the microbatch count need not divide), cut at random, train
as one process does: the same losses and every weight and buffer after two updates (float64;
rel 1e-9 for the losses, torch's float64 tolerance for the state: a pipeline sums microbatch
gradients in another order), or the cut is refused in one PlanError naming what must stay
together. A model that returns its log variances as they are failed on every cut before
(passes/output_constants.py)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.errors import PlanError
from tests.helpers.random_models import random_cut
from tests.helpers.schedule_cuts import cut_graph
from tests.helpers.structured_models import (
    structured_loss,
    structured_models,
    structured_reference,
)
from tests.helpers.transparency import momentum

STEPS = 2


def _check(case: dict[str, Any], seed: int, schedule: str) -> None:
    model, inputs, target, micro = case["model"], case["inputs"], case["target"], case["micro"]
    try:
        want, state = structured_reference(model, inputs, target, micro, STEPS)
    except RuntimeError as err:  # an in-place change autograd refuses in one process too
        if "modified by an inplace operation" in str(err):
            reject()
        raise
    rng = random.Random(seed)
    plan = random_cut(cut_graph(model, inputs), rng, stages=rng.choice([1, 2, 3, 4]),
                      replicas=[1 if case["stateful"] else rng.choice([1, 2])
                                for _ in range(4)])
    try:
        pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs,
                                 loss_fn=structured_loss, optimizer=momentum, schedule=schedule,
                                 microbatches=micro, plan=plan)
    except PlanError as err:  # a changed buffer's nodes that no stage can hold together
        assert "must run in one stage" in str(err), err
        assert "buffer 'running'" in str(err) or "buffer 'count'" in str(err), err
        return
    given_inputs = (inputs,) if isinstance(inputs, dict) else tuple(inputs)
    losses = [pipe.step(*given_inputs, target=target) for _ in range(STEPS)]
    assert losses == pytest.approx(want, rel=1e-9)
    got = pipe.state_dict()
    assert set(got) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                        HealthCheck.filter_too_much]}


@settings(max_examples=25, **SETTINGS)
@given(case=structured_models(), seed=st.integers(0, 2**32 - 1),
       schedule=st.sampled_from(["1f1b-flush", "gpipe"]))
def test_a_random_cut_of_a_structured_model_trains_like_one_process(
        case: dict[str, Any], seed: int, schedule: str) -> None:
    _check(case, seed, schedule)


@pytest.mark.slow
@settings(max_examples=300, **SETTINGS)
@given(case=structured_models(), seed=st.integers(0, 2**32 - 1),
       schedule=st.sampled_from(["1f1b-flush", "gpipe"]))
def test_a_random_cut_of_a_structured_model_trains_like_one_process_many(
        case: dict[str, Any], seed: int, schedule: str) -> None:
    _check(case, seed, schedule)
