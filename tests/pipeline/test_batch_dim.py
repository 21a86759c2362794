"""compile(batch_dim=): models whose samples are not along dimension 0 (sequence-first
`nn.TransformerEncoder` and `nn.LSTM`, fed (seq, batch, ...)) are cut along their batch
dimension into microbatches and replicas' pieces, and train as one process does; without it,
compile refuses such a model where it would cut its inputs (passes/batch_check.py).

Before, every input was cut along dimension 0, the sequence: attention and recurrence saw a
piece of each sequence, and the pipeline trained another function without a word."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.runtime import microbatch_cut
from tests.helpers.seq_first_models import MODELS, fresh, minibatches, one_process, sgd

BATCH, STEPS, MICRO = 8, 2, 2

# (schedule, replicas per stage, one process's pieces per minibatch, trained by step())
LAYOUTS = {
    "flush, replicated stage 0": ("1f1b-flush", [2, 1], 2 * MICRO, False),
    "1f1b, replicated stages": ("1f1b", [2, 2], 2, True),
}


def _compile(name: str, schedule: str, stages: list[int], **options: object
             ) -> pdcompile.pipeline.Pipeline:
    (x, y), = minibatches(name, BATCH, 1)
    return pdcompile.compile(fresh(name), example_inputs=(x,), example_target=y,
                             loss_fn=MODELS[name][1], optimizer=sgd, schedule=schedule,
                             microbatches=MICRO if schedule != "1f1b" else None,
                             stages=stages, **options)


def _train(pipe: pdcompile.pipeline.Pipeline, batches: list, by_step: bool) -> list[float]:
    if by_step:  # each minibatch its own run: cut into one piece per replica
        return [pipe.step(x, target=y) for x, y in batches]
    return pipe.train(batches)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sequence_first_models_train_as_one_process(name: str, layout: str) -> None:
    schedule, stages, parts, by_step = LAYOUTS[layout]
    pipe = _compile(name, schedule, stages, batch_dim=1)
    batches = minibatches(name, BATCH, STEPS)
    losses = _train(pipe, batches, by_step)
    want, state = one_process(name, batches, parts)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for key, value in state.items():
        torch.testing.assert_close(pipe.state_dict()[key], value, msg=key)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_default_refuses_a_sequence_first_model(name: str) -> None:
    with pytest.raises(PipelineInputError) as err:
        _compile(name, "1f1b-flush", [1, 1])
    message = str(err.value)
    assert "mixes the rows of dimension 0 of input" in message and "sequence-first" in message
    assert "batch_dim=1" in message and "unbatched=(" in message
    assert message.count("\n") == 0


def test_the_check_waits_for_a_pipeline_that_cuts() -> None:
    """Under '1f1b' without replicas a minibatch is never cut: nothing to refuse."""
    pipe = _compile("lstm", "1f1b", [1, 1])
    assert not pipe.batch_dims.given
    (x, y), = minibatches("lstm", BATCH, 1)
    assert pipe.step(x, target=y) == pytest.approx(F.mse_loss(fresh("lstm")(x), y).item())


def test_batch_first_models_pass_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """BatchNorm and dropout in training mode mix or draw per minibatch: the check runs in eval
    mode, where they do not, and does not refuse them."""
    from pdcompile.passes import batch_check

    checked: list[object] = []
    real = batch_check.check_samples_apart
    monkeypatch.setattr(batch_check, "check_samples_apart",
                        lambda model, *rest: (checked.append(model), real(model, *rest)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.ReLU(),
                          nn.Linear(6, 2))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 4),), loss_fn=F.mse_loss,
                             schedule="1f1b-flush", microbatches=2, stages=[1, 1])
    assert checked == [model] and model.training and pipe.per_minibatch == 2


def test_export_keeps_the_batch_dimension(tmp_path: Path) -> None:
    pipe = _compile("transformer", "1f1b-flush", [2, 1], batch_dim=1)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"), loss_fn=MODELS["transformer"][1],
                            optimizer=sgd)
    assert loaded.batch_dims == pipe.batch_dims == microbatch_cut.BatchDims(1, {}, 1, True)
    batches = minibatches("transformer", BATCH, STEPS)
    torch.testing.assert_close(torch.tensor(loaded.train(batches)),
                               torch.tensor(pipe.train(batches)))


def test_bad_batch_dims_are_refused_in_one_line() -> None:
    for options, words in [({"batch_dim": -1}, "batch_dim=-1: give the dimension"),
                           ({"batch_dim": {"src": 1}}, "'src' is not an input of the model"),
                           ({"batch_dim": 1, "target_batch_dim": "1"},
                            "target_batch_dim='1': give the dimension")]:
        with pytest.raises(PipelineInputError, match=words):
            _compile("lstm", "1f1b-flush", [1, 1], **options)
    pipe = _compile("lstm", "1f1b-flush", [1, 1], batch_dim=1, target_batch_dim=1)
    x, _ = minibatches("lstm", BATCH, 1)[0]
    with pytest.raises(PipelineInputError, match="target has shape \\(8,\\), which has no "
                                                 "dimension 1.*target_batch_dim=0"):
        pipe.step(x, target=torch.zeros(BATCH))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * mask


@pytest.mark.parametrize(("options", "words"), [
    ({"batch_dim": 2}, r"batch_dim=2: no input has dimension 2 \(x \(8, 4\), mask \(8, 3\)\)"),
    ({"batch_dim": {"mask": 2}}, r"batch_dim\['mask'\]=2: input 'mask' has shape \(8, 3\), "
                                 r"which has no dimension 2; .*unbatched=\('mask',\)"),
    ({"target_batch_dim": 1}, r"target_batch_dim=1: the example target has shape \(8,\), which "
                              "has no dimension 1"),
])
def test_a_batch_dimension_the_example_lacks_is_refused_at_compile(
        options: dict[str, object], words: str) -> None:
    """A dimension no input has (or that the named input or the example target lacks): before,
    such an input went whole to every microbatch without a word (a mask the user meant to
    cut), and the error, if any, came at the first step in the loss function's words."""
    x, mask, y = torch.randn(BATCH, 4), torch.ones(BATCH, 3), torch.randint(0, 3, (BATCH,))
    with pytest.raises(PipelineInputError, match=words):
        pdcompile.compile(_Scaled(), example_inputs=(x, mask), example_target=y,
                          loss_fn=F.cross_entropy, optimizer=sgd, schedule="1f1b-flush",
                          microbatches=MICRO, stages=[1, 1], **options)


