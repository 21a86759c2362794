"""Checkpoints of run_distributed: a run stopped and started again from its checkpoints reaches
the same losses and weights as an uninterrupted one (asynchronous schedules, which drain at each
checkpoint), through the Python launcher `train_processes` on an exported pipeline."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.runtime.checkpoint import Checkpointer
from pdcompile.worker import train_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WIDTH, BATCH = 12, 8


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(n)]


def _export(folder: Path, schedule: str, act: type[nn.Module] = nn.ReLU) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), act(), nn.Linear(WIDTH, WIDTH), act(),
                          nn.Linear(WIDTH, 3))
    x, y = batches(1)[0]
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                             schedule=schedule, microbatches=2, stages=[1, 1])
    pipe.export(str(folder))
    return folder


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_resumed_run_equals_uninterrupted(tmp_path: Path, schedule: str) -> None:
    export = _export(tmp_path / "pipe", schedule)
    data = functools.partial(batches, 6)
    # uninterrupted, the stream drains at each checkpoint: Pipeline.train once per interval
    local = pdcompile.load(str(export))
    data_all = batches(6)
    want = [loss for k in range(0, 6, 2) for loss in local.train(data_all[k:k + 2])]

    seen: list[tuple[int, float]] = []
    first = train_processes(export, 2, data, steps=4, timeout=120, fault_timeout=5,
                            checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2,
                            progress=lambda step, loss: seen.append((step, loss)))
    assert first.resumed_from is None and first.steps == 4
    assert seen == list(enumerate(first.losses))  # relayed to this process, in order
    second = train_processes(export, 2, data, steps=6, timeout=120, fault_timeout=5,
                             checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert second.resumed_from == 4 and second.steps == 2 and second.losses[:4] == first.losses
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(want))
    for rank in (0, 1):
        saved = Checkpointer(tmp_path / "ckpt", rank=rank, every=2).load(6)
        assert saved["data_position"] == 6 and saved["losses"] == second.losses
        for key, value in local.stage_modules[rank].state_dict().items():
            torch.testing.assert_close(saved["model"][key], value)


def test_a_damaged_newest_checkpoint_falls_back_and_says_so(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Sixteen changed bits in the weights of rank 1's newest checkpoint (the issue's probe:
    the resume trained on them and reached losses of 1e35): the resume names the file, goes
    back to the previous checkpoint that verifies, and ends with the uninterrupted losses;
    a temporary file left by a writer that was killed is removed."""
    export = _export(tmp_path / "pipe", "1f1b-flush")
    data = functools.partial(batches, 6)
    want = pdcompile.load(str(export)).train(batches(6))
    ckpt = tmp_path / "ckpt"
    train_processes(export, 2, data, steps=4, timeout=120, fault_timeout=5,
                    checkpoint_dir=ckpt, checkpoint_every=2)
    newest = ckpt / "rank_1" / "step_00000004.safetensors"
    raw = bytearray(newest.read_bytes())
    for bit in range(16):  # inside the tensors, at the end of the file
        raw[-1 - 7 * bit] ^= 1 << (bit % 8)
    newest.write_bytes(bytes(raw))
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    stale = ckpt / "rank_1" / f".step_00000006.safetensors.{pid_max + 1}.tmp"
    stale.write_bytes(b"\0" * 4096)
    capfd.readouterr()
    second = train_processes(export, 2, data, steps=6, timeout=120, fault_timeout=5,
                             checkpoint_dir=ckpt, checkpoint_every=2)
    err = capfd.readouterr().err
    assert second.resumed_from == 2 and second.steps == 4, err
    assert f"the checkpoint at step 4 in {ckpt} is damaged ({newest} does not match its " \
           "manifest" in err and "resuming from step 2, the newest checkpoint that verifies" \
           in err, err
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(want))
    assert not stale.exists()


