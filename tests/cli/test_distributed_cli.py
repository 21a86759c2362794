"""`pdcompile run`: the torchrun command it builds, and its user errors."""

from __future__ import annotations

import functools
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.export.integrity import seal_export
from pdcompile.timeline import Timeline
from tests.helpers.processes import printed_losses, run_cli


def _export(tmp_path: Path, workers: int) -> Path:
    """A small real export for `workers` workers (one stage each)."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(workers)])
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(4, 4),),
                             example_target=torch.randn(4, 4), loss_fn=nn.functional.mse_loss,
                             stages=[1] * workers, schedule="1f1b-flush", microbatches=2)
    folder = tmp_path / "exported"
    pipe.export(str(folder))
    return folder


def test_dry_run_builds_torchrun_command(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = _export(tmp_path, 3)
    assert main(["run", str(folder), "--dry-run", "--steps", "5", "--checkpoint-dir",
                 str(tmp_path / "ck"), "--checkpoint-every", "2", "--max-restarts", "1"]) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --nnodes=1 --nproc-per-node=3 --max-restarts=1" in out
    assert "--master-addr=127.0.0.1 --master-port=" in out
    assert f"-m pdcompile.worker {folder} --steps 5 --checkpoint-dir" in out
    assert "--checkpoint-every 2" in out


def test_multi_node_flags_pass_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _export(tmp_path, 4)
    assert main(["run", str(folder), "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "node0", "--master-port", "29511", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes=2 --nproc-per-node=2" in out
    assert "--master-addr=node0 --master-port=29511 --node-rank=1" in out


@pytest.mark.parametrize(("endpoint", "local"), [
    ("127.0.0.1:29400", True), ("localhost", True), ("[::1]:29400", True), ("::1", True),
    ("node0:29400", False), ("10.0.0.7:29400", False)])
def test_a_loopback_rendezvous_bootstraps_on_loopback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint: str, local: bool) -> None:
    """Every node of a run whose c10d endpoint is this machine's loopback is here: the workers'
    bootstrap store binds 127.0.0.1 (--local-addr), not the host name's address."""
    folder = _export(tmp_path, 2)
    assert main(["run", str(folder), "--rdzv-endpoint", endpoint, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--rdzv-backend=c10d" in out and f"--rdzv-endpoint={endpoint}" in out.replace("'", "")
    assert ("--local-addr=127.0.0.1" in out) == local


def test_user_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _export(tmp_path, 3)
    assert main(["run", str(tmp_path / "missing"), "--nproc", "2"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", str(folder), "--nproc", "2", "--dry-run"]) == 1
    assert "compiled for 3 workers, not --nproc 2; pass --nproc 3" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run", str(folder), "--master-port", str(port), "--dry-run"]) == 1
    assert f"master port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err
    assert main(["run", str(folder), "--nnodes", "2", "--nproc", "2", "--dry-run"]) == 1
    assert "needs --master-addr" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# End to end: real torchrun workers


def _exported(tmp_path: Path, schedule: str = "1f1b-flush") -> tuple[Path, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                          nn.Linear(12, 3))
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                             schedule=schedule, microbatches=2, stages=[1, 1])
    folder = tmp_path / "pipe"
    pipe.export(str(folder))
    return folder, x, y


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_pdcompile_run_trains_the_export_on_torchrun(tmp_path: Path) -> None:
    folder, x, y = _exported(tmp_path)
    done = run_cli([str(folder), "--nproc", "2", "--steps", "3", "--threads", "1",
                     "--timeline", str(tmp_path / "timeline.json")])
    assert done.returncode == 0, done.stdout
    timeline = Timeline.load(tmp_path / "timeline.json")  # every rank's actions, from rank 0
    assert timeline.source == "measured" and timeline.ranks == [0, 1]
    assert timeline.meta["minibatches"] == 3
    want = pdcompile.load(str(folder)).train([((x,), y)] * 3)
    assert printed_losses(done.stdout) == pytest.approx(want, rel=1e-6)
    # progress off a terminal: the first and the last step (and a line every 10 s between)
    assert f"step 1/3 loss {want[0]:.6f}" in done.stdout
    assert f"step 3/3 loss {want[2]:.6f}" in done.stdout
    summary = next(line for line in done.stdout.splitlines() if line.startswith("trained 3 "))
    lowest = min(range(3), key=lambda i: want[i])
    assert f"first {want[0]:.6g}, last {want[2]:.6g}, lowest {want[lowest]:.6g} " \
           f"(step {lowest + 1})" in summary, summary
    assert "losses [" not in done.stdout  # no more every loss on one line
    assert (folder / "runs").is_dir()  # the default run folder


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bad_data_past_the_first_minibatch_is_printed_once(tmp_path: Path) -> None:
    """The reader refuses minibatch 5 and announces it; the other rank stops without repeating
    the message, and the launcher's line names the reader."""
    folder, _, _ = _exported(tmp_path)
    data = tmp_path / "bad.py"
    data.write_text("import torch\n"
                    "def batches():\n"
                    "    for i in range(8):\n"
                    "        x = torch.randn(8, 13 if i == 5 else 12)\n"
                    "        yield (x,), torch.zeros(8).long()\n")
    done = run_cli([str(folder), "--nproc", "2", "--threads", "1", "--data", f"{data}:batches"])
    assert done.returncode == 1, done.stdout
    problem = "minibatch 5: input 'input_1' is (8, 13) float32"
    assert done.stdout.count(f"pdcompile: error: {problem}") == 1, done.stdout
    assert f"the distributed run failed: rank 0 failed: {problem}" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dead_worker_is_restarted_and_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    folder, x, y = _exported(tmp_path)
    ckpt = tmp_path / "ckpt"
    done = run_cli([str(folder), "--nproc", "2", "--steps", "6", "--threads", "1",
                     "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                     "--max-restarts", "1", "--fault-timeout", "5"],
                    env={"PDCOMPILE_TEST_DIE_AT": "0:4"})
    # the hook kills rank 0 as it reads minibatch 4: the reader announces runs ahead
    # (distributed.ANNOUNCE_AHEAD, 4 under flush schedules), so that read comes after minibatches
    # 0-3 have trained and checkpoint 2 is saved, and before checkpoint 4 is
    assert done.returncode == 0, done.stdout
    assert "rank 0: killing myself at minibatch 4" in done.stdout
    assert "resumed from the checkpoint after minibatch 2" in done.stdout
    want = pdcompile.load(str(folder)).train([((x,), y)] * 6)
    assert printed_losses(done.stdout) == pytest.approx(want, rel=1e-6)
    assert sorted(p.name for p in (ckpt / "rank_1").iterdir()) == [
        ".writer.lock",  # the run's writer lock (runtime/checkpoint.py), left unheld
        "step_00000004.manifest.json", "step_00000004.safetensors",
        "step_00000006.manifest.json", "step_00000006.safetensors"]


def test_default_data_is_the_example_a_default_number_of_times(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, _, _ = _exported(tmp_path)
    assert main(["run", str(folder), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "training on the exported example minibatch, 20 times" in captured.err
    assert "--nproc-per-node=2" in captured.out and f"{folder} --steps 20" in captured.out
    assert main(["run", str(folder), "--dry-run", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "--steps 3" in captured.out and not captured.err
    data = tmp_path / "d.py"
    data.write_text("from pdcompile.runtime.tensor_tree import load_tree\n"
                    "def batches():\n"
                    f"    saved = load_tree({str(folder / 'example.safetensors')!r})\n"
                    "    return [(tuple(saved['inputs']), saved['target'])]\n"
                    "def nothing():\n    return []\n")
    assert main(["run", str(folder), "--nproc", "2", "--dry-run", "--data",
                 f"{data}:batches"]) == 0
    assert f"--data {data}:batches" in capsys.readouterr().out
    assert main(["run", str(folder), "--dry-run", "--data", f"{data}:nothing"]) == 1
    assert capsys.readouterr().err.count("gives no minibatches") == 1
    assert main(["run", str(folder), "--dry-run", "--data", f"{data}:batchs"]) == 1
    err = capsys.readouterr().err
    assert "has no callable 'batchs' (did you mean 'batches'?)" in err
    assert err.count("\n") == 1
    meta = json.loads((folder / "pipeline.json").read_text())
    meta["example"]["target"] = False
    (folder / "pipeline.json").write_text(json.dumps(meta))
    seal_export(folder)  # an export written so (its manifest matches)
    assert main(["run", str(folder), "--dry-run"]) == 1
    assert "no target for its loss function" in capsys.readouterr().err
    meta["example"]["inputs"] = False
    (folder / "pipeline.json").write_text(json.dumps(meta))
    seal_export(folder)
    assert main(["run", str(folder), "--dry-run"]) == 1
    assert "holds no example minibatch" in capsys.readouterr().err