class _MixesAllButOne(nn.Module):
    """Normalises over every dimension but `dim` (which holds the samples): cut along any other
    dimension, a piece's output differs from the whole's."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.others = [d for d in range(3) if d != dim]
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale) / x.abs().sum(self.others, keepdim=True) * (
            weight.softmax(0) @ weight)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dim=st.integers(0, 2), micro=st.integers(1, 2), batch=st.integers(2, 7),
       by_name=st.booleans())
def test_any_batch_dimension_trains_as_one_process(dim: int, micro: int, batch: int,
                                                   by_name: bool) -> None:
    """A model that mixes every dimension but its batch dimension `dim`, with a whole (2,)
    input beside it (named `unbatched` at batch size 2), given `batch_dim={'x': dim}` and its
    target's: microbatches of unequal sizes each count equally, as in one process's
    accumulation over the same pieces."""
    shape = [2, 2, 2]
    shape[dim] = batch
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    weight = torch.rand(2, generator=gen, dtype=torch.float64) + 0.5
    y = torch.randn(*shape, generator=gen, dtype=torch.float64)
    inputs = ({"x": x, "weight": weight},) if by_name else (x, weight)
    pipe = pdcompile.compile(_MixesAllButOne(dim), example_inputs=inputs[0] if by_name else
                             inputs, loss_fn=F.mse_loss,
                             optimizer=sgd, schedule="gpipe", microbatches=micro, stages=[1],
                             batch_dim={"x": dim}, target_batch_dim=dim,
                             unbatched=("weight",) if batch == 2 else ())
    assert pipe.samples(inputs) == batch
    parts = microbatch_cut.cut_inputs({"x": x, "weight": weight}, micro, index=0,
                                      why="microbatches", whole=pipe.whole_inputs,
                                      dims=pipe.batch_dims)
    assert torch.equal(torch.cat([p["x"] for p in parts], dim), x)
    assert all(p["weight"] is weight for p in parts)
    assert torch.equal(microbatch_cut.first_microbatch(
        {"x": x, "weight": weight}, micro, pipe.whole_inputs, pipe.batch_dims)["x"],
        parts[0]["x"])
    loss = pipe.step(*inputs, target=y)
    model = _MixesAllButOne(dim)
    want = sum(F.mse_loss(model(p["x"], weight), t) for p, t in
               zip(parts, y.tensor_split(micro, dim), strict=True)) / micro
    want.backward()
    assert loss == pytest.approx(want.item())
    torch.testing.assert_close(pipe.state_dict()["scale"],
                               (model.scale - 0.1 * model.scale.grad).detach())
