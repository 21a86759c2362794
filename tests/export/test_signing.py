"""The user's signing key as it may be found: empty or short (anyone could sign with it),
readable by others, a folder, or made by several threads at once. A key anyone could sign
with signs and verifies nothing; the others give one line; threads share one key."""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.export import signing
from pdcompile.pipeline import Pipeline
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
