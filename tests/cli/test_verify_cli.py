"""`pdcompile verify DIR`: an export or a checkpoint folder checked without running any of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.runtime.checkpoint import Checkpointer, module_state


def _export(folder: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1], microbatches=2)
    pipe.export(str(folder))
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("export") / "out")


def test_a_fresh_export_verifies(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(exported)]) == 0
    out = capsys.readouterr().out
    assert "export verified" in out and "MANIFEST.json" in out and "torch" in out


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["stage_1.safetensors", "optimizer_0.safetensors", "rank_1.py",
                             "plan.json", "schedule.txt"]),
       position=st.integers(0, 10 ** 6), bit=st.integers(0, 7))
def test_one_changed_bit_anywhere_is_named(exported: Path, tmp_path_factory: Any, name: str,
                                           position: int, bit: int,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    folder = tmp_path_factory.mktemp("copy") / "out"
    shutil.copytree(exported, folder)
    path = folder / name
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(folder)]) == 1
    err = capsys.readouterr().err
    assert name in err and err.count("\n") == 1, err


def test_a_checkpoint_folder_is_verified_rank_by_rank(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ranks = [Checkpointer(tmp_path, rank=r, every=1, keep=3) for r in range(2)]
    for step in (1, 2):
        for ck in ranks:
            ck.save(step, module_state(nn.Linear(4, 4), None, losses=[1.0] * step))
    assert main(["verify", str(tmp_path)]) == 0
    assert "a resume starts from step 2" in capsys.readouterr().out
    path = ranks[0].rank_dir() / "step_00000002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "a resume starts from step 1" in err


def test_a_missing_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1
