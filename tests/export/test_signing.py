"""The user's signing key as it may be found: empty or short (anyone could sign with it),
readable by others, a folder, or made by several threads at once. A key anyone could sign
with signs and verifies nothing; the others give one line; threads share one key."""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import pdcompile
from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export import signing
from pdcompile.pipeline import Pipeline
from pdcompile.util.manifest import MAX_JSON_BYTES
from tests.helpers.byte_damage import bounded
from tests.helpers.small_pipes import two_stage_pipe


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return two_stage_pipe()


@pytest.mark.parametrize("key", [b"", b"0123456789abcdef"], ids=["empty", "16-bytes"])
def test_a_key_anyone_could_guess_neither_signs_nor_verifies(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: bytes) -> None:
    """Before, an empty key file (PDCOMPILE_KEY=/dev/null, a `touch`ed file) signed with the
    empty key, so anyone could write a MANIFEST.sig this user's load accepted."""
    key_file = tmp_path / "export.key"
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    monkeypatch.setenv("PDCOMPILE_KEY", str(key_file))
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="fewer than 32 random"):
        pipe.export(str(out))
    assert not (out / "MANIFEST.sig").exists()
    forged = hmac.new(key, (out / "MANIFEST.json").read_bytes(), hashlib.sha256).hexdigest()
    (out / "MANIFEST.sig").write_text(forged + "\n")
    with pytest.raises(PipelineInputError) as info:
        pdcompile.load(str(out))
    message = str(info.value)
    assert "cannot be used" in message and str(key_file) in message and "\n" not in message
    assert pdcompile.load(str(out), trust=True).plan == pipe.plan


