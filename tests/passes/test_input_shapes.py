"""Sizes torch.export keeps free although the model's code tests them beyond a range stay free:
each test is kept (passes/input_shapes.py, `InputShapes.tests`) and evaluated exactly on the
sizes of every microbatch, so that sizes that pass train like the model and others are refused
in words instead of training on a branch the model would not take. Before, the sizes a test
read were fixed at the example's where the test failed at one of a list of tried sizes: a
length tested `% 2 == 0` trained at no other even length, and a test failing only at an untried
size (length 100) went unseen, the pipeline training silently on the other branch there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export.integrity import seal_export
from pdcompile.passes.input_shapes import InputShapes
from pdcompile.pipeline import Pipeline
from tests.helpers.lengths import SGD, plain_step


class Parity(nn.Module):
    """Doubles its output where the sequence length is even; fx cannot trace the `if`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if x.shape[1] % 2 == 0:
            return y * 2
        return y


class NotHundred(Parity):
    """Doubles its output at every length but 100, a length the old sampling never tried."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if x.shape[1] != 100:
            return y * 2
        return y


class Longer(nn.Module):
    """Adds 1 where `z` is more than 3 longer than `x`: two inputs' lengths tested together."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if z.shape[1] > x.shape[1] + 3:
            y = y + 1
        return y * z.mean()


class BatchParity(Parity):
    """Doubles its output where the batch (the microbatch, in a pipeline) is even."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if x.shape[0] % 2 == 0:
            return y * 2
        return y


def mixed_branch(batch: int, length: int) -> bool:
    """The branch `Mixed` takes: one test of the batch and the length together."""
    return (3 * length + batch) % 7 < 3


class Mixed(Parity):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if mixed_branch(x.shape[0], x.shape[1]):
            return y * 2
        return y


class Related(nn.Module):
    """Adds 1 where `z` is 3 longer than the batch: `z`'s size is an expression of `x`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if z.shape[0] == x.shape[0] + 3:
            y = y + 1
        return y * z.mean()


def _square(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def _compile(model: nn.Module, *example: torch.Tensor, micro: int = 2) -> Pipeline:
    torch.manual_seed(0)
    pipe = pdcompile.compile(model, example_inputs=example, loss_fn=_square, optimizer=SGD,
                             schedule="1f1b-flush", microbatches=micro, stages=[1, 1],
                             cost="analytic", frontend="export")
    assert pdcompile.meta.get_frontend(pipe.graph) == "export"
    assert pipe.input_shapes is not None
    return pipe


def _trains_like_the_model(pipe: Pipeline, cls: type[nn.Module], inputs: dict[str, Any],
                           micro: int = 2) -> None:
    """One pipeline step at these sizes equals one step of the model's own forward, cut into
    the same microbatches: the loss and every updated weight."""
    plain = cls()
    plain.load_state_dict(pipe.state_dict())
    shape = pipe.graph(*inputs.values())[0].shape
    target = torch.randn(shape)
    loss = pipe.step(*inputs.values(), target=target)
    want = plain_step(plain, SGD(plain.parameters()), inputs, target, _square, micro)
    sizes = {k: tuple(v.shape) for k, v in inputs.items()}
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-7), sizes
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n} at {sizes}: {m}")


