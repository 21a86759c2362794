"""Pipeline.train reads its stream as it needs it: an endless iterator trains `steps`
minibatches and is read no further; an asynchronous stream longer than a window trains as runs
of one window (the same runs the distributed backend trains); bad minibatches are one line."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.runtime import stream_window

WIDTH, BATCH = 6, 4


def _pipe(schedule: str, *, target: bool = True) -> tuple[Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 3))
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 3, (BATCH,))
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y if target else None,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             schedule=schedule, microbatches=2, stages=[1, 1])
    return pipe, x, y


def _endless(read: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    for i in itertools.count():
        read.append(i)
        yield torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,),
                                                                       generator=gen)


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-flush", "2bw"])
def test_an_endless_stream_trains_steps_and_is_read_no_further(schedule: str) -> None:
    pipe, _, _ = _pipe(schedule)
    read: list[int] = []
    losses = pipe.train(_endless(read), steps=7)
    assert len(losses) == 7 and len(read) == 7


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_an_async_stream_trains_as_runs_of_one_window(schedule: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    data = list(itertools.islice(_endless([]), 10))
    monkeypatch.setattr(stream_window, "WINDOW", 4)
    streamed, _, _ = _pipe(schedule)
    got = streamed.train(iter(data))
    by_hand, _, _ = _pipe(schedule)
    want = [loss for k in range(0, 10, 4) for loss in by_hand.train(data[k:k + 4])]
    assert got == want
    monkeypatch.setattr(stream_window, "WINDOW", 1024)
    whole, _, _ = _pipe(schedule)
    assert whole.train(data) != got  # draining every 4 minibatches does change the losses


def test_a_bad_target_is_one_line_and_not_kept_as_the_example() -> None:
    pipe, x, y = _pipe("1f1b", target=False)
    with pytest.raises(PipelineInputError, match=r"minibatch 0: the target is \(4,\) float32.*"
                                                  "loss function cannot use it"):
        pipe.step(x, target=torch.randn(BATCH))
    with pytest.raises(PipelineInputError, match=r"minibatch 0: the target is \(3,\) int64.*"
                                                  "loss function cannot use it"):
        pipe.step(x, target=y[:3])
    assert pipe.example_target is None  # neither was kept
    pipe.step(x, target=y)
    assert torch.equal(pipe.example_target, y)


def test_a_minibatch_that_is_not_a_pair_is_one_line() -> None:
    pipe, x, _ = _pipe("1f1b")
    with pytest.raises(PipelineInputError, match="minibatch 0 is a Tensor, not a pair"):
        pipe.train([x])


@pytest.mark.parametrize(("stream", "steps", "message"), [
    ("pairs", "3", r"^train\(steps='3'\): give a whole number of minibatches >= 0, or None"),
    ("pairs", -1, r"^train\(steps=-1\): give"),  # trained nothing and returned []
    ("pairs", 2.0, r"^train\(steps=2\.0\): give"),
    (None, None, r"^train\(\) takes an iterable of \(inputs, target\) minibatches, got "
                 r"NoneType; e\.g\. pipe\.train\(\[\(x, y\)\]\)"),
    ("tensor", None, r"^train\(\) takes an iterable .* got Tensor"),  # its rows, one by one
])
def test_a_stream_or_step_count_of_the_wrong_kind_is_one_line(stream: str | None, steps: Any,
                                                              message: str) -> None:
    """steps='3' and a stream of None were raw TypeErrors from inside train()."""
    pipe, x, y = _pipe("1f1b")
    given = {"pairs": [(x, y)], "tensor": x, None: None}[stream]
    with pytest.raises(PipelineInputError, match=message):
        pipe.train(given, steps=steps)  # type: ignore[arg-type]
