"""`pdcompile run`: the torchrun command it builds, and its user errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from pdcompile.cli import main


def _export(tmp_path: Path, workers: int) -> Path:
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps({"workers": workers}))
    return folder


def test_dry_run_builds_torchrun_command(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = _export(tmp_path, 3)
    assert main(["run", str(folder), "--dry-run", "--steps", "5", "--checkpoint-dir",
                 str(tmp_path / "ck"), "--checkpoint-every", "2", "--max-restarts", "1"]) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --nnodes=1 --nproc-per-node=3 --max-restarts=1" in out
    assert "--master-addr=127.0.0.1 --master-port=" in out
    assert f"-m pdcompile.backends.distributed {folder} --steps 5 --checkpoint-dir" in out
    assert "--checkpoint-every 2" in out


def test_multi_node_flags_pass_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _export(tmp_path, 4)
    assert main(["run", str(folder), "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "node0", "--master-port", "29511", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes=2 --nproc-per-node=2" in out
    assert "--master-addr=node0 --master-port=29511 --node-rank=1" in out


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
