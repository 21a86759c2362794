"""The loss file of a run folder two runs share: each run's final rewrite is whole."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from pdcompile.backends import run_report
from pdcompile.backends.run_report import LOSSES_FILE, RunReport


def test_two_runs_finishing_at_once_in_one_folder_leave_one_whole_loss_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run B finishes while run A is between writing its temporary file and renaming it
    (before: both used losses.csv.tmp, so A's rename found B's file gone and A failed after
    training; now each has its own, and the file is the last finisher's, whole)."""
    a = RunReport(tmp_path, total=3, out=io.StringIO(), bar=False)
    b = RunReport(tmp_path, total=2, out=io.StringIO(), bar=False)
    for step, loss in enumerate([1.0, 2.0, 3.0]):
        a(step, loss)
    for step, loss in enumerate([7.0, 8.0]):
        b(step, loss)
    real = os.replace
    calls = []

    def replace(src: str, dst: str) -> None:
        calls.append(src)
        if len(calls) == 1:  # A is about to rename: B finishes first
            b.close([7.0, 8.0])
        real(src, dst)

    monkeypatch.setattr(run_report.os, "replace", replace)
    a.close([1.0, 2.0, 3.0])
    lines = (tmp_path / LOSSES_FILE).read_text().splitlines()
    assert lines[1:] == ["1,1.0", "2,2.0", "3,3.0"]
    assert [p.name for p in tmp_path.iterdir()] == [LOSSES_FILE]  # no temporary file left


@pytest.mark.parametrize("earlier, kept", [
    (b"step,loss\n1,0.5\n2,0.4\xff\n", ["1,0.5"]),
    (b"step,loss\n1,0.5\n\xc2\xb2,0.4\n", ["1,0.5"]),
    (b"step,loss\n1,nan\n2,0.25\n3,0.125\n", ["1,nan", "2,0.25"]),
    (b"\xff\xfe\x00", []),
    (None, []),
    ("link", []),
], ids=["bad-byte", "superscript-digit", "as-written", "not-text", "fifo", "link"])
def test_a_resumed_run_keeps_what_it_can_of_a_damaged_loss_file(
        tmp_path: Path, earlier: bytes | str | None, kept: list[str]) -> None:
    """A run resumed at step 2 over an earlier loss file with a damaged byte, a digit that is
    no ASCII one, or a pipe in its place: the lines that read as losses are kept, the rest
    dropped, and the run goes on; a link is replaced, its target left alone. Before, the
    reporting rank raised UnicodeDecodeError or ValueError (its run failed after resuming),
    waited on the pipe forever, or overwrote the link's target."""
    from tests.helpers.byte_damage import bounded

    file = tmp_path / LOSSES_FILE
    target = tmp_path / "elsewhere.txt"
    target.write_text("the user's own file\n")
    if earlier is None:
        os.mkfifo(file)
    elif earlier == "link":
        file.symlink_to(target)
    else:
        file.write_bytes(earlier)
    report = RunReport(tmp_path, total=None, out=io.StringIO(), bar=False)
    with bounded(30):
        report(2, 0.0625)
        report.close()
    assert file.read_text().splitlines() == ["step,loss", *kept, "3,0.0625"]
    assert target.read_text() == "the user's own file\n" and not file.is_symlink()
