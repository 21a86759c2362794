"""Inputs shaped as users write them: an optional input given as None (`forward(x, mask=None)`
called with `(x, None)`), a list of tensors, a dict target. Each trains as one process does;
a minibatch that gives None where the example gave a value (or the other way) is refused.

Before: fx traced `mask` as a value, so `if mask is not None` took the branch and the graph
multiplied by None; a list input was handed whole to every microbatch (a loud shape error);
a dict target was not cut into microbatches."""

from __future__ import annotations

import copy
import re
from collections import UserDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import PipelineInputError, TraceError

MICRO, STEPS = 2, 2


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if mask is not None:
            h = h * mask
        return self.b(h)


class ListInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.a(xs[0]) + xs[1])
        return {"y": self.b(h), "h": h}


def _dict_loss(output: dict[str, torch.Tensor], target: dict[str, torch.Tensor]
               ) -> torch.Tensor:
    return nn.functional.mse_loss(output["y"], target["y"]) + output["h"].pow(2).mean() * \
        target["weight"].mean()


def _one_process(model: nn.Module, inputs: tuple[Any, ...], target: Any,
                 loss_fn: Callable[..., torch.Tensor], cut: Callable[[Any, int], Any]
                 ) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i in range(MICRO):
            loss = loss_fn(model(*cut(inputs, i)), cut(target, i)) / MICRO
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def _half(value: Any, i: int) -> Any:
    """Microbatch i of 2 of any structure of tensors."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda v: v.chunk(MICRO)[i] if isinstance(v, torch.Tensor) else v,
                           value)


def _trains_like_one_process(model: nn.Module, inputs: tuple[Any, ...], target: Any,
                             loss_fn: Callable[..., torch.Tensor], frontend: str
                             ) -> pdcompile.pipeline.Pipeline:
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             stages=2, schedule="1f1b-flush", microbatches=MICRO,
                             frontend=frontend, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    losses = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    want = _one_process(model, inputs, target, loss_fn, _half)
    assert losses == pytest.approx(want, rel=1e-5)
    return pipe


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_an_input_given_as_none_trains_and_a_value_for_it_is_refused(frontend: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe = _trains_like_one_process(OptionalMask(), (x, None), y, nn.functional.mse_loss,
                                    frontend)
    assert pipe.parts.data_inputs == ("x", "mask")
    with pytest.raises(PipelineInputError, match="input 'mask' is a value, but example_inputs "
                                                 "gave None"):
        pipe.step(x, torch.ones(8, 4), target=y)
    masked = _trains_like_one_process(OptionalMask(), (x, torch.rand(8, 4)), y,
                                      nn.functional.mse_loss, frontend)
    with pytest.raises(PipelineInputError, match="input 'mask' is None, but example_inputs "
                                                 "gave a value"):
        masked.step(x, None, target=y)


def test_a_list_input_and_a_dict_target_are_cut_into_microbatches() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    target = {"y": torch.randn(8, 2), "weight": torch.rand(8)}
    _trains_like_one_process(ListInput(), ([x, x * 2],), target, _dict_loss, "fx")
    with pytest.raises(TraceError, match="input 'xs' of ListInput is a list of tensors"):
        pdcompile.compile(ListInput(), example_inputs=([x, x * 2],), stages=2,
                          frontend="export")


class DictInput(nn.Module):
    """A forward of one dict (a data loader's batch), as Lightning-style models take it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.b(torch.tanh(self.a(batch["x"])) * batch["scale"])


def test_a_model_of_one_dict_input_trains_and_evaluates() -> None:
    """The dict was read as inputs by name: 'the model takes the inputs batch; got x, scale by
    name', at compile."""
    torch.manual_seed(0)
    model = DictInput()
    batch = {"x": torch.randn(8, 4), "scale": torch.rand(8, 4)}
    pipe = _trains_like_one_process(model, (batch,), torch.randn(8, 2), nn.functional.mse_loss,
                                    "fx")
    torch.testing.assert_close(pipe.evaluate(batch), pipe({"batch": batch}))


class Encoding(UserDict):  # type: ignore[type-arg]
    """A mapping that is no dict, as a tokenizer's BatchEncoding is."""


def test_inputs_by_name_in_a_mapping_that_is_no_dict_train_as_a_dict_does() -> None:
    """compile took a BatchEncoding by name, and step, train, evaluate and __call__ refused
    it: 'the model takes 2 inputs (x, mask), got 1; pass them positionally'."""
    torch.manual_seed(0)
    x, mask, y = torch.randn(8, 4), torch.rand(8, 4), torch.randn(8, 2)
    pipes = []
    for inputs in (Encoding(x=x, mask=mask), {"x": x, "mask": mask}):
        torch.manual_seed(0)
        pipe = pdcompile.compile(OptionalMask(), example_inputs=inputs, stages=2,
                                 loss_fn=nn.functional.mse_loss, schedule="1f1b-flush",
                                 microbatches=MICRO)
        pipe.train([(inputs, y)])
        pipes.append((pipe, pipe.step(inputs, target=y), pipe.evaluate(inputs), pipe(inputs)))
    (mapped, *got), (plain, *want) = pipes
    assert got[0] == want[0]
    torch.testing.assert_close(got[1:], want[1:])
    torch.testing.assert_close(mapped.state_dict(), plain.state_dict())


class IgnoresAnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_an_input_forward_ignores_is_not_a_stage_of_its_own() -> None:
    """The planner once put the ignored input's placeholder alone in a stage ("stages [1] of
    the plan have no operation to run")."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    _trains_like_one_process(IgnoresAnInput(), (x, torch.zeros(8, 3)), y,
                             nn.functional.mse_loss, "fx")


def test_a_dict_minibatch_is_refused_saying_how_to_split_it() -> None:
    """A Hugging Face style batch {"input_ids": ..., "labels": ...} once unpacked into its two
    key names, and the model was handed the string 'input_ids'."""
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = nn.Embedding(20, 8), nn.Linear(8, 20)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.embed(input_ids)))

    ids = torch.randint(0, 20, (4, 5))
    pipe = pdcompile.compile(Tokens(), example_inputs={"input_ids": ids}, stages=2,
                             loss_fn=lambda o, t: nn.functional.cross_entropy(
                                 o.reshape(-1, 20), t.reshape(-1)),
                             schedule="1f1b-flush", microbatches=2)
    with pytest.raises(PipelineInputError, match=re.escape(
            "minibatch 0 is a dict (keys input_ids, labels), not a pair (inputs, target); "
            "yield ({'input_ids': batch['input_ids']}, batch['labels'])")):
        pipe.train([{"input_ids": ids, "labels": ids}])
