"""`pdcompile run` refuses bad input in one line before any worker starts (cli/run_checks.py):
the options, the data and the steps against the checkpoints; `--dry-run` shows that nothing
was started."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cli import main

DATA = """\
import torch
from pdcompile.runtime.tensor_tree import load_tree

def _example():
    saved = load_tree({example!r})
    return tuple(saved["inputs"]), saved["target"]

def good():
    return [_example()] * 3

def nothing():
    return iter(())

def float_target():
    x, y = _example()
    return [(x, y.float())]

def short_target():
    x, y = _example()
    return [(x, y[:3])]
"""


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 4),),
                             example_target=torch.randint(0, 3, (8,)),
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule="1f1b", microbatches=2)
    folder = tmp_path / "exported"
    pipe.export(str(folder))
    (tmp_path / "data.py").write_text(DATA.format(example=str(folder / "example.safetensors")))
    return folder


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["run", *args, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("options, message", [
    (["--steps", "-3"], "--steps must be a non-negative number of minibatches (-3 < 0)"),
    (["--checkpoint-every", "0", "--checkpoint-dir", "ck"],
     "--checkpoint-every must be a positive number of minibatches (0 < 1)"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir DIR"),
    # each of these reached the workers: no fault detection (nan), a stop at start-up (0, -1),
    # a traceback in every worker or in torchrun, or a run that waited forever
    (["--fault-timeout", "nan"], "--fault-timeout nan: give the seconds"),
    (["--fault-timeout", "0"], "--fault-timeout 0.0: give the seconds"),
    (["--fault-timeout", "-1"], "--fault-timeout -1.0: give the seconds"),
    (["--threads", "0"], "--threads 0: give the threads of each worker, 1 or more"),
    (["--seed", str(2**70)], f"--seed {2**70}: torch takes seeds from -2**63 to 2**64-1"),
    (["--max-restarts", "-1"], "--max-restarts -1: give how many times torchrun may restart"),
    (["--master-port", "0"], "--master-port 0: a TCP port is 1 to 65535"),
    (["--master-port", "70000"], "--master-port 70000: a TCP port is 1 to 65535"),
    (["--node-rank", "5"], "--node-rank 5: with --nnodes 1 a node's rank is 0 to 0"),
])
def test_bad_options_are_one_line(exported: Path, options: list[str], message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _refused([str(exported), *options], capsys)


def test_a_file_for_a_folder_is_one_line(exported: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    file = exported / "plan.json"
    assert "is a file, not an export folder" in _refused([str(file)], capsys)
    with pytest.raises(pdcompile.errors.PipelineInputError, match="is a file, not an export"):
        pdcompile.load(str(file))
    assert "--checkpoint-dir" in _refused([str(exported), "--checkpoint-dir", str(file)], capsys)


@pytest.mark.parametrize("function, message", [
    ("nothing", "gives no minibatches"),
    ("float_target", "minibatch 0: the target is (8,) float32 but the example's is (8,) int64"),
    ("short_target", "minibatch 0: the target is (3,) int64 but the example's is (8,) int64"),
])
def test_bad_data_is_one_line_before_the_workers(exported: Path, function: str, message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    data = exported.parent / "data.py"
    err = _refused([str(exported), "--data", f"{data}:{function}", "--steps", "5"], capsys)
    assert message in err


def test_good_data_passes(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = exported.parent / "data.py"
    assert main(["run", str(exported), "--data", f"{data}:good", "--dry-run", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert f"--data {data}:good --seed 7 --run-dir {exported}/runs/" in out


def test_fewer_steps_than_the_checkpoints_hold_is_one_line(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdcompile.runtime.checkpoint import Checkpointer

    ckpt = tmp_path / "ck"
    for rank in (0, 1):  # complete checkpoints (file and manifest) at steps 20 and 40
        for step in (20, 40):
            Checkpointer(ckpt, rank=rank, every=20).save(step, {"w": torch.zeros(2)})
    err = _refused([str(exported), "--steps", "30", "--checkpoint-dir", str(ckpt)], capsys)
    assert "already hold 40 minibatches" in err and "--steps 30 asks for fewer" in err
    assert main(["run", str(exported), "--steps", "50", "--checkpoint-dir", str(ckpt),
                 "--dry-run"]) == 0
    assert f"--run-dir {ckpt}" in capsys.readouterr().out  # the run's losses beside them


def test_a_plan_with_a_rank_holding_no_stage_is_refused_before_workers_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the mixed planner may leave a slow device's rank out (ranks 0 and 2 of 3); such a plan
    # trains on the local backend, but its idle process used to die in `pdcompile run` with
    # IndexError (the rank's first stage), once per worker
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    even = pdcompile.compile(model, example_inputs=(torch.randn(8, 4),), stages=[1, 1]).plan
    first, last = even.stages
    skipping = replace(even, stages=(first, replace(last, ranks=(2,))), workers=3)
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 4),),
                             example_target=torch.randint(0, 3, (8,)),
                             loss_fn=nn.functional.cross_entropy, plan=skipping)
    assert pipe.step(torch.randn(8, 4), target=torch.randint(0, 3, (8,))) > 0
    pipe.export(str(tmp_path / "exported"))
    err = _refused([str(tmp_path / "exported")], capsys)
    assert "ranks [1] of the plan" in err and "hold no stage" in err
