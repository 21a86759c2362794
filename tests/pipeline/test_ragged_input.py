"""Minibatches of another shape train, alike on both backends: a short last batch of an epoch,
another sequence length, a count of minibatches that does not complete the replicas' round
(`step` under '1f1b' with replicated stages). A minibatch the model cannot run on is refused in
one line, before any rank starts, with the same message on both backends."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.backends.launch import Worker, launch
from pdcompile.errors import PipelineInputError
from tests.helpers.input_refusal import distributed_refusal

FEATURES = 6


class Tokens(nn.Module):
    """Per-position layers over (batch, length, features): any batch size and length runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def _batch(size: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(size, length, FEATURES, generator=gen),
            torch.randint(0, 3, (size, length), generator=gen))


# (batch size, sequence length) of each minibatch: the example's, another length, a short last
STREAM = [(8, 4), (8, 7), (8, 4), (5, 4)]


def _stream(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_batch(b, t, seed) for seed, (b, t) in enumerate(shapes)]


def _pipeline(schedule: str, stages: list[int], micro: int | None = None) -> Any:
    torch.manual_seed(0)
    x, y = _batch(8, 4, 100)
    return pdcompile.compile(Tokens(), example_inputs=(x,), example_target=y, loss_fn=loss_fn,
                             schedule=schedule, microbatches=micro, stages=stages,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1,
                                                         momentum=0.9))


CASES = [("1f1b-flush", [1, 1], 2, STREAM), ("1f1b", [1, 1], None, STREAM),
         ("gpipe", [1, 1], 3, STREAM),  # 8 and 5 samples in 3 uneven microbatches
         ("1f1b", [2], None, STREAM[:3]),  # 3 minibatches, 2 replicas: the last one in halves
         ("1f1b", [2, 1], None, STREAM[:3]), ("1f1b-flush", [1, 2], 2, STREAM)]


def test_local_backend_trains_a_short_last_batch_as_documented() -> None:
    """Flush schedules: microbatches of a minibatch that does not divide differ by one sample
    and count equally, which is what this plain-PyTorch loop does."""
    pipe = _pipeline("1f1b-flush", [1, 1], micro=2)
    torch.manual_seed(0)
    model = Tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch(5, 4, 7)
    loss = pipe.step(x, target=y)
    parts = [loss_fn(model(xs), ys) for xs, ys in zip(torch.tensor_split(x, 2),
                                                      torch.tensor_split(y, 2), strict=True)]
    want = torch.stack(parts).mean()
    want.backward()
    optimizer.step()
    assert loss == pytest.approx(float(want.detach()), rel=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def test_step_on_replicas_is_one_data_parallel_update() -> None:
    """'1f1b' on config "2": step cuts the minibatch in halves, one per replica; their averaged
    gradients make exactly the update of plain training on the whole minibatch."""
    pipe = _pipeline("1f1b", [2])
    assert pipe.plan.config == "2"
    torch.manual_seed(0)
    model = Tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for seed in range(3):
        x, y = _batch(8, 4, seed)
        loss = pipe.step(x, target=y)
        optimizer.zero_grad()
        want = loss_fn(model(x), y)
        want.backward()
        optimizer.step()
        assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def test_a_minibatch_the_model_cannot_run_on_is_refused_in_one_line() -> None:
    pipe = _pipeline("1f1b", [1, 1])
    with pytest.raises(PipelineInputError) as info:
        pipe.train([_batch(8, 4, 0), (torch.randn(8, 4, FEATURES + 1), _batch(8, 4, 1)[1])])
    message = str(info.value)
    assert message.startswith("minibatch 1: input 'x' is (8, 4, 7) float32 but the pipeline "
                              "was compiled for (8, 4, 6) float32, and the model cannot run on "
                              "it (RuntimeError: "), message
    with pytest.raises(PipelineInputError, match=r"minibatch 0: the target is \(8, 5\) int64 "
                                                 r"but the example's is \(8, 4\) int64, and the "
                                                 r"loss function cannot use it"):
        pipe.train([(_batch(8, 4, 0)[0], torch.randint(0, 3, (8, 5)))])
    with pytest.raises(PipelineInputError, match=r"minibatch 0: input 'x' has batch size 2, too "
                                                 r"small to cut into 3 microbatches"):
        _pipeline("gpipe", [1, 1], micro=3).step(*_batch(2, 4, 0)[:1],
                                                  target=_batch(2, 4, 0)[1])


def _distributed(worker: Worker) -> list[Any]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    out: list[Any] = []
    for schedule, stages, micro, shapes in CASES:
        if sum(stages) != worker.world_size:
            continue
        pipe = _pipeline(schedule, stages, micro)
        data = _stream(shapes) if reads_data(pipe, worker.rank) else None
        run = run_distributed(pipe, data, monitor=worker.monitor)
        out.append((run.losses, run.samples, {k: v.clone() for k, v in
                                              pipe.state_dict().items()}))
    pipe = _pipeline("1f1b-flush", [1] * worker.world_size, 2)
    bad = [_batch(8, 4, 0), (torch.randn(8, 4, FEATURES + 1), _batch(8, 4, 1)[1])]
    out.append(distributed_refusal(pipe, bad, worker))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [2, 3])
def test_distributed_backend_trains_them_like_the_local_one(nproc: int) -> None:
    results = launch(_distributed, nproc, timeout=240)
    cases = [c for c in CASES if sum(c[1]) == nproc]
    for rank, out in enumerate(results):
        for (schedule, stages, micro, shapes), (losses, samples, state) in zip(
                cases, out[:-1], strict=True):
            local = _pipeline(schedule, stages, micro)
            want = local.train(_stream(shapes))
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want),
                                       msg=lambda m, s=schedule: f"{s}: {m}")
            assert samples == sum(b for b, _ in shapes)
            if rank == 0:  # stage 0's weights (the other ranks hold their own stage's)
                for name in state:
                    if name.startswith("inp"):
                        torch.testing.assert_close(state[name], local.state_dict()[name])
        local_error = None
        try:
            _pipeline("1f1b-flush", [1] * nproc, 2).train(
                [_batch(8, 4, 0), (torch.randn(8, 4, FEATURES + 1), _batch(8, 4, 1)[1])])
        except PipelineInputError as err:
            local_error = str(err)
        assert out[-1] == local_error  # the same refusal, on every rank


@settings(max_examples=10, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(2, 5), st.integers(1, 4)), min_size=1, max_size=12))
def test_the_shapes_a_pipeline_remembers_as_checked_are_bounded(
        shapes: list[tuple[int, int]]) -> None:
    """A stream of ever new shapes (sequence lengths) trains alike whether the pipeline
    remembers 2 checked shapes or all of them, and it keeps at most that many: it once kept
    every minibatch shape it ever accepted."""
    from pdcompile import pipeline

    want = _pipeline("1f1b-flush", [1, 1], micro=2).train(_stream(shapes))
    pipe = _pipeline("1f1b-flush", [1, 1], micro=2)
    kept = pipeline.CHECKED_SHAPES_KEPT
    pipeline.CHECKED_SHAPES_KEPT = 2
    try:
        got = pipe.train(_stream(shapes))
    finally:
        pipeline.CHECKED_SHAPES_KEPT = kept
    assert got == pytest.approx(want, rel=1e-6)
    assert len(pipe._checked_shapes) <= 2
