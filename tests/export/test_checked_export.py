"""The check of an export that loads nothing (`pdcompile verify`, `pdcompile run` before any
worker starts) reads each file as the loader does: a safetensors header the loader refuses is
refused by the check too, in one line naming the file. Before, the check opened headers with
safetensors' `safe_open`, which accepts dtypes pdcompile never writes (the loader then refused
the export in every worker), and read no tensor tree's JSON."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.cli import main
from pdcompile.errors import PdcompileError
from pdcompile.export.checked import check_export
from pdcompile.export.integrity import seal_export


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, stages=[1, 1], microbatches=2,
                             cost="analytic", optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    pipe.step(x, target=y)
    folder = tmp_path_factory.mktemp("checked") / "out"
    pipe.export(str(folder))
    return folder


def _header_edited(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the JSON header of the safetensors file `path` (the tensors' bytes kept)."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def _retyped(dtype: str, per_item: int) -> Callable[[dict[str, Any]], None]:
    """The first tensor's float32 bytes called `dtype` (`per_item` bytes each): the sizes add
    up, so safetensors accepts the header; pdcompile writes no such dtype."""
    def change(header: dict[str, Any]) -> None:
        key = next(k for k in header if k != "__metadata__")
        info = header[key]
        begin, end = info["data_offsets"]
        info.update(dtype=dtype, shape=[(end - begin) // per_item])
    return change


def _float_shape(header: dict[str, Any]) -> None:
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [float(n) for n in header[key]["shape"]]


def _tree_not_json(header: dict[str, Any]) -> None:
    header["__metadata__"]["pdcompile.tree"] = "{not json"


@pytest.mark.parametrize("name, change, words", [
    ("stage_0.safetensors", _retyped("F8_E8M0", 1), "dtype 'F8_E8M0'"),
    ("stage_1.safetensors", _retyped("F4", 1), "dtype 'F4'"),
    ("stage_0.safetensors", _float_shape, "not integers"),
    ("optimizer_0.safetensors", _tree_not_json, "optimizer_0.safetensors"),
    ("example.safetensors", _tree_not_json, "example.safetensors"),
], ids=["dtype-f8-e8m0", "dtype-f4", "float-shape", "optimizer-tree", "example-tree"])
def test_what_the_loader_refuses_the_check_refuses(
        export: Path, tmp_path: Path, name: str, change: Callable[[dict[str, Any]], None],
        words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A header edited under a manifest written again (another's export, run with --trust):
    the load refuses it, and so do check_export, `pdcompile verify --trust` and
    `pdcompile run --trust --dry-run`, each in one line naming the file."""
    folder = tmp_path / "out"
    shutil.copytree(export, folder)
    _header_edited(folder / name, change)
    seal_export(folder)
    (folder / "MANIFEST.sig").unlink()
    for call in (lambda: pdcompile.load(str(folder), trust=True),
                 lambda: check_export(folder)):
        with pytest.raises(PdcompileError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and str(folder / name) in message and words in message
    for command in (["verify", str(folder), "--trust"],
                    ["run", str(folder), "--trust", "--dry-run"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(folder / name) in err, err

