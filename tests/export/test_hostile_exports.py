"""Exports nobody here wrote: a flipped byte anywhere, files swapped in from another export,
files added beside the manifest, JSON nested past any reader's depth, a signature that is not
text, folders where files belong. Each is refused in one line naming the file (no other
exception, no code of the folder run), or loads exactly what was written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import PdcompileError
from pdcompile.export.files import check_export
from pdcompile.pipeline import Pipeline


def _pipeline(seed: int, *, example: bool = True) -> Pipeline:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y,
                             loss_fn=nn.functional.mse_loss, stages=[1, 1], microbatches=2,
                             cost="analytic",
                             optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    pipe.step(x, target=y)  # optimizer state that differs between the two exports
    if not example:
        pipe.example_inputs = None
    return pipe


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two exports of one architecture with different weights (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("exports")
    for seed in (0, 1):
        _pipeline(seed).export(str(root / f"seed{seed}"))
    return root / "seed0", root / "seed1"


def _copy(source: Path, folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    return folder


def _state(pipe: Pipeline) -> list[tuple[str, torch.Tensor]]:
    out = [(f"{i}.{k}", v) for i, m in enumerate(pipe.stage_modules)
           for k, v in m.state_dict().items()]
    for state in pipe.states():
        for k, v in state.optimizer.state_dict()["state"].items():
            out += [(f"opt{state.stage}.{k}.{n}", t) for n, t in v.items()
                    if isinstance(t, torch.Tensor)]
    out += [("example", t) for t in pipe.example_inputs or ()]
    return out


def _same(a: Pipeline, b: Pipeline) -> bool:
    left, right = _state(a), _state(b)
    return len(left) == len(right) and all(
        n == m and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for (n, x), (m, y) in zip(left, right, strict=True))


def _refused_in_one_line(folder: Path, *, trust: bool = False) -> str:
    with pytest.raises(PdcompileError) as info:
        pdcompile.load(str(folder), trust=trust)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message
    return message


@pytest.mark.parametrize("names", [
    ["stage_0.safetensors"], ["optimizer_1.safetensors"], ["example.safetensors"],
    ["MANIFEST.json"], ["MANIFEST.sig"], ["MANIFEST.json", "MANIFEST.sig"],
    ["MANIFEST.json", "MANIFEST.sig", "stage_0.safetensors", "pipeline.json"]])
def test_files_swapped_in_from_another_export_are_refused(
        exports: tuple[Path, Path], tmp_path: Path, names: list[str]) -> None:
    """Files of another export of the same model (the manifest and signature with them) mixed
    into this one: the mix never loads as either."""
    mine, theirs = exports
    folder = _copy(mine, tmp_path / "mixed")
    for name in names:
        shutil.copy(theirs / name, folder / name)
    _refused_in_one_line(folder)


def test_a_data_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    """An export written without an example minibatch, with another export's
    example.safetensors dropped beside its (untouched, signed) manifest: load and
    `pdcompile verify` refuse it; before, it loaded that file's tensors as its example."""
    without, other = tmp_path / "without", tmp_path / "other"
    _pipeline(0, example=False).export(str(without))
    _pipeline(1).export(str(other))
    assert pdcompile.load(str(without)).example_inputs is None
    shutil.copy(other / "example.safetensors", without / "example.safetensors")
    message = _refused_in_one_line(without)
    assert "example.safetensors is not listed in MANIFEST.json" in message
    assert "example.safetensors is not listed" in _refused_in_one_line(without, trust=True)
    with pytest.raises(PdcompileError, match="example.safetensors is not listed"):
        check_export(without)
