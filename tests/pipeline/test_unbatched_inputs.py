"""Inputs that hold no samples (a 0-d temperature, a mask of fixed shape (seq, seq), per-class
weights (k,)) reach every microbatch whole, by position and by name, and train as one process
does (pdcompile/runtime/microbatch_cut.py); `unbatched=` names one whose first dimension
equals the batch size (k class weights at batch size k), which sizes alone cannot tell.

Before, every tensor of at least one dimension was cut along its first dimension: compile
failed ('The size of tensor a (3) must match the size of tensor b (2)') where the cut sizes
did not fit, and where they did the model computed another function, silently."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from tests.helpers.masked_model import CLASSES, SEQ, Masked, accumulated, sgd

STEPS = 2


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(by_name=st.booleans(), micro=st.integers(1, 2),
       batch=st.sampled_from([SEQ, CLASSES, 6, 7]),
       schedule=st.sampled_from(["1f1b-flush", "gpipe", "zb-h1"]))
def test_inputs_without_samples_reach_every_microbatch_whole(by_name: bool, micro: int,
                                                             batch: int, schedule: str) -> None:
    """At batch size 3 or 4 (the mask's size, the count of classes) the mask or the weights
    are named `unbatched`: sizes alone cannot tell."""
    torch.manual_seed(0)
    model = Masked().double()
    x = torch.randn(batch, SEQ, 5, dtype=torch.float64)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.float64))
    weight = torch.rand(CLASSES, dtype=torch.float64) + 0.5
    temperature = torch.tensor(2.0, dtype=torch.float64)
    y = torch.randn(batch, CLASSES, dtype=torch.float64)
    rest = (mask, weight, temperature)
    inputs: tuple[Any, ...] = ({"x": x, "mask": mask, "weight": weight,
                                "temperature": temperature},) if by_name else (x, *rest)
    pipe = pdcompile.compile(copy.deepcopy(model),
                             example_inputs=inputs[0] if by_name else inputs,
                             loss_fn=F.mse_loss, stages=2, schedule=schedule,
                             microbatches=micro, optimizer=sgd, frontend="fx",
                             unbatched=[name for name, size in (("mask", SEQ),
                                                                ("weight", CLASSES))
                                        if size == batch])
    losses = [pipe.step(*inputs, target=y) for _ in range(STEPS)]
    assert losses == pytest.approx(accumulated(model, [((x, *rest), y)] * STEPS, micro), rel=1e-9)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def test_the_export_front_end_runs_whole_inputs_on_microbatches() -> None:
    """torch.export's shape checks take a whole input's first dimension as it is, not as a
    microbatch's."""
    torch.manual_seed(0)
    model = Masked()
    x, y = torch.randn(6, SEQ, 5), torch.randn(6, CLASSES)
    rest = (torch.tril(torch.ones(SEQ, SEQ)), torch.rand(CLASSES) + 0.5, torch.tensor(2.0))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x, *rest), loss_fn=F.mse_loss,
                             stages=2, schedule="1f1b-flush", microbatches=2, optimizer=sgd,
                             frontend="export")
    losses = [pipe.step(x, *rest, target=y) for _ in range(STEPS)]
    assert losses == pytest.approx(accumulated(model, [((x, *rest), y)] * STEPS, 2), rel=1e-5)


def test_unbatched_is_kept_in_exports_and_names_inputs(tmp_path: Any) -> None:
    """A loaded export cuts as the pipeline did; a name that is no input is refused."""
    torch.manual_seed(0)
    x, y = torch.randn(CLASSES, SEQ, 5), torch.randn(CLASSES, CLASSES)
    rest = (torch.tril(torch.ones(SEQ, SEQ)), torch.rand(CLASSES) + 0.5, torch.tensor(2.0))
    options: dict[str, Any] = {"example_inputs": (x, *rest), "loss_fn": F.mse_loss,
                               "stages": 2, "schedule": "1f1b-flush", "microbatches": 2,
                               "optimizer": sgd, "frontend": "fx"}
    pipe = pdcompile.compile(Masked(), unbatched="weight", **options)
    pipe.export(str(tmp_path / "e"))
    loaded = pdcompile.load(str(tmp_path / "e"))
    assert loaded.unbatched == ("weight",)
    assert loaded.step(x, *rest, target=y) == pipe.step(x, *rest, target=y)
    with pytest.raises(pdcompile.errors.PipelineInputError,
                       match=r"^unbatched=\('wieght',\): 'wieght' is not an input of the model; "
                             r"name the inputs that hold no samples among x, mask, weight, "
                             r"temperature \(e\.g\. unbatched=\('mask',\)\)$"):
        pdcompile.compile(Masked(), unbatched=("wieght",), **options)


class MaskFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, CLASSES)

    def forward(self, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.b(mask @ torch.tanh(self.a(x))).mean(1)


def test_a_whole_input_first_in_the_forward_is_named_with_the_fix() -> None:
    """Its first dimension was taken as the batch size, and the loss function was blamed: 'the
    target is (6, 4) float32, and the loss function cannot use it with the model's output'."""
    torch.manual_seed(0)
    model = MaskFirst()
    mask, x, y = torch.tril(torch.ones(SEQ, SEQ)), torch.randn(6, SEQ, 5), torch.randn(6, CLASSES)
    options: dict[str, Any] = {"example_inputs": (mask, x), "loss_fn": F.mse_loss, "stages": 2,
                               "schedule": "1f1b-flush", "microbatches": 2, "optimizer": sgd}
    pipe = pdcompile.compile(copy.deepcopy(model), **options)
    with pytest.raises(pdcompile.errors.PipelineInputError,
                       match=r"^minibatch 0: input 'mask' comes first, so its first dimension "
                             r"\(3\) was taken as the batch size, but the target and input 'x' "
                             r"hold 6 samples; if 'mask' holds no samples, compile with "
                             r"unbatched=\('mask',\)$"):
        pipe.step(mask, x, target=y)
    named = pdcompile.compile(copy.deepcopy(model), unbatched=("mask",), **options)
    loss = named.step(mask, x, target=y)
    want = sum(F.mse_loss(model(mask, xs), ys).item() / 2
               for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True))
    assert loss == pytest.approx(want, rel=1e-6)


def test_a_short_last_batch_of_a_masks_size_leaves_the_mask_whole() -> None:
    """The example shows which inputs hold samples: a last batch of 3 samples (the mask's
    size) once cut the (3, 3) mask too, silently."""
    torch.manual_seed(0)
    model = Masked().double()
    rest = (torch.tril(torch.ones(SEQ, SEQ, dtype=torch.float64)),
            torch.rand(CLASSES, dtype=torch.float64) + 0.5, torch.tensor(2.0, dtype=torch.float64))
    x, y = torch.randn(6 + SEQ, SEQ, 5, dtype=torch.float64), torch.randn(6 + SEQ, CLASSES,
                                                                          dtype=torch.float64)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x[:6], *rest),
                             loss_fn=F.mse_loss, stages=2, schedule="1f1b-flush",
                             microbatches=3, optimizer=sgd, frontend="fx")
    assert pipe.whole_inputs == ("mask", "weight")
    losses = pipe.train([((x[:6], *rest), y[:6]), ((x[6:], *rest), y[6:])])
    opt = sgd(model.parameters())
    want = []
    for xs, ys in ((x[:6], y[:6]), (x[6:], y[6:])):
        opt.zero_grad()
        total = 0.0
        for xp, yp in zip(xs.tensor_split(3), ys.tensor_split(3), strict=True):
            loss = F.mse_loss(model(xp, *rest), yp) / 3
            loss.backward()
            total += loss.item()
        opt.step()
        want.append(total)
    assert losses == pytest.approx(want, rel=1e-9)


def test_unbatched_none_means_no_input_named() -> None:
    """None reads as the other options' "nothing given" (it was refused as an input's name)."""
    x, y = torch.randn(6, SEQ, 5), torch.randn(6, CLASSES)
    rest = (torch.tril(torch.ones(SEQ, SEQ)), torch.rand(CLASSES) + 0.5, torch.tensor(2.0))
    pipe = pdcompile.compile(Masked(), example_inputs=(x, *rest), loss_fn=F.mse_loss, stages=2,
                             microbatches=2, optimizer=sgd, unbatched=None)
    assert pipe.unbatched == () and set(pipe.whole_inputs) == {"mask", "weight"}
    assert pipe.step(x, *rest, target=y) > 0