def _export_chunked(folder: Path, schedule: str) -> Path:
    """Two ranks holding two chunks each: interleaved (stages 0, 2 | 1, 3) or in a V (0, 3 |
    1, 2)."""
    from pdcompile.passes.split import even_plan
    from pdcompile.passes.trace import trace
    from pdcompile.planner.interleave import fold_v, interleave
    from pdcompile.schedule.kinds import kind

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 3))
    plan = even_plan(trace(model), 4)
    plan = fold_v(plan) if kind(schedule).v_shape else interleave(plan, 2)
    x, y = batches(1)[0]
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                             schedule=schedule, microbatches=4, plan=plan)
    pipe.export(str(folder))
    return folder


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "dualpipev"])
def test_a_rank_holding_several_chunks_resumes_every_chunk(tmp_path: Path,
                                                           schedule: str) -> None:
    """Each rank's file holds every chunk's weights and optimizer state (Adam's moments: a
    chunk restored without them trains on differently); stopped after 4 minibatches and
    resumed, the run ends with the losses and weights of the local backend's uninterrupted
    run (a flush schedule: nothing is in flight at a checkpoint)."""
    export = _export_chunked(tmp_path / "pipe", schedule)
    local = pdcompile.load(str(export))
    want = local.train(batches(6))
    data = functools.partial(batches, 6)
    first = train_processes(export, 2, data, steps=4, timeout=120, fault_timeout=5,
                            checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert first.resumed_from is None and first.steps == 4
    second = train_processes(export, 2, data, steps=6, timeout=120, fault_timeout=5,
                             checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert second.resumed_from == 4 and second.steps == 2
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(want))
    for rank in (0, 1):
        saved = Checkpointer(tmp_path / "ckpt", rank=rank, every=2).load(6)
        stages = local.stages_of(rank)
        assert saved["pipeline"]["stage"] == list(stages)
        assert sorted(saved["chunks"]) == sorted(str(s) for s in stages)
        for stage in stages:
            chunk = saved["chunks"][str(stage)]
            has_weights = any(True for _ in local.state(rank, stage).module.parameters())
            assert bool(chunk["optimizer"]["state"]) == has_weights, f"stage {stage}"
            for key, value in local.state(rank, stage).module.state_dict().items():
                torch.testing.assert_close(chunk["model"][key], value)


def test_a_checkpoint_whose_losses_were_edited_is_refused_in_one_line(tmp_path: Path) -> None:
    """A checkpoint rewritten with one loss fewer than its minibatches (its manifest written
    anew, so that it verifies) is named when resumed; the resume once went on and failed after
    training, on a minibatch whose loss it could not find (KeyError)."""
    from pdcompile.backends.launch import LaunchError

    export = _export(tmp_path / "pipe", "1f1b-flush")
    data = functools.partial(batches, 4)
    ckpt = tmp_path / "ckpt"
    train_processes(export, 2, data, steps=2, timeout=120, fault_timeout=5,
                    checkpoint_dir=ckpt, checkpoint_every=2)
    for rank in (0, 1):
        writer = Checkpointer(ckpt, rank=rank, every=2)
        state = writer.load(2)
        writer.save(2, {**state, "losses": state["losses"][:1]})
    with pytest.raises(LaunchError) as info:
        train_processes(export, 2, data, steps=4, timeout=120, fault_timeout=5,
                        checkpoint_dir=ckpt, checkpoint_every=2)
    assert "does not hold the loss of each of its 2 minibatches (its losses: 1 entries" \
        in str(info.value), str(info.value)


def test_a_run_into_a_checkpoint_folder_another_run_writes_is_refused(tmp_path: Path) -> None:
    """Another run holds rank 0's folder (its writer lock): this run is refused in one line
    naming the folder, and writes no checkpoint there (before, both runs wrote the same
    step_<k> files, and a resume could restore ranks of two runs)."""
    export = _export(tmp_path / "pipe", "1f1b")
    other = Checkpointer(tmp_path / "ckpt", rank=0, every=2)
    other.claim()
    try:
        with pytest.raises(pdcompile.errors.PdcompileError) as info:
            train_processes(export, 2, functools.partial(batches, 4), steps=4, timeout=120,
                            fault_timeout=5, checkpoint_dir=tmp_path / "ckpt",
                            checkpoint_every=2)
    finally:
        other.release()
    assert "another run is writing checkpoints" in str(info.value)
    assert str(tmp_path / "ckpt") in str(info.value)
    assert Checkpointer(tmp_path / "ckpt", rank=0, every=2).steps() == []
    assert Checkpointer(tmp_path / "ckpt", rank=1, every=2).steps() == []


def test_a_checkpoint_of_another_model_of_the_same_shapes_is_refused(tmp_path: Path) -> None:
    """Linear-ReLU-Linear and Linear-Tanh-Linear have the same parameters (names, shapes) and
    the same plan: a run of the second in the first's checkpoint folder once resumed from it
    without a word (the check compared plan, schedule, stage and microbatches only). It is
    refused in one line naming the folder, the stage, the layer that differs and the opt-in; a
    fresh export of the first model still resumes there, and the second with the opt-in."""
    from pdcompile.backends.launch import LaunchError

    data = functools.partial(batches, 4)
    ckpt = tmp_path / "ckpt"
    train_processes(_export(tmp_path / "relu", "1f1b-flush"), 2, data, steps=2, timeout=120,
                    fault_timeout=5, checkpoint_dir=ckpt, checkpoint_every=2)
    with pytest.raises(LaunchError) as info:
        train_processes(_export(tmp_path / "tanh", "1f1b-flush", nn.Tanh), 2, data, steps=4,
                        timeout=120, fault_timeout=5, checkpoint_dir=ckpt, checkpoint_every=2)
    message = str(info.value)
    assert f"step 2 of stage 0 in {ckpt}" in message and "ReLU()' in the checkpoint, is " \
        "'torch.nn.modules.activation.Tanh()' now" in message, message
    assert "resume_anyway=True (--resume-anyway)" in message, message
    assert "another checkpoint folder" in message, message
    again = train_processes(_export(tmp_path / "relu_again", "1f1b-flush"), 2, data, steps=4,
                            timeout=120, fault_timeout=5, checkpoint_dir=ckpt,
                            checkpoint_every=2)
    assert again.resumed_from == 2 and again.steps == 2
    # the explicit opt-in: the same parameters and graph, other layer classes, resumed
    anyway = train_processes(_export(tmp_path / "tanh_anyway", "1f1b-flush", nn.Tanh), 2, data,
                             steps=4, timeout=120, fault_timeout=5, checkpoint_dir=ckpt,
                             checkpoint_every=2, resume_anyway=True)
    assert anyway.resumed_from == 4 and len(anyway.losses) == 4
