"""A checkpoint folder edited by someone else: what is loaded is what was checked, and links,
pipes or devices where pdcompile writes plain files are refused in one line, without a hang."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.errors import DamagedFileError, DistributedError
from pdcompile.runtime import checkpoint, verified_read
from pdcompile.runtime.checkpoint import Checkpointer
from pdcompile.runtime.tensor_tree import save_tree
from tests.helpers.byte_damage import bounded, damage

pytestmark = pytest.mark.timeout(30)  # the old reader hung on a pipe: fail, do not wait


def _saved(folder: Path) -> Checkpointer:
    ckpt = Checkpointer(folder, rank=0, every=1)
    ckpt.save(1, {"w": torch.ones(4)})
    return ckpt


_STATE = {"w": torch.arange(6.0).reshape(2, 3), "losses": [0.5, 0.25], "rng": torch.get_rng_state(),
          "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3, dtype=torch.float64)}},
                        "param_groups": [{"lr": 0.1, "params": [0]}]}, "step_names": ("a", "b")}


def _equal(a: Any, b: Any) -> bool:
    """Equal values: tensors bit for bit and of the same dtype, containers of the same type."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.timeout(300)  # 150 loads; each is bounded on its own
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damage_anywhere_is_refused_or_changes_nothing(tmp_path_factory: pytest.TempPathFactory,
                                                      data: st.DataObject) -> None:
    """A saved checkpoint's file or manifest with bytes flipped anywhere, cut short or
    extended: loading it gives exactly what was saved, or one DamagedFileError naming the file
    (no other exception, no hang), and the step is not offered to a resume."""
    ckpt = Checkpointer(tmp_path_factory.mktemp("damage"), rank=0, every=1)
    ckpt.save(1, _STATE)
    expected = ckpt.load(1)
    damage(data, [p for p in ckpt.rank_dir().iterdir() if p.name.startswith("step_")])
    try:
        with bounded(30):
            found = ckpt.load(1)
    except DamagedFileError as err:
        assert "\n" not in str(err) and str(ckpt.rank_dir()) in str(err), str(err)
        assert ckpt.resume_step(1) is None
        return
    assert _equal(found, expected) and ckpt.resume_step(1) == 1


@pytest.mark.parametrize("size", ["Infinity", "-Infinity", "1e999", "NaN", "1.5", "true", "-1",
                                  '"12"'])
def test_a_manifest_size_that_is_not_a_number_of_bytes_is_one_line(tmp_path: Path,
                                                                   size: str) -> None:
    """A hand-edited manifest whose size is not a whole number of bytes: Infinity raised
    int()'s OverflowError as a raw traceback, and 1.5 or true were read as 1."""
    ckpt = _saved(tmp_path)
    manifest = ckpt.rank_dir() / "step_00000001.manifest.json"
    data = json.loads(manifest.read_text())
    (entry,) = data["files"].values()
    manifest.write_text(json.dumps(data).replace(f'"size": {entry["size"]}', f'"size": {size}'))
    with pytest.raises(DamagedFileError) as info:
        ckpt.load(1)
    assert "\n" not in str(info.value) and f"{manifest} is altered" in str(info.value)
    assert ckpt.resume_step(1) is None


