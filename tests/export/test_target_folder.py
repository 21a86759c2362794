"""The folder an export is written into: the user's own files in it are never replaced or
removed, nothing is written or deleted through a link, and a writer stopped midway leaves a
folder that load refuses and a new export takes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export.target_folder import replaced_name
from pdcompile.pipeline import Pipeline
from tests.helpers.small_pipes import two_stage_pipe

# names a user's project folder may hold: some the export writes, some it never touches
_NAMES = ["README.md", "graph.py", "plan.json", "launch.sh", "schedule.txt", "stage_0.py",
          "example.pt", "user_code", "model.pt", "notes.txt", "train.py", "data.csv",
          "stage_0.pt", "pipeline.yaml", "é.json"]


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return two_stage_pipe()


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.sets(st.sampled_from(_NAMES), min_size=1, max_size=5), content=st.binary())
def test_a_folder_of_the_users_files_is_never_overwritten(
        pipe: Pipeline, tmp_path_factory: pytest.TempPathFactory, names: set[str],
        content: bytes) -> None:
    """Exporting into a folder that is not an export: refused in one line naming the folder and
    a file, with nothing changed, when the export would replace one of its files; otherwise
    written beside them, each of them as it was."""
    folder = tmp_path_factory.mktemp("project")
    for name in names:
        if name == "user_code":
            (folder / name).mkdir()
            (folder / name / "mine.py").write_bytes(content)
        else:
            (folder / name).write_bytes(content)
    before = _snapshot(folder)
    clash = sorted(n for n in names if replaced_name(n))
    if clash:
        with pytest.raises(PipelineInputError) as info:
            pipe.export(str(folder))
        message = str(info.value)
        assert str(folder) in message and "\n" not in message
        assert any(name in message for name in clash) and "new or empty folder" in message
        assert _snapshot(folder) == before
    else:
        pipe.export(str(folder))
        after = _snapshot(folder)
        assert {k: after[k] for k in before} == before
        pipe.export(str(folder))  # an export folder now: written again, theirs still kept
        assert {k: _snapshot(folder)[k] for k in before} == before
        assert pdcompile.load(str(folder)).plan == pipe.plan


def test_an_earlier_export_is_replaced_and_other_files_kept(pipe: Pipeline,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    pipe.export(str(out))
    (out / "notes.txt").write_text("mine")
    (out / "model.pt").write_text("my checkpoint")  # not a name of any export format
    (out / "stage_7.py").write_text("print('stale')")  # a larger pipeline's stage
    pipe.export(str(out))
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "model.pt").read_text() == "my checkpoint"
    assert not (out / "stage_7.py").exists()
    assert pdcompile.load(str(out)).plan == pipe.plan


def test_nothing_is_written_or_removed_through_a_link(pipe: Pipeline, tmp_path: Path) -> None:
    """An export folder whose user_code is a link to another folder and whose launch.sh and
    README.md are links (one dangling) out of it: exported again, the links are replaced by
    the export's own files and what they pointed at is as it was."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    pipe.export(str(out))
    outside.mkdir()
    (outside / "keep.py").write_text("x = 1\n")
    (outside / "target.md").write_text("theirs")
    os.symlink(outside, out / "user_code")
    (out / "launch.sh").unlink()
    os.symlink(outside / "created_by_export.sh", out / "launch.sh")  # dangling
    (out / "README.md").unlink()
    os.symlink(outside / "target.md", out / "README.md")
    before = _snapshot(outside)
    pipe.export(str(out))
    assert _snapshot(outside) == before
    assert not (out / "user_code").exists()
    for name in ("launch.sh", "README.md"):
        assert not (out / name).is_symlink() and (out / name).is_file()
    assert pdcompile.load(str(out)).plan == pipe.plan


def test_a_writer_stopped_midway_leaves_a_folder_that_is_refused_then_replaced(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer killed after the first stage's weights (as a crash would): load refuses the
    folder in one line, and exporting into it again works (it is known as an export)."""
    out = tmp_path / "out"
    pipe.export(str(out))
    (out / "README.md").write_text("changed")  # the earlier export's, under its name
    import pdcompile.export.write as writer

    real = writer.save_file
    calls: list[str] = []

    def dies_on_the_second(tensors: dict[str, torch.Tensor], path: str, **kw: object) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a kill leaves: nothing after this runs
        real(tensors, path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "save_file", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        pipe.export(str(out))
    monkeypatch.setattr(writer, "save_file", real)
    with pytest.raises((DamagedFileError, PipelineInputError)) as info:
        pdcompile.load(str(out))
    assert "\n" not in str(info.value) and "export the pipeline again" in str(info.value)
    pipe.export(str(out))
    loaded = pdcompile.load(str(out))
    for a, b in zip(pipe.stage_modules, loaded.stage_modules, strict=True):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(),
                                     strict=True):
            assert torch.equal(x, y), name
    shutil.rmtree(out)


def test_a_second_writer_at_the_same_time_is_refused(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two exports into one folder at once (here: a second one started while the first writes
    its weights) would leave one manifest over both pipelines' files; the second is refused
    in one line and the first completes whole."""
    import pdcompile.export.write as writer

    out = tmp_path / "out"
    real = writer.save_file
    refused: list[str] = []

    def second_writer_meanwhile(tensors: dict[str, torch.Tensor], path: str,
                                **kw: object) -> None:
        if not refused:
            with pytest.raises(PipelineInputError) as info:
                pipe.export(str(out))
            refused.append(str(info.value))
        real(tensors, path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "save_file", second_writer_meanwhile)
    pipe.export(str(out))
    assert "another export is being written" in refused[0] and "\n" not in refused[0]
    monkeypatch.setattr(writer, "save_file", real)
    assert pdcompile.load(str(out)).plan == pipe.plan
    pipe.export(str(out))  # the lock is released with the first writer


@pytest.mark.parametrize("inside", [False, True])
def test_a_file_where_the_folder_would_be_is_refused_and_kept(pipe: Pipeline, tmp_path: Path,
                                                              inside: bool) -> None:
    """mkdir's FileExistsError (or NotADirectoryError, for a folder under a file) came out of
    Pipeline.export as it was."""
    taken = tmp_path / "weights.pt"
    taken.write_bytes(b"mine")
    target = taken / "out" if inside else taken
    with pytest.raises(PipelineInputError, match=rf"^cannot export into {target}: {taken} is a "
                                                 r"file, not a folder; export into a new"):
        pipe.export(str(target))
    assert taken.read_bytes() == b"mine"
