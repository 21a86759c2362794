"""Variable-length batches through the torch.export front end: a pipeline compiled at one length
and batch size trains at others, equal to plain training; a minibatch the recorded graph cannot
run on is refused before any rank starts, naming the expected and the given shapes (also after
an export and load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.meta import get_frontend
from pdcompile.passes.input_shapes import InputShapes
from tests.helpers import lengths
from tests.helpers.lengths import POSITIONS, SGD, VOCAB, TinyLM, plain_step, tokens


def _plain_copy(pipe: pdcompile.pipeline.Pipeline) -> tuple[TinyLM, torch.optim.Optimizer]:
    """A plain TinyLM holding the pipeline's current weights, and its optimizer."""
    model = TinyLM()
    model.load_state_dict(pipe.state_dict())
    return model, SGD(model.parameters())


def _assert_same_step(pipe: pdcompile.pipeline.Pipeline, ids: torch.Tensor, target: torch.Tensor,
                      micro: int) -> None:
    """One step of the pipeline equals one plain step from the same weights: loss, grads and
    the updated weights."""
    model, optimizer = _plain_copy(pipe)
    loss = pipe.step(ids, target=target)
    want = plain_step(model, optimizer, {"ids": ids}, target, lengths.next_token_loss, micro)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-6), tuple(ids.shape)
    params = pipe.named_parameters()
    for name, param in model.named_parameters():
        assert param.grad is not None and params[name].grad is not None, name
        torch.testing.assert_close(params[name].grad, param.grad, atol=1e-6, rtol=1e-5,
                                   msg=lambda m, n=name: f"grad of {n} at {tuple(ids.shape)}: {m}")
    state = pipe.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5)


def test_a_model_only_export_captures_trains_at_any_length_and_batch_size() -> None:
    pipe = lengths.tiny_pipeline(micro=2)
    assert get_frontend(pipe.graph) == "export"
    with pytest.raises(pdcompile.errors.TraceError):  # fx cannot slice by a traced length
        pdcompile.compile(TinyLM(), example_inputs=(tokens(4, 8, 0)[0],), stages=[1, 1],
                          frontend="fx")
    for batch, length in [(4, 5), (4, 13), (6, 8), (3, 13), (7, 1), (4, 8)]:
        _assert_same_step(pipe, *tokens(batch, length, batch * 100 + length), micro=2)

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(batch=st.integers(2, 9), length=st.integers(1, POSITIONS), seed=st.integers(0, 99))
    def drawn(batch: int, length: int, seed: int) -> None:
        _assert_same_step(pipe, *tokens(batch, length, seed), micro=2)

    drawn()


def test_a_stream_of_shapes_trains_like_plain_training_on_three_stages() -> None:
    pipe = lengths.tiny_pipeline(schedule="gpipe", micro=3, stages=[1, 1, 1])
    model, optimizer = _plain_copy(pipe)
    data = lengths.stream([(6, 5), (3, 13), (9, 8), (5, 20)])  # 5 samples: microbatches of 2, 2, 1
    losses = pipe.train(data)
    want = [plain_step(model, optimizer, {"ids": ids}, y, lengths.next_token_loss, 3)
            for ids, y in data]
    assert losses == pytest.approx(want, rel=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, atol=1e-6, rtol=1e-5)


def _refusal(pipe: pdcompile.pipeline.Pipeline, *inputs: Any, target: Any) -> str:
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(PipelineInputError) as info:
        pipe.step(*inputs, target=target)
    for name, value in pipe.state_dict().items():  # refused before any rank started
        torch.testing.assert_close(value, before[name])
    return str(info.value)


def test_an_input_the_recorded_graph_cannot_run_on_is_refused_naming_both_shapes() -> None:
    pipe = lengths.tiny_pipeline()
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("ids") == f"(any, 1..{POSITIONS}) int64"
    too_long, target = tokens(4, POSITIONS + 8, 0)
    assert _refusal(pipe, too_long, target=target) == (
        f"minibatch 0: input 'ids' is (4, {POSITIONS + 8}) int64 but the model, as "
        f"torch.export captured it, runs on (any, 1..{POSITIONS}) int64: dimension 1 must be 1 "
        f"to {POSITIONS} (the model's limit)")
    three = torch.randint(0, VOCAB, (4, 8, 2))
    assert _refusal(pipe, three, target=target).endswith(
        "input 'ids' is (4, 8, 2) int64 but the model, as torch.export captured it, runs on "
        f"(any, 1..{POSITIONS}) int64: give it 2 dimensions, not 3")
    floats = torch.rand(4, 8)
    assert _refusal(pipe, floats, target=target).endswith(
        "input 'ids' is (4, 8) float32 but the model, as torch.export captured it, runs on "
        f"(any, 1..{POSITIONS}) int64: convert it with .to(torch.int64)")
    _assert_same_step(pipe, *tokens(4, 13, 1), micro=2)  # and trains on after refusing