def test_the_bytes_loaded_are_the_bytes_checked(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is swapped for another checkpoint (same rank and step, other weights) right
    after its manifest check passes: the load still returns the checked weights (before, the
    file was opened again after the check, and the swapped one was loaded unchecked)."""
    ckpt = _saved(tmp_path)
    path = ckpt.rank_dir() / "step_00000001.safetensors"
    other = save_tree(tmp_path / "other.safetensors",
                      {"w": torch.full((4,), 666.0), "step": 1, "rank": 0}).read_bytes()
    original = verified_read.check_entry

    def check_then_swap(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        path.write_bytes(other)

    monkeypatch.setattr(verified_read, "check_entry", check_then_swap)
    torch.testing.assert_close(ckpt.load(1)["w"], torch.ones(4))


def test_a_link_in_place_of_a_checkpoint_is_refused(tmp_path: Path) -> None:
    """A link in place of the file, even to a copy whose bytes match the manifest: pdcompile
    writes no links there, and following one reads whatever file of the machine it names."""
    ckpt = _saved(tmp_path)
    path = ckpt.rank_dir() / "step_00000001.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    path.replace(elsewhere)
    path.symlink_to(elsewhere)
    for read in (ckpt.load, ckpt.verify):
        with pytest.raises(DamagedFileError) as info:
            read(1)
        message = str(info.value)
        assert "\n" not in message and f"{path} is a link (to {elsewhere})" in message, message
    assert ckpt.verified_steps()[0] == [] and ckpt.resume_step(1) is None


@pytest.mark.parametrize("name", ["step_00000001.safetensors", "step_00000001.manifest.json"])
def test_a_pipe_in_place_of_a_checkpoint_file_is_refused_without_a_hang(tmp_path: Path,
                                                                        name: str) -> None:
    """A FIFO named as the file or its manifest: loading it waited for a writer forever (the
    manifest), or said there was no checkpoint (the file); neither is a complete step."""
    ckpt = _saved(tmp_path)
    path = ckpt.rank_dir() / name
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(DamagedFileError, match="is not a plain file"):
        ckpt.load(1)
    assert ckpt.verified_steps()[0] == [] and ckpt.resume_step(1) is None


def test_a_manifest_linked_elsewhere_is_refused(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    manifest = ckpt.rank_dir() / "step_00000001.manifest.json"
    elsewhere = tmp_path / "elsewhere.json"
    manifest.replace(elsewhere)
    manifest.symlink_to(elsewhere)
    with pytest.raises(DamagedFileError, match=f"{manifest} is a link"):
        ckpt.load(1)


def test_a_writer_lock_linked_elsewhere_is_refused_and_nothing_is_created_there(
        tmp_path: Path) -> None:
    """A dangling link named as a rank's writer lock: claiming the lock once created (empty) the
    file it names, wherever that is."""
    ckpt = Checkpointer(tmp_path / "ckpt", rank=0, every=1)
    ckpt.rank_dir().mkdir(parents=True)
    target = tmp_path / "elsewhere" / "created.txt"
    target.parent.mkdir()
    (ckpt.rank_dir() / checkpoint.LOCK_NAME).symlink_to(target)
    with pytest.raises(DamagedFileError, match=r"\.writer\.lock is a link"):
        ckpt.claim()
    assert not target.exists()


def _dead_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_a_rank_folder_linked_elsewhere_is_refused_and_nothing_there_is_touched(
        tmp_path: Path) -> None:
    """rank_0 a link to another folder: a save wrote its files there, and its clean-up deleted
    that folder's files named like a killed writer's temporary file."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kept = elsewhere / f".step_00000001.safetensors.{_dead_pid()}.tmp"
    kept.write_text("not pdcompile's")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "rank_0").symlink_to(elsewhere)
    ckpt = Checkpointer(tmp_path / "ckpt", rank=0, every=1)
    for act in (ckpt.claim, ckpt.remove_stale, lambda: ckpt.save(1, {"w": torch.ones(2)})):
        with pytest.raises(DistributedError, match=f"{ckpt.rank_dir()} is a link"):
            act()
    assert sorted(elsewhere.iterdir()) == [kept]


def test_only_the_temporary_files_a_save_writes_are_removed(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    dead = _dead_pid()
    mine = ckpt.rank_dir() / f".step_00000002.safetensors.{dead}.tmp"
    theirs = ckpt.rank_dir() / f".notes.{dead}.tmp"  # a name a save never writes
    for path in (mine, theirs):
        path.write_text("x")
    assert ckpt.remove_stale() == [mine] and theirs.exists()
