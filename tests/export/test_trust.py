"""The trust boundary of an export: generated code runs only as verified, and the modules an
export names are torch, pdcompile and those recorded at export, unless trust=True."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import DamagedFileError, PdcompileError, PipelineInputError
from pdcompile.export.integrity import seal_export


class Gain(nn.Module):
    """A leaf module of this (user) module: the export records this module as the user's."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def user_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss function of the user's own module."""
    return nn.functional.cross_entropy(output, target)


def _export(folder: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Gain(), nn.ReLU(), nn.Linear(4, 2))
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    pipe = pdcompile.compile(model, example_inputs=(x,), example_target=y, loss_fn=user_loss,
                             stages=[1, 1], microbatches=2, leaf_modules=[Gain])
    pipe.export(str(folder))
    return folder


def _edit_meta(folder: Path, **changes: object) -> None:
    meta = json.loads((folder / "pipeline.json").read_text())
    meta.update(changes)
    (folder / "pipeline.json").write_text(json.dumps(meta))
    seal_export(folder)  # altered on purpose, manifest and all


def test_the_users_module_is_recorded_and_accepted(tmp_path: Path) -> None:
    out = _export(tmp_path / "out")
    meta = json.loads((out / "pipeline.json").read_text())
    assert meta["modules"] == [__name__]
    assert pdcompile.load(str(out)).loss_fn is user_loss


def test_an_import_path_outside_the_boundary_is_refused_unless_trusted(tmp_path: Path) -> None:
    out = _export(tmp_path / "out")
    _edit_meta(out, loss_fn={"function": "os:system"})
    with pytest.raises(PipelineInputError) as info:
        pdcompile.load(str(out))
    message = str(info.value)
    assert "'os'" in message and "pipeline.json" in message and "trust=True" in message
    assert "\n" not in message
    import os

    assert pdcompile.load(str(out), trust=True).loss_fn is os.system


def test_a_module_inside_the_export_folder_never_runs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON import path naming a file shipped inside the folder (even one the forged record
    lists as the user's) is refused before it is imported."""
    out = _export(tmp_path / "out")
    marker = tmp_path / "ran"
    (out / "payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                    "def loss(o, t):\n    return o.sum()\n")
    monkeypatch.syspath_prepend(str(out))
    _edit_meta(out, loss_fn={"function": "payload:loss"}, modules=["payload", __name__])
    with pytest.raises(PipelineInputError, match=r"payload.py, a file inside the export folder"):
        pdcompile.load(str(out))
    assert not marker.exists()


def test_edited_generated_code_never_runs(tmp_path: Path) -> None:
    """A payload added to graph.py: the manifest refuses the folder before any code runs;
    with a matching manifest forged too, the error the code raises is no longer swallowed."""
    out = _export(tmp_path / "out")
    marker = tmp_path / "ran"
    graph = out / "graph.py"
    graph.write_text(graph.read_text() + f"\nopen({str(marker)!r}, 'w').close()\n"
                     "raise RuntimeError('payload')\n")
    with pytest.raises(DamagedFileError, match=r"graph.py does not match its manifest"):
        pdcompile.load(str(out))
    assert not marker.exists()
    seal_export(out)
    with pytest.raises(DamagedFileError, match=r"graph.py cannot be imported \(RuntimeError"):
        pdcompile.load(str(out))


def test_generated_code_importing_another_module_is_refused(tmp_path: Path) -> None:
    out = _export(tmp_path / "out")
    stage = out / "stage_0.py"
    stage.write_text("import subprocess\n" + stage.read_text())
    seal_export(out)
    with pytest.raises(PipelineInputError, match=r"'subprocess' \(stage_0.py, line 1\)"):
        pdcompile.load(str(out))


def test_a_removed_step_in_a_rank_loop_is_refused(tmp_path: Path) -> None:
    """The issue's probe: `rt.step` removed from a rank file made stage 0 silently never train."""
    out = _export(tmp_path / "out")
    rank = out / "rank_0.py"
    rank.write_text("\n".join(line for line in rank.read_text().splitlines()
                              if "rt.step" not in line) + "\n")
    with pytest.raises(PdcompileError) as info:
        pdcompile.load(str(out))
    assert "rank_0.py does not match its manifest" in str(info.value)
    (out / "rank_7.py").write_text("def run_rank(rt):\n    yield\n")
    with pytest.raises(DamagedFileError, match=r"rank_7.py is not listed in MANIFEST.json"):
        pdcompile.load(str(out))


def _forge_manifest(folder: Path) -> None:
    """A manifest that matches the folder, written without the user's signing key (what anyone
    who can write the folder can do)."""
    from pdcompile.export.integrity import MANIFEST_NAME
    from pdcompile.util.manifest import write_manifest

    names = [p.name for p in folder.iterdir()
             if p.is_file() and p.name not in (MANIFEST_NAME, "MANIFEST.sig")]
    write_manifest(folder, names, kind="export", manifest_name=MANIFEST_NAME)


def test_code_edited_with_a_forged_manifest_never_runs_unless_trusted(tmp_path: Path) -> None:
    """A matching manifest is no longer enough: the writer's signature (export/signing.py) must
    verify under the user's key, so a payload with a forged manifest is refused before any
    code of the folder runs."""
    out = _export(tmp_path / "out")
    assert (out / "MANIFEST.sig").is_file()
    marker = tmp_path / "ran"
    stage = out / "stage_0.py"
    stage.write_text(stage.read_text() + f"\nopen({str(marker)!r}, 'w').close()\n")
    _forge_manifest(out)
    with pytest.raises(PipelineInputError) as info:
        pdcompile.load(str(out))
    message = str(info.value)
    assert "is not an export this user wrote" in message and "MANIFEST.sig does not match" \
        in message and "trust=True" in message and "\n" not in message
    assert not marker.exists()
    pdcompile.load(str(out), trust=True)  # the user's choice: its code runs
    assert marker.exists()


def test_an_export_signed_with_another_users_key_needs_trust(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCOMPILE_KEY", str(tmp_path / "theirs.key"))
    out = _export(tmp_path / "out")
    assert pdcompile.load(str(out)).loss_fn is user_loss  # theirs: signed and verified
    monkeypatch.setenv("PDCOMPILE_KEY", str(tmp_path / "mine.key"))
    with pytest.raises(PipelineInputError, match=r"this user has no signing key .*mine\.key"):
        pdcompile.load(str(out))
    _export(tmp_path / "other")  # now this user has a key, and it is not theirs
    with pytest.raises(PipelineInputError, match=r"MANIFEST.sig does not match the signing key"):
        pdcompile.load(str(out))
    assert pdcompile.load(str(out), trust=True).loss_fn is user_loss
    (out / "MANIFEST.sig").unlink()
    with pytest.raises(PipelineInputError, match=r"it has no MANIFEST.sig"):
        pdcompile.load(str(out))
    assert (tmp_path / "mine.key").stat().st_mode & 0o777 == 0o600


def test_without_a_writable_key_an_export_is_written_unsigned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only home: the export still writes (unsigned, with a warning) and loads with
    trust=True."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("PDCOMPILE_KEY", str(blocked / "export.key"))
    with pytest.warns(UserWarning, match="no signing key could be made"):
        out = _export(tmp_path / "out")
    assert not (out / "MANIFEST.sig").exists()
    with pytest.raises(PipelineInputError, match="it has no MANIFEST.sig"):
        pdcompile.load(str(out))
    assert pdcompile.load(str(out), trust=True).loss_fn is user_loss


def test_a_spurious_ast_recursion_error_of_cpython_is_parsed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython 3.11 before 3.11.8 may raise "AST constructor recursion depth mismatch" on a
    valid text when threads parse at once (gh-106905): exporting failed once in a long test
    run. The text is parsed again; another SystemError, or the same one every time, is raised."""
    import ast

    from pdcompile.export import trust

    real = ast.parse
    failures = iter([SystemError("AST constructor recursion depth mismatch (before=1, "
                                 "after=2)")])

    def flaky(text: str) -> ast.Module:
        for failure in failures:
            raise failure
        return real(text)

    monkeypatch.setattr(ast, "parse", flaky)
    assert [m for m, _ in trust._code_imports("import os\nfrom a.b import c\n")] == ["os", "a.b"]

    def always(text: str) -> ast.Module:
        raise SystemError("AST constructor recursion depth mismatch (before=1, after=2)")

    monkeypatch.setattr(ast, "parse", always)
    with pytest.raises(SystemError):
        trust.parsed("x = 1")
