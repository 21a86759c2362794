"""A user's file read only as a plain file of bounded size, and the one line that refuses any
other (`refusal`): a folder, a FIFO or a device, a file over the limit, each named with the
role the reader gave it, the file's path and the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal
from tests.helpers.byte_damage import bounded


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_a_folder_is_refused_as_one_and_its_descriptor_closed(tmp_path: Path) -> None:
    """Before, os.fdopen refused the folder's descriptor first (IsADirectoryError naming the
    descriptor's number, "Is a directory: 3") and left it open: one descriptor lost a call."""
    before = _open_descriptors()
    for _ in range(50):
        with pytest.raises(NotPlainFile) as info:
            read_plain_file(tmp_path, 1 << 20)
        assert info.value.kind == "folder"
    assert _open_descriptors() == before


def _refused(path: Path, limit: int) -> NotPlainFile:
    with bounded(5), pytest.raises(NotPlainFile) as info:
        read_plain_file(path, limit)
    return info.value


def test_each_kind_is_named_in_one_line_with_the_role_path_and_fix(tmp_path: Path) -> None:
    fifo, huge = tmp_path / "fifo.json", tmp_path / "huge.json"
    os.mkfifo(fifo)
    with huge.open("wb") as handle:
        handle.truncate(3 << 30)  # sparse: no disk used
    cases = {"folder": (tmp_path, "is a folder, not a plain file"),
             "special": (fifo, "is not a plain file but a FIFO (a named pipe)"),
             "large": (huge, f"holds {3 << 30:,} bytes, more than the most (1,024)")}
    for kind, (path, what) in cases.items():
        why = _refused(path, 1024)
        assert why.kind == kind
        message = refusal(why, path, role="the thing", limit=1024, because="the most",
                          fix="give another")
        assert message == f"the thing {path} {what}; give another", message
    assert refusal(NotPlainFile("grew", 1025), "f", role="", limit=1024, because="the most",
                   fix="fix") == "f grew past 1,024 bytes while read, more than the most; fix"


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_device_is_refused_unread() -> None:
    why = _refused(Path("/dev/zero"), 1024)
    assert why.kind == "special"
    assert "is not a plain file but a device;" in refusal(
        why, "/dev/zero", role="", limit=1024, because="", fix="")


@given(size=st.integers(0, 4096), limit=st.integers(0, 4096))
def test_a_plain_file_is_read_whole_up_to_the_limit_and_refused_past_it(
        tmp_path_factory: pytest.TempPathFactory, size: int, limit: int) -> None:
    file = tmp_path_factory.mktemp("plain") / "file"
    file.write_bytes(b"x" * size)
    if size <= limit:
        assert read_plain_file(file, limit) == b"x" * size
    else:
        why = _refused(file, limit)
        assert (why.kind, why.size) == ("large", size)
