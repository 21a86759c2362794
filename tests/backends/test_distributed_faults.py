"""run_distributed under faults and bad input: wrong shapes are refused on every rank before any
communication; a worker killed mid-run makes every other one stop, naming it, within the bound."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.backends.launch import LaunchError, PeerFailure, Worker, launch
from pdcompile.errors import DistributedError, PipelineInputError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WIDTH, BATCH = 12, 8


class Bomb(nn.Module):
    """Kills its process at its `at`-th training forward (example runs are under no_grad)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def _model(bomb_at: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    middle: list[nn.Module] = [Bomb(bomb_at)] if bomb_at is not None else []
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), *middle, nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, 3))


def _pipeline(stages: list[int], schedule: str = "1f1b-flush", bomb_at: int | None = None
              ) -> Any:
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 3, (BATCH,))
    return pdcompile.compile(_model(bomb_at), example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy, schedule=schedule,
                             microbatches=2, stages=stages, leaf_modules=[Bomb])


def _good(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(n)]


def _bad_input_worker(worker: Worker) -> dict[str, Any]:
    from pdcompile.backends.distributed import run_distributed

    out: dict[str, Any] = {}
    pipe = _pipeline([1, 1])
    wrong_first = [(torch.randn(BATCH, WIDTH + 1), torch.randint(0, 3, (BATCH,)))] + _good(2)
    # a short batch trains; one whose target has another batch size does not
    wrong_third = _good(2) + [(torch.randn(BATCH // 2, WIDTH), torch.randint(0, 3, (BATCH,)))]
    wrong_target = [(_good(1)[0][0], torch.randint(0, 3, (BATCH, 2)))]
    # past the first announcement of runs (distributed.ANNOUNCE_AHEAD): found by a later one
    wrong_sixth = _good(5) + [(torch.randn(BATCH, WIDTH + 2), torch.randint(0, 3, (BATCH,)))]
    for name, data in (("first", wrong_first), ("third", wrong_third),
                       ("target", wrong_target), ("sixth", wrong_sixth)):
        try:
            run_distributed(pipe, data, monitor=worker.monitor)
        except PipelineInputError as err:
            out[name] = str(err)
            out[f"{name} from"] = getattr(err, "reader", worker.rank)  # who reports it
    try:
        run_distributed(_pipeline([1, 1, 1]), _good(1), monitor=worker.monitor)
    except DistributedError as err:
        out["world"] = str(err)
    # nothing was left half-sent: the group still trains, with the same result as locally
    out["losses"] = run_distributed(_pipeline([1, 1]), _good(2), monitor=worker.monitor).losses
    return out


def test_wrong_shapes_are_refused_on_every_rank_without_hanging() -> None:
    results = launch(_bad_input_worker, 2, timeout=120, fault_timeout=5)
    for out in results:
        assert out["first"].startswith("minibatch 0: input 'input_1' is (8, 13) float32 but the "
                                       "pipeline was compiled for (8, 12) float32")
        assert out["third"].startswith("minibatch 2: input 'input_1' is (4, 12) float32 but the "
                                       "pipeline was compiled for (8, 12) float32, and the loss "
                                       "function cannot use it with the model's output")
        assert out["target"].startswith("minibatch 0: the target is (8, 2) int64 but the "
                                        "example's is (8,) int64, and the loss function cannot "
                                        "use it")
        assert out["sixth"].startswith("minibatch 5: input 'input_1' is (8, 14) float32 but the "
                                       "pipeline was compiled for (8, 12) float32")
        assert "compiled for 3 workers" in out["world"] and "process group has 2" in out["world"]
        # the reader (rank 0) reports bad data; the others learn it from its announcement and
        # leave the message to it, so that a run prints it once
        assert all(out[f"{name} from"] == 0 for name in ("first", "third", "target", "sixth"))
    # nothing was left in flight by the refused runs: the same group then trains normally
    assert results[0]["losses"] == results[1]["losses"]
    pipe = _pipeline([1, 1])
    torch.testing.assert_close(torch.tensor(results[0]["losses"]),
                               torch.tensor(pipe.train(_good(2))))


def _killed_worker(worker: Worker, at: int) -> list[float]:
    from pdcompile.backends.distributed import run_distributed

    pipe = _pipeline([1, 1, 1], schedule="1f1b", bomb_at=at)
    return run_distributed(pipe, _good(12), monitor=worker.monitor).losses


def test_worker_killed_mid_run_stops_the_others_naming_it() -> None:
    pipe = _pipeline([1, 1, 1], schedule="1f1b", bomb_at=3)
    (bomb,) = [n for n in pipe.graph.graph.nodes if n.op == "call_module"
               and isinstance(pipe.graph.get_submodule(str(n.target)), Bomb)]
    dead = pipe.plan.stages[int(bomb.meta["pd.stage"])].ranks[0]
    bound = 3.0
    with pytest.raises(LaunchError) as info:
        launch(_killed_worker, 3, args=(3,), timeout=120, fault_timeout=bound)
    err = info.value
    assert err.dead_rank == dead and f"rank {dead}" in str(err).splitlines()[0]
    died_at = err.died_at
    assert died_at is not None
    for outcome in err.outcomes:
        if outcome.rank == dead:
            assert outcome.exitcode == -signal.SIGKILL
            continue
        assert isinstance(outcome.error, PeerFailure), outcome.error
        assert outcome.error.dead_rank == dead
        assert f"rank {dead} died" in str(outcome.error)
        assert outcome.finished_at is not None and outcome.finished_at - died_at < bound + 1.0
