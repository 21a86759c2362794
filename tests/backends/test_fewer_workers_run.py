"""A plan on fewer workers than the cluster has runs end to end: compile, export, and a launch
asked for every worker of the cluster starts only the plan's.

The planner may leave workers idle where sharing the work costs more than it saves
(planner/fewer_workers.py): GPT-2 (its token embedding tied to the output head) over 100 KB/s
runs fastest on one of two workers. Before, the planner always used both, and a plan on fewer
workers was launched on as many processes as asked: `pdcompile run --nproc 2` refused it
("compiled for 1 workers, not --nproc 2") and `train_processes(..., 2, ...)` failed in every
process (the backend refuses a process group larger than the plan).
"""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path

import pytest
import torch

import pdcompile
from pdcompile.cli.run_cmd import torchrun_command
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.tied_models import gpt2_case
from tests.helpers.transparency import momentum

STEPS, MICRO = 3, 2
SLOW_LINK = "2@1e5"  # two workers over 100 KB/s: every plan on both waits on the link


def _compiled() -> tuple[pdcompile.Pipeline, list[float]]:
    """GPT-2 compiled for SLOW_LINK (analytic costs: the same plan on every machine) and the
    losses of ordinary training on the same minibatch."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt2_case()
    pipe = pdcompile.compile(copy.deepcopy(model), SLOW_LINK, example_inputs=inputs,
                             example_target=target, loss_fn=loss_fn, optimizer=momentum,
                             schedule="1f1b-flush", microbatches=MICRO, cost="analytic")
    want, _ = flush_reference(model, inputs, target, loss_fn, MICRO, STEPS, momentum)
    return pipe, want


def _run_args(folder: Path, nproc: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    from pdcompile.cli.run_cmd import register

    register(subparsers)
    return parser.parse_args(["run", str(folder), "--nproc", str(nproc), "--steps", "1"])


def test_compile_on_a_slow_link_leaves_a_worker_idle_and_runs_locally() -> None:
    pipe, want = _compiled()
    assert pipe.plan.workers == 1 and pipe.plan.config == "1"
    assert pipe.plan.extra["idle_workers"].startswith("1 of 2 workers (idle: rank 1)")
    assert "1 of 2 workers" in pipe.plan.summary()
    _, inputs, target, _ = gpt2_case()
    got = [pipe.step(*inputs, target=target) for _ in range(STEPS)]
    assert got == pytest.approx(want, rel=1e-6)


def test_pdcompile_run_asked_for_more_processes_starts_the_plans(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipe, _ = _compiled()
    pipe.export(str(tmp_path / "pipe"))
    cmd = torchrun_command(_run_args(tmp_path / "pipe", 2))
    assert "--nproc-per-node=1" in cmd
    assert "uses 1 of the 2 workers asked for" in capsys.readouterr().err


def _example(inputs: tuple[torch.Tensor, ...], target: torch.Tensor
             ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return [(inputs, target)] * STEPS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fewer_workers_plan_trains_on_the_distributed_backend_with_more_processes_asked(
        tmp_path: Path) -> None:
    """`pdcompile run --nproc 2` and `train_processes(..., 2, ...)` on the one-worker plan: one
    process runs it (gloo over 127.0.0.1), no process waits on a rank that has no stage, and
    the losses are ordinary training's."""
    from pdcompile.worker import train_processes
    from tests.helpers.processes import run_export_losses

    pipe, want = _compiled()
    folder = tmp_path / "pipe"
    pipe.export(str(folder))
    assert run_export_losses(folder, nproc=2, steps=STEPS, timeout=200) == pytest.approx(
        want, rel=1e-5)
    _, inputs, target, _ = gpt2_case()
    run = train_processes(str(folder), 2, functools.partial(_example, inputs, target),
                          timeout=200)
    assert run.losses == pytest.approx(want, rel=1e-5)