def _refusal(pipe: Pipeline, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> str:
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(PipelineInputError) as info:  # before the target is looked at
        pipe.step(*inputs, target=torch.zeros_like(inputs[0]) if target is None else target)
    for name, value in pipe.state_dict().items():  # refused before any rank started
        torch.testing.assert_close(value, before[name])
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_length_whose_parity_the_model_tests_trains_at_every_length_that_passes() -> None:
    pipe = _compile(Parity(), torch.randn(2, 4, 3))
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(any, any, 3) float32"  # was (any, 4, 3)
    assert pipe.input_shapes.tests == (("==", ("%", "n2", 2), 0),)
    for length in (4, 6, 100):  # 6 and 100 were refused
        _trains_like_the_model(pipe, Parity, {"x": torch.randn(2, length, 3)})
    assert _refusal(pipe, torch.randn(2, 5, 3)) == (
        "minibatch 0: input 'x' is (2, 5, 3) float32 but the model, as torch.export captured "
        "it, runs on (any, any, 3) float32: dimension 1 of 'x' is 5; the model was captured "
        "for sizes where x.shape[1] % 2 == 0, which its code tests: pass sizes where that "
        "holds or compile the pipeline at the sizes to train on")
    assert "dimension 1 of 'x' is 101;" in _refusal(pipe, torch.randn(2, 101, 3))


def test_a_test_failing_only_at_a_size_sampling_never_tried_refuses_that_size() -> None:
    """Before, length 100 trained on the doubled branch the model does not take there."""
    pipe = _compile(NotHundred(), torch.randn(2, 4, 3))
    message = _refusal(pipe, torch.randn(2, 100, 3))
    assert message.endswith("dimension 1 of 'x' is 100; the model was captured for sizes where "
                            "x.shape[1] != 100, which its code tests: pass sizes where that "
                            "holds or compile the pipeline at the sizes to train on")
    for length in (99, 101, 1):
        _trains_like_the_model(pipe, NotHundred, {"x": torch.randn(2, length, 3)})


def test_two_inputs_whose_lengths_are_tested_together_train_where_the_test_holds() -> None:
    pipe = _compile(Longer(), torch.randn(2, 4, 3), torch.randn(2, 9, 3))
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(any, any, 3) float32"
    for x_length, z_length in [(4, 9), (10, 20), (1, 7)]:
        _trains_like_the_model(pipe, Longer, {"x": torch.randn(2, x_length, 3),
                                              "z": torch.randn(2, z_length, 3)})
    assert _refusal(pipe, torch.randn(2, 10, 3), torch.randn(2, 13, 3)).endswith(
        "dimension 1 of 'z' is 13 and dimension 1 of 'x' is 10; the model was captured for "
        "sizes where z.shape[1] > x.shape[1] + 3, which its code tests: pass sizes where that "
        "holds or compile the pipeline at the sizes to train on")


def test_a_batch_test_holds_for_every_microbatch_or_the_minibatch_is_refused() -> None:
    pipe = _compile(BatchParity(), torch.randn(4, 3))  # microbatches of 2: even
    for batch in (4, 8, 12):
        _trains_like_the_model(pipe, BatchParity, {"x": torch.randn(batch, 3)})
    assert _refusal(pipe, torch.randn(6, 3)).endswith(  # even, but its microbatches are odd
        "dimension 0 of 'x' is 3 per microbatch (a minibatch of 6 cut into 2); the model was "
        "captured for sizes where x.shape[0] % 2 == 0, which its code tests: pass sizes where "
        "that holds or compile the pipeline at the sizes to train on")
    assert "dimension 0 of 'x' is 3 per microbatch (a minibatch of 7 cut into 2)" in \
        _refusal(pipe, torch.randn(7, 3))  # the first microbatch, of 4, passes; the last not
    assert "is 1 per microbatch" in _refusal(pipe, torch.randn(2, 3))


def test_the_example_itself_is_refused_where_its_microbatches_fail_a_test() -> None:
    """torch.export captured the whole example (6: even), the graph runs on its microbatches
    (3: odd). Before, a minibatch shaped like the example was not checked and trained on the
    even branch, unlike the model."""
    torch.manual_seed(0)
    x, target = torch.randn(6, 3), torch.randn(6, 3)
    pipe = pdcompile.compile(BatchParity(), example_inputs=(x,), example_target=target,
                             loss_fn=_square, optimizer=SGD, schedule="1f1b-flush",
                             microbatches=2, stages=[1, 1], cost="analytic")
    assert "dimension 0 of 'x' is 3 per microbatch (a minibatch of 6 cut into 2)" in \
        _refusal(pipe, x, target=target)
    _trains_like_the_model(pipe, BatchParity, {"x": torch.randn(8, 3)})


def _microbatch_sizes(batch: int, micro: int) -> list[int]:
    return [len(part) for part in torch.arange(batch).tensor_split(micro)]


@pytest.fixture(scope="module")
def mixed() -> Pipeline:
    return _compile(Mixed(), torch.randn(4, 6, 3))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.integers(1, 40), length=st.integers(1, 300), micro=st.integers(1, 4))
