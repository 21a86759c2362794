"""A finished run holds none of its minibatches: `Pipeline.last_runtimes` stays inspectable
(weight versions, stash) but no longer keeps the run's data and messages alive until the next
run. Before, the last window of an asynchronous stream (up to 1,024 minibatches or 256 MiB)
stayed in memory after `train` returned, and the memory a long run of growing shapes held grew
with its last window's shapes."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.schedule.kinds import kind


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-flush", "2bw", "interleaved-1f1b", "zb-v"])
def test_the_runs_minibatches_are_released_when_train_returns(schedule: str) -> None:
    torch.manual_seed(0)
    chunked = kind(schedule).interleaved
    layers = [m for _ in range(3 if chunked else 1) for m in (nn.Linear(6, 6), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(6, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, cost="analytic",
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                             schedule=schedule, microbatches=4 if chunked else 2,
                             stages=2 if chunked else [1, 1])
    data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(6)]
    alive = [weakref.ref(t) for pair in data for t in pair]
    losses = pipe.train(data)
    del data
    gc.collect()
    assert len(losses) == 6
    assert [ref for ref in alive if ref() is not None] == []
    for runtime in pipe.last_runtimes.values():
        for rt in getattr(runtime, "chunks", {0: runtime}).values():
            assert not rt.transport.boxes.messages  # every queue emptied and dropped
            assert all(not r.joined for rounds in rt.transport.boxes.rounds.values()
                       for r in rounds)


def test_a_kept_loss_holds_its_value_not_the_losss_elementwise_buffer() -> None:
    """torch's CPU mse_loss returns a 0-d view of its elementwise buffer (the output's size);
    the runtime keeps one loss per microbatch of a run (a window: up to 1,024 minibatches), so
    it kept a window of output-sized buffers (64 KiB each here, 4 bytes with the fix)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64))
    x, y = torch.randn(8, 32, 16), torch.randn(8, 32, 64)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, cost="analytic",
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                             schedule="1f1b", microbatches=2, stages=[1, 1])
    pipe.train([(torch.randn(8, 32, 16), torch.randn(8, 32, 64)) for _ in range(4)])
    losses = [loss for rt in pipe.last_runtimes.values() for loss in rt.losses.values()]
    assert len(losses) == 4
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in losses)
