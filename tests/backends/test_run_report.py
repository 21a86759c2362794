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