def test_a_minibatch_is_refused_exactly_where_a_microbatch_takes_another_branch(
        mixed: Pipeline, batch: int, length: int, micro: int) -> None:
    shapes = mixed.input_shapes
    assert shapes is not None and len(shapes.tests) == 1
    micro = min(micro, batch)
    x = torch.zeros(batch, length, 3)
    captured = mixed_branch(4, 6)  # the example's branch: torch.export records that one
    differs = any(mixed_branch(size, length) != captured
                  for size in _microbatch_sizes(batch, micro))
    refusal = shapes.refusal({"x": x}, {"x": x.tensor_split(micro)[0]}, microbatches=micro)
    assert (refusal is not None) == differs, (batch, length, micro, refusal)
    if refusal is not None:
        assert refusal.endswith("the model was captured for sizes where "
                                "(x.shape[0] + 3 * x.shape[1]) % 7 < 3, which its code tests: "
                                "pass sizes where that holds or compile the pipeline at the "
                                "sizes to train on"), refusal


def test_a_size_that_is_an_expression_of_another_is_fixed_as_before() -> None:
    pipe = _compile(Related(), torch.randn(2, 3), torch.randn(5), micro=1)
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(2, 3) float32"
    assert pipe.input_shapes.describe("z") == "(5,) float32"
    assert "input 'z'" in _refusal(pipe, torch.randn(2, 3), torch.randn(6))  # no +1 there


class Pooled(nn.Module):
    """Halves the image, mixes its pixels and averages them: torch.export tests the sizes
    (`h // 2 != 1` and the like) without the result depending on them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 2, stride=2)
        self.linear = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        y = y.reshape(b, c, h * w).transpose(1, 2)
        return self.linear(y).mean(1)


def test_tests_that_only_exclude_degenerate_sizes_leave_the_others_free() -> None:
    model = Pooled()
    pipe = _compile(model, torch.randn(2, 3, 8, 8))
    assert pipe.input_shapes is not None
    assert pipe.input_shapes.describe("x") == "(any, 3, any, any) float32"
    bigger = torch.randn(3, 3, 12, 10)
    torch.testing.assert_close(pipe.evaluate(bigger), model(bigger))
    _trains_like_the_model(pipe, Pooled, {"x": torch.randn(5, 3, 6, 14)})
    assert "x.shape[3] // 2 != 1" in _refusal(pipe, torch.randn(2, 3, 8, 3))  # one pixel wide


def test_the_tests_go_through_json_and_old_shapes_without_them_still_read() -> None:
    pipe = _compile(Longer(), torch.randn(2, 4, 3), torch.randn(2, 9, 3))
    shapes = pipe.input_shapes
    assert shapes is not None and shapes.tests
    data = json.loads(json.dumps(shapes.to_json()))
    assert InputShapes.from_json(data) == shapes
    del data["tests"]  # an export written before the tests were kept
    assert InputShapes.from_json(data).tests == ()


def test_an_export_keeps_the_tests_and_refuses_a_hostile_one_in_one_line(
        tmp_path: Path) -> None:
    pipe = _compile(Parity(), torch.randn(2, 4, 3))
    folder = tmp_path / "parity"
    pipe.export(str(folder))
    loaded = pdcompile.load(str(folder))
    assert loaded.input_shapes == pipe.input_shapes
    assert "x.shape[1] % 2 == 0" in _refusal(loaded, torch.randn(2, 7, 3))
    x, target = torch.randn(2, 6, 3), torch.randn(2, 6, 3)
    assert loaded.step(x, target=target) == pytest.approx(pipe.step(x, target=target))

    meta = json.loads((folder / "pipeline.json").read_text())
    deep: Any = "n2"
    for _ in range(200):
        deep = ["+", deep, 1]
    for hostile, reason in [(["==", ["__import__", "os"], 0], "the operation '__import__'"),
                            (["==", ["**", "n2", 10 ** 9], 0], "exponents are integers 0 to 64"),
                            (["==", deep, 0], "nested deeper than 32 operations"),
                            ("__import__('os').system('true')", "is no size of the inputs")]:
        meta["input_shapes"]["tests"] = [hostile]
        (folder / "pipeline.json").write_text(json.dumps(meta))
        seal_export(folder)
        with pytest.raises(DamagedFileError) as info:
            pdcompile.load(str(folder))
        message = str(info.value)
        assert message.startswith(f"{folder / 'pipeline.json'} is altered (input_shapes: "), \
            message
        assert reason in message and "\n" not in message
