"""Per-stage checkpoints: atomic files, the common resume step, state round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pdcompile.errors import DamagedFileError, DistributedError
from pdcompile.runtime.checkpoint import Checkpointer, module_state, restore_module_state


def test_save_is_atomic_and_keeps_the_newest(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, rank=1, every=2, keep=2)
    assert [s for s in range(7) if ckpt.due(s)] == [2, 4, 6]
    for step in (2, 4, 6):
        ckpt.save(step, {"x": torch.tensor([step])})
    assert ckpt.steps() == [4, 6]
    assert sorted(p.name for p in ckpt.rank_dir().iterdir()) == [
        "step_00000004.manifest.json", "step_00000004.safetensors",
        "step_00000006.manifest.json", "step_00000006.safetensors"]
    # a crash in the middle of a save leaves only a temporary file, which is never read
    (ckpt.rank_dir() / ".step_00000008.safetensors.123.tmp").write_bytes(b"torn")
    assert ckpt.steps() == [4, 6]
    assert int(ckpt.load(6)["x"]) == 6


def test_resume_from_newest_step_every_rank_has(tmp_path: Path) -> None:
    ranks = [Checkpointer(tmp_path, rank=r, every=1, keep=3) for r in range(3)]
    assert ranks[0].resume_step(3) is None
    for step in (1, 2):
        for ck in ranks:
            ck.save(step, {})
    ranks[0].save(3, {})  # the crash came before ranks 1 and 2 saved step 3
    assert ranks[2].resume_step(3) == 2
    with pytest.raises(DistributedError, match="no checkpoint of rank 1 at step 3"):
        ranks[1].load(3)


def test_module_and_optimizer_state_round_trip(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, rank=0, every=1)
    ckpt.save(1, module_state(model, opt, data_position=1))
    expected = torch.randn(2)  # the RNG stream continues from the saved point

    other = nn.Linear(3, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    state = ckpt.load(1)
    restore_module_state(state, other, other_opt)
    assert state["data_position"] == 1
    torch.testing.assert_close(other.weight, model.weight)
    buf = other_opt.state[other.weight]["momentum_buffer"]
    torch.testing.assert_close(buf, opt.state[model.weight]["momentum_buffer"])
    torch.manual_seed(123)
    restore_module_state(state, other, None)
    torch.testing.assert_close(torch.randn(2), expected)


def test_a_damaged_checkpoint_is_named_in_one_line(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, rank=0, every=1)
    path = ckpt.save(1, module_state(model, opt, losses=[0.5]))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(DamagedFileError) as info:
        ckpt.load(1)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "truncated" in message
    # a checkpoint of another rank or step under this name
    Checkpointer(tmp_path, rank=1, every=1).save(1, module_state(model, opt))
    (tmp_path / "rank_1" / "step_00000001.safetensors").replace(path)
    with pytest.raises(DamagedFileError, match=r"does not match its manifest \(\d+ bytes"):
        ckpt.load(1)
    # manifest and all (both list "step_00000001.safetensors"): the content check names it
    (tmp_path / "rank_1" / "step_00000001.manifest.json").replace(
        path.with_name("step_00000001.manifest.json"))
    with pytest.raises(DamagedFileError, match=r"holds rank 1 step 1, not rank 0 step 1"):
        ckpt.load(1)
    # one of another model: named when restored
    ckpt.save(2, module_state(nn.Linear(5, 2), None))
    with pytest.raises(DamagedFileError, match=r"the checkpoint does not fit this stage"):
        restore_module_state(ckpt.load(2), model, opt)


def _dead_pid() -> int:
    """A pid no process has (as a writer killed mid-save): above the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    import os

    ckpt = Checkpointer(tmp_path, rank=0, every=1)
    ckpt.save(1, {"x": torch.zeros(3)})
    dead = ckpt.rank_dir() / f".step_00000002.safetensors.{_dead_pid()}.tmp"
    alive = ckpt.rank_dir() / f".step_00000002.safetensors.{os.getppid()}.tmp"
    for path in (dead, alive):
        path.write_bytes(b"torn" * 1000)
    ckpt.save(2, {"x": torch.ones(3)})
    assert not dead.exists()  # its writer is gone
    assert alive.exists()  # another live process may still be writing it
    assert ckpt.steps() == [1, 2]


def test_a_step_without_its_manifest_is_not_complete(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, rank=0, every=1, keep=3)
    for step in (1, 2):
        ckpt.save(step, {"x": torch.tensor([step])})
    (ckpt.rank_dir() / "step_00000002.manifest.json").unlink()  # killed before the manifest
    assert ckpt.steps() == [1] and ckpt.resume_step(1) == 1


@settings(max_examples=12, deadline=None)
@given(position=st.integers(min_value=0, max_value=10 ** 6), bit=st.integers(0, 7))
def test_one_flipped_bit_is_refused_and_resume_falls_back(tmp_path_factory: Any, position: int,
                                                          bit: int) -> None:
    """Any single bit of the newest checkpoint flipped on disk: `verify` names the file in one
    line, `load` refuses it, and the resume step is the previous checkpoint."""
    folder = tmp_path_factory.mktemp("ckpt")
    ranks = [Checkpointer(folder, rank=r, every=1, keep=3) for r in range(2)]
    for step in (1, 2):
        for ck in ranks:
            ck.save(step, module_state(nn.Linear(8, 8), None, losses=[0.5] * step))
    path = ranks[1].rank_dir() / "step_00000002.safetensors"
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError) as info:
        ranks[1].load(2)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "does not match its manifest" in message
    good, bad = ranks[1].verified_steps()
    assert good == [1] and [d.step for d in bad] == [2]
    assert ranks[0].resume_step(2) == 1


def test_a_second_run_writing_the_same_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    """Two runs given one checkpoint folder at once: the second rank to claim a rank's folder
    is refused naming the folder (before, both wrote step_<k> of each rank, the last rename
    winning per rank, so a resume could mix ranks of two runs). Another rank's folder is free;
    the folder is free again once the first releases it (or its process ends)."""
    first = Checkpointer(tmp_path / "ck", rank=0, every=1)
    first.claim()
    first.save(1, {"w": torch.ones(2)})
    second = Checkpointer(tmp_path / "ck", rank=0, every=1)
    with pytest.raises(DistributedError) as info:
        second.claim()
    assert "\n" not in str(info.value) and str(tmp_path / "ck") in str(info.value)
    assert "another checkpoint folder" in str(info.value)
    other_rank = Checkpointer(tmp_path / "ck", rank=1, every=1)
    other_rank.claim()
    first.release()
    second.claim()
    assert second.steps() == [1]  # the lock file is not a checkpoint
    second.release()
    other_rank.release()