def test_a_key_others_may_read_neither_signs_nor_verifies(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "export.key"
    monkeypatch.setenv("PDCOMPILE_KEY", str(key_file))
    out = tmp_path / "out"
    pipe.export(str(out))  # the key made now, mode 600: signed
    assert pdcompile.load(str(out)).plan == pipe.plan
    key_file.chmod(0o644)
    with pytest.raises(PipelineInputError, match=f"chmod 600 {key_file}"):
        pdcompile.load(str(out))
    with pytest.warns(UserWarning, match="may be read or written by other users"):
        pipe.export(str(out))
    key_file.chmod(0o600)
    pipe.export(str(out))
    assert pdcompile.load(str(out)).plan == pipe.plan


def test_a_key_path_that_is_a_folder_is_one_line(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    pipe.export(str(out))
    monkeypatch.setenv("PDCOMPILE_KEY", str(tmp_path))  # a folder
    with pytest.raises(PipelineInputError) as info:
        pdcompile.load(str(out))
    assert "signing key cannot be used" in str(info.value) and "\n" not in str(info.value)


def test_threads_making_the_key_at_once_share_one(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, threads of one process wrote one temporary file (named by the pid) and all but
    one failed, leaving their exports unsigned."""
    for attempt in range(40):
        monkeypatch.setenv("PDCOMPILE_KEY", str(tmp_path / f"key{attempt}"))
        keys: list[bytes | None] = []
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_make_key, args=(keys, errors)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors
        assert len(keys) == 4 and len(set(keys)) == 1 and len(keys[0] or b"") == 32
        assert {p.name for p in tmp_path.iterdir()} == {f"key{i}" for i in range(attempt + 1)}


def _make_key(keys: list[bytes | None], errors: list[BaseException]) -> None:
    try:
        keys.append(signing._key(create=True))
    except BaseException as err:  # noqa: BLE001 (reported by the test)
        errors.append(err)


def _to_big_file(out: Path) -> None:
    big = out.parent / "big"
    with open(big, "wb") as handle:  # sparse: no disk used
        handle.truncate(1 << 30)
    (out / "MANIFEST.sig").unlink()
    (out / "MANIFEST.sig").symlink_to(big)


def _to_own_copy(out: Path) -> None:
    copy = out.parent / "copy.sig"
    copy.write_bytes((out / "MANIFEST.sig").read_bytes())
    (out / "MANIFEST.sig").unlink()
    (out / "MANIFEST.sig").symlink_to(copy)


def _large(out: Path) -> None:
    with open(out / "MANIFEST.sig", "ab") as handle:
        handle.truncate(1 << 30)


@pytest.mark.parametrize("change", [_to_big_file, _to_own_copy, _large],
                         ids=["link-to-1-gib", "link-to-a-copy", "1-gib-file"])
def test_a_signature_that_is_no_file_the_writer_made_is_refused_unread(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        change: Callable[[Path], None]) -> None:
    """MANIFEST.sig a link (to a file of a gigabyte, or to a copy of the right signature) or a
    gigabyte itself: refused in one line saying so, without reading it (before, it was read
    whole: a gigabyte into memory). A link is refused even to the right bytes, as the loader
    refuses links among the export's files (the writer makes none); trust=True loads it."""
    monkeypatch.setenv("PDCOMPILE_KEY", str(tmp_path / "export.key"))
    out = tmp_path / "out"
    pipe.export(str(out))
    change(out)
    with bounded(30), pytest.raises(PipelineInputError) as info:
        pdcompile.load(str(out))
    message = str(info.value)
    assert "not a plain file of a signature's size" in message and "\n" not in message
    assert pdcompile.load(str(out), trust=True).plan == pipe.plan


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _over_any_whole_file(path: Path) -> None:
    with open(path, "wb") as handle:  # sparse: no disk used
        handle.truncate(MAX_JSON_BYTES + 1)
    path.chmod(0o600)


@pytest.mark.parametrize("make", [_fifo, _over_any_whole_file], ids=["fifo", "huge"])
def test_a_key_file_that_is_a_pipe_or_huge_is_refused_unread(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        make: Callable[[Path], None]) -> None:
    """PDCOMPILE_KEY naming a pipe, or a file one byte over any file pdcompile reads whole:
    refused in one line naming it and the fix, at once, both by load and by export (which
    leaves the export unsigned, with a warning). Before, the pipe waited for a writer forever
    and the file was read whole into memory (then signed and verified nothing it wrote)."""
    out = tmp_path / "out"
    pipe.export(str(out))
    key_file = tmp_path / "odd.key"
    make(key_file)
    monkeypatch.setenv("PDCOMPILE_KEY", str(key_file))
    with bounded(10), pytest.raises(PipelineInputError) as info:
        pdcompile.load(str(out))
    message = str(info.value)
    assert "signing key cannot be used" in message and str(key_file) in message, message
    assert "set PDCOMPILE_KEY to a path of your own" in message and "\n" not in message
    with bounded(10), pytest.warns(UserWarning, match="set PDCOMPILE_KEY to a path"):
        pipe.export(str(tmp_path / "unsigned"))
    assert not (tmp_path / "unsigned" / "MANIFEST.sig").exists()


def test_a_manifest_over_any_json_file_is_refused_unread_by_its_signature_check(
        pipe: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`unsigned_reason` without the caller's manifest bytes reads MANIFEST.json itself, as
    the loader reads it: one byte over any JSON file pdcompile writes is refused in one line
    naming it, at once. Before, it was read whole into memory and hashed."""
    monkeypatch.setenv("PDCOMPILE_KEY", str(tmp_path / "export.key"))
    out = tmp_path / "out"
    pipe.export(str(out))
    with open(out / "MANIFEST.json", "ab") as handle:
        handle.truncate(MAX_JSON_BYTES + 1)
    with bounded(10), pytest.raises(DamagedFileError) as info:
        signing.unsigned_reason(out, "MANIFEST.json")
    message = str(info.value)
    assert str(out / "MANIFEST.json") in message and f"({MAX_JSON_BYTES:,})" in message
    assert "export the pipeline again" in message and "\n" not in message