class Branching(TinyLM):
    """Depends on its length in Python: torch.export fixes the length at the example's."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * 2 if ids.shape[1] == 8 else out


class IntChecked(TinyLM):
    """Refuses a symbolic length: torch.export captures it only with the batch free."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids.shape[1], int):
            raise TypeError("the length must be a Python int")
        return super().forward(ids)


@pytest.mark.parametrize("cls", [Branching, IntChecked])
def test_a_length_the_model_depends_on_stays_fixed_and_others_are_refused(cls: type) -> None:
    torch.manual_seed(0)
    ids, target = tokens(4, 8, 0)
    pipe = pdcompile.compile(cls(), example_inputs=(ids,), loss_fn=lengths.next_token_loss,
                             optimizer=SGD, schedule="1f1b-flush", microbatches=2,
                             stages=[1, 1], cost="analytic")
    assert get_frontend(pipe.graph) == "export"
    assert pipe.input_shapes is not None and pipe.input_shapes.describe("ids") == "(any, 8) int64"
    plain = cls()
    plain.load_state_dict(pipe.state_dict())
    for batch in (6, 3):  # the batch stays free
        more, more_target = tokens(batch, 8, batch)
        loss = pipe.step(more, target=more_target)
        assert loss == pytest.approx(plain_step(plain, SGD(plain.parameters()), {"ids": more},
                                                more_target, lengths.next_token_loss, 2), rel=1e-5)
    short, short_target = tokens(4, 5, 0)  # would silently skip Branching's doubling
    assert _refusal(pipe, short, target=short_target) == (
        "minibatch 0: input 'ids' is (4, 5) int64 but the model, as torch.export captured it, "
        "runs on (any, 8) int64: the model's code depends on the size of dimension 1, so "
        "torch.export fixed it at 8; pass that size or compile the pipeline at the size to "
        "train on")


class Keyed(nn.Module):
    """fx traces it; inputs go by name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * mask.unsqueeze(-1))


def test_inputs_given_by_name_are_named_with_their_shapes_when_refused() -> None:
    ids, target = tokens(4, 8, 0)
    pipe = pdcompile.compile(Keyed(), example_inputs={"ids": ids, "mask": torch.ones(4, 8)},
                             loss_fn=lengths.next_token_loss, optimizer=SGD, schedule="1f1b-flush",
                             microbatches=2, stages=[1, 1], cost="analytic")
    assert get_frontend(pipe.graph) == "fx" and pipe.input_shapes is None
    message = _refusal(pipe, {"ids": ids, "mask": torch.ones(4, 8, 3)}, target=target)
    assert message.startswith("minibatch 0: input 'mask' is (4, 8, 3) float32 but the pipeline "
                              "was compiled for (4, 8) float32, and the model cannot run on it "
                              "(RuntimeError: "), message
    short, short_target = tokens(4, 5, 1)  # the fx graph runs at any length
    pipe.step({"ids": short, "mask": torch.ones(4, 5)}, target=short_target)


def test_an_export_and_load_keeps_training_at_new_lengths(tmp_path: Path) -> None:
    pipe = lengths.tiny_pipeline()
    pipe.export(str(tmp_path / "tiny"))
    loaded = pdcompile.load(str(tmp_path / "tiny"))
    assert loaded.input_shapes == pipe.input_shapes
    assert InputShapes.from_json(pipe.input_shapes.to_json()) == pipe.input_shapes
    data = lengths.stream([(4, 5), (6, 13), (4, 8)])
    assert loaded.train(data) == pytest.approx(pipe.train(data), rel=1e-6)
    too_long, target = tokens(4, POSITIONS + 1, 0)
    assert _refusal(loaded, too_long, target=target) == _refusal(pipe, too_long, target=target)
