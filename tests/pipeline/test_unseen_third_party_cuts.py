"""Random valid cuts of third-party models no other test draws (tests/helpers/
third_party_unseen.py: torchvision ConvNeXt, EfficientNet, RegNet, ViT, ShuffleNetV2, MNASNet,
Swin, MaxViT, Inception v3; Hugging Face Falcon, OPT, Phi, Gemma 2, Mamba, FNet, XLNet,
DeBERTa-v2, MobileBERT, GPT-NeoX, Funnel, ConvBERT, Whisper's encoder, BLOOM) train as
one process does: on the local backend a drawn cut of 2-4 stages with replicas (losses and
every weight, buffers of replicated stages aside), and on two gloo processes a drawn cut of
two stages, or one stage on both (losses), two updates of 1F1B-flush over 2 microbatches."""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.worker import train_processes
from tests.helpers.random_models import random_cut
from tests.helpers.schedule_cuts import cut_graph, flush_reference
from tests.helpers.third_party_unseen import UNSEEN, repeated_unseen
from tests.helpers.transparency import momentum, replicated_buffers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BATCH, MICRO, STEPS = 4, 2, 2

# Losses agree to float64's rounding, except where the model computes in float32 whatever its
# weights' dtype: transformers' Mamba runs its selective scan on `.float()` copies, so a
# replicated stage's smaller microbatch rounds its loss to another float32 neighbour (1 ulp).
LOSS_RTOL = {"hf-mamba": 3e-7}


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_a_random_cut_trains_like_one_process(name: str, seed: int) -> None:
    model, inputs, target, loss_fn = UNSEEN[name](BATCH)
    rng = random.Random(seed)
    plan = random_cut(cut_graph(model, inputs), rng, stages=rng.choice([2, 3, 4]),
                      replicas=[rng.choice([1, 2]) for _ in range(4)])
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule="1f1b-flush", microbatches=MICRO,
                             plan=plan)
    given_inputs = (inputs,) if isinstance(inputs, dict) else tuple(inputs)
    losses = [pipe.step(*given_inputs, target=target) for _ in range(STEPS)]
    want, state = flush_reference(model, inputs, target, loss_fn, MICRO, STEPS, momentum)
    assert losses == pytest.approx(want, rel=LOSS_RTOL.get(name, 1e-9))
    got, left_out = pipe.state_dict(), replicated_buffers(pipe)
    assert set(got) == set(state)
    for key, value in state.items():
        if key not in left_out:
            torch.testing.assert_close(got[key], value, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_a_random_cut_trains_on_two_processes_like_one(name: str, tmp_path: Path) -> None:
    model, inputs, target, loss_fn = UNSEEN[name](BATCH)
    rng = random.Random(name)
    two = rng.random() < 0.75
    plan = random_cut(cut_graph(model, inputs), rng, stages=2 if two else 1,
                      replicas=[1, 1] if two else [2])
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule="1f1b-flush", microbatches=MICRO,
                             plan=plan)
    pipe.export(str(tmp_path / "pipe"))
    run = train_processes(tmp_path / "pipe", 2,
                          functools.partial(repeated_unseen, name, BATCH, STEPS),
                          steps=STEPS, timeout=300)
    want, _ = flush_reference(model, inputs, target, loss_fn, MICRO, STEPS, momentum)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(want))
