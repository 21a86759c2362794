"""run_distributed with a parameter tied between two chunks of one process, over gloo.

The bundled GPT-2 (tied wte / lm_head) on a V of 2 processes (ZB-V, DualPipeV: both holders
on rank 0, no all-reduce) and on an interleaved cut (interleaved 1F1B: both on rank 1), and
TiedLM (tests/helpers/tied_models.py) on a V whose embedding is read by stages 0, 2 and 3
(rank 0 sums its two copies, then one all-reduce with rank 1), also clipped by the global
gradient norm (each process one all-reduce of its chunks' squares). Every process's losses and
every copy of every parameter it holds equal single-process training after three updates,
in float64; and the same V resumed from checkpoints equals an uninterrupted run. gloo over
127.0.0.1, one thread per process, bounded by timeouts.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import pdcompile
from pdcompile.backends.launch import Worker, launch
from tests.helpers.schedule_cuts import flush_reference
from tests.helpers.tied_models import (
    Case,
    gpt2_case,
    interleaved_tie_plan,
    tied_lm_case,
    v_shaped,
)
from tests.helpers.transparency import momentum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, MICRO = 3, 4
# (model, schedule, clip_grad_norm): the plan is a V for 'zb-v' and 'dualpipev',
# interleaved_tie_plan otherwise
CASES = [("gpt2", "zb-v", None), ("gpt2", "dualpipev", None), ("gpt2", "interleaved-1f1b", None),
         ("tied-lm", "zb-v", None), ("tied-lm", "zb-v", 0.05)]


def _case(model: str) -> Case:
    return gpt2_case() if model == "gpt2" else tied_lm_case()


def _pipeline(model_name: str, schedule: str, clip: float | None
              ) -> pdcompile.pipeline.Pipeline:
    model, inputs, target, loss_fn = _case(model_name)
    plan = interleaved_tie_plan(model) if schedule == "interleaved-1f1b" else v_shaped(model)
    return pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, loss_fn=loss_fn,
                             optimizer=momentum, schedule=schedule, microbatches=MICRO,
                             plan=plan, example_target=target, clip_grad_norm=clip)


def _train(worker: Worker, cases: list[tuple[str, str, float | None]]
           ) -> list[dict[str, Any]]:
    from pdcompile.backends.distributed import reads_data, run_distributed

    out = []
    for model_name, schedule, clip in cases:
        pipe = _pipeline(model_name, schedule, clip)
        _, inputs, target, _ = _case(model_name)
        batches = [(inputs, target)] * STEPS
        run = run_distributed(pipe, iter(batches) if reads_data(pipe, worker.rank) else None,
                              monitor=worker.monitor)
        copies = {}
        for stage in pipe.stages_of(worker.rank):
            program = pipe.parts.stages[stage]
            for name, p in pipe.state(worker.rank, stage).module.named_parameters(
                    remove_duplicate=False):
                for original in program.param_names.get(name, (name,)):
                    copies[stage, original] = p.detach().clone()
        out.append({"losses": run.losses, "copies": copies})
    return out


def test_ties_within_one_process_train_like_one_process_on_gloo() -> None:
    results = launch(_train, 2, args=(CASES,), timeout=240)
    for index, (model_name, schedule, clip) in enumerate(CASES):
        model, inputs, target, loss_fn = _case(model_name)
        want, state = flush_reference(model, inputs, target, loss_fn, MICRO, STEPS, momentum,
                                      clip=clip)
        tie = next(t for t in _pipeline(model_name, schedule, clip).parts.ties
                   if t.name in ("wte.weight", "emb.weight"))
        held: dict[str, list[int]] = {}
        for rank, per_rank in enumerate(results):
            run = per_rank[index]
            torch.testing.assert_close(torch.tensor(run["losses"], dtype=torch.float64),
                                       torch.tensor(want, dtype=torch.float64),
                                       msg=lambda m: f"{model_name} {schedule}: {m}")
            for (stage, original), value in run["copies"].items():
                torch.testing.assert_close(
                    value, state[original],
                    msg=lambda m, r=rank, s=stage, o=original: f"{model_name} {schedule} "
                                                               f"rank {r} stage {s} {o}: {m}")
                if original == tie.name:
                    held.setdefault(original, []).append(rank)
        # two copies of the tie on one process: the case this test is for
        assert len(set(held[tie.name])) < len(held[tie.name]), (model_name, schedule, held)


def _gpt2_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` minibatches of token ids for gpt2_case's model, with next-token targets."""
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50, (8, 6), generator=gen) for _ in range(n)]
    return [(x, torch.roll(x, -1, dims=1)) for x in ids]


def test_a_tie_within_one_process_resumes_from_checkpoints(tmp_path: Path) -> None:
    """GPT-2 on a V of 2 processes with Adam: stopped after 2 minibatches and resumed from the
    checkpoints, the run ends with the uninterrupted local run's losses, and rank 0's file holds
    both chunks' copies of the tied embedding, equal, with their own Adam moments."""
    from pdcompile.runtime.checkpoint import Checkpointer
    from pdcompile.worker import train_processes

    model, inputs, target, loss_fn = gpt2_case()
    pipe = pdcompile.compile(model, example_inputs=inputs, example_target=target,
                             loss_fn=loss_fn, optimizer=functools.partial(torch.optim.Adam,
                                                                          lr=0.01),
                             schedule="dualpipev", microbatches=MICRO, plan=v_shaped(model))
    pipe.export(str(tmp_path / "pipe"))
    local = pdcompile.load(str(tmp_path / "pipe"))
    want = local.train(_gpt2_batches(4))
    data = functools.partial(_gpt2_batches, 4)
    first = train_processes(tmp_path / "pipe", 2, data, steps=2, timeout=120,
                            checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert first.resumed_from is None
    second = train_processes(tmp_path / "pipe", 2, data, steps=4, timeout=120,
                             checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert second.resumed_from == 2
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(want))
    saved = Checkpointer(tmp_path / "ckpt", rank=0, every=2).load(4)
    (tie,) = local.parts.ties
    assert [local.plan.stages[s].ranks for s in tie.stages] == [(0,), (0,)]
    copies = [saved["chunks"][str(stage)]["model"][name] for stage, name in tie.members]
    torch.testing.assert_close(copies[0], copies[1], rtol=0, atol=0)
    torch.testing.assert_close(copies[0], local.named_parameters()[tie.name].detach())
