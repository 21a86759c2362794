"""Watchdogs that name the cause (`pdcompile run`): a rank stuck in the data function is named
within the fault timeout, a model's error ends in one line naming rank, stage and microbatch
(its traceback once, above), a non-finite loss stops the run naming step, rank and stage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Fragile(nn.Module):
    """Raises on an input with a huge value, as a model's own check would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.abs().max()) > 1e6:
            raise ValueError("boom: an input beyond 1e6")
        return x


def _export(folder: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(Fragile(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 16),),
                             example_target=torch.randint(0, 4, (8,)),
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule="1f1b-flush", microbatches=2, leaf_modules=[Fragile])
    pipe.export(str(folder))
    return folder


DATA = '''
import time
from pathlib import Path

import torch


def batches():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for index in range(1000):
        if index == {at}:
            {action}
        yield (x,), y
'''


DROP_SEND = '''
import pdcompile.runtime.stage_runtime as stage_runtime

_send_b = stage_runtime.StageRuntime.send_b


def send_b(self, microbatch, dst):
    if self.stage != 1 or microbatch % 2 == 0:
        yield from _send_b(self, microbatch, dst)
        return
    transport = self.transport
    send = transport.send
    transport.send = lambda *args, **kwargs: None
    try:
        yield from _send_b(self, microbatch, dst)
    finally:
        transport.send = send


stage_runtime.StageRuntime.send_b = send_b
'''


def _run(tmp_path: Path, action: str, *extra: str, at: int = 6
         ) -> tuple[str, int, dict[str, float]]:
    """`pdcompile run` on data that does `action` at minibatch `at`: its output, exit status
    and when (time.time()) each line of the output was read."""
    folder = _export(tmp_path / "exported")
    (tmp_path / "data_fn.py").write_text(DATA.format(at=at, action=action))
    proc = subprocess.Popen([sys.executable, "-m", "pdcompile", "run", str(folder), "--nproc",
                             "2", "--threads", "1", "--data",
                             f"{tmp_path / 'data_fn.py'}:batches", "--steps", "40", *extra],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen: dict[str, float] = {}
    killer = threading.Timer(150, lambda: os.killpg(proc.pid, signal.SIGKILL))
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.setdefault(line.rstrip("\n"), time.time())
        proc.wait()
    finally:
        killer.cancel()
    return "\n".join(seen), proc.returncode, seen


def test_a_data_function_that_blocks_is_named_within_the_fault_timeout(tmp_path: Path) -> None:
    marker = tmp_path / "blocked_at"
    out, code, seen = _run(tmp_path, f"Path({str(marker)!r}).write_text(str(time.time())); "
                                     "time.sleep(600)", "--fault-timeout", "2")
    ended = time.time()
    assert code == 1, out
    blocked_at = float(marker.read_text())
    named_at = min(when for line, when in seen.items() if "made no progress" in line)
    print(f"a blocked data function was named {named_at - blocked_at:.1f} s after it blocked; "
          f"the run ended {ended - blocked_at:.1f} s after it blocked")
    assert named_at - blocked_at < 2 + 2, out  # the timeout and a few monitor periods
    assert ended - blocked_at < 60, out
    assert "rank 0 made no progress for" in out and "reading minibatch 6 from the data " \
        "function" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("pdcompile run: error: the distributed run failed: rank 0 made no "
                           "progress"), out
    assert "Traceback" not in out


def test_a_model_error_ends_in_one_line_naming_where(tmp_path: Path) -> None:
    out, code, _ = _run(tmp_path, "x = x.clone(); x[0, 0] = 1e9")
    assert code == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out  # the model's, once
    assert "ValueError: boom: an input beyond 1e6" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("pdcompile run: error: the distributed run failed: rank 0 (stage 0) "
                           "in the forward of microbatch 12 raised ValueError: boom"), out


def test_a_non_finite_loss_stops_the_run_naming_step_rank_and_stage(tmp_path: Path) -> None:
    out, code, _ = _run(tmp_path, "x = x.clone(); x[0, 0] = float('nan')", at=5)
    assert code == 1, out
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert "step 5: the loss is nan on rank 1 (stage 1" in last, out
    kept = _run(tmp_path / "again", "x = x.clone(); x[0, 0] = float('nan')",
                "--allow-nonfinite", at=5)
    assert kept[1] == 0, kept[0]


def test_ranks_that_wait_for_each_other_are_named_within_the_fault_timeout(
        tmp_path: Path) -> None:
    """Ranks that disagree (stage 1's send of the second microbatch's gradients never leaves
    it): every rank ends up waiting for the other. The issue's probe of an edited loop hung 136 s
    and ended in an AssertionError; now the deadlock is named, with what each rank waits for,
    within the fault timeout. The loader refuses an edited rank file, so the send is dropped in
    the processes themselves (a sitecustomize module on their path)."""
    folder = _export(tmp_path / "exported")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "sitecustomize.py").write_text(DROP_SEND)
    (tmp_path / "data_fn.py").write_text(DATA.format(at=10 ** 6, action="pass"))
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "pdcompile", "run", str(folder), "--nproc", "2",
                           "--threads", "1", "--data", f"{tmp_path / 'data_fn.py'}:batches",
                           "--steps", "40", "--fault-timeout", "3"],
                          env={**os.environ, "PYTHONPATH": f"{patches}{os.pathsep}{ROOT}"},
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=150)
    took = time.time() - start
    out = done.stdout
    print(f"a deadlock ended the run {took:.1f} s after it started")
    assert done.returncode == 1, out
    assert "every rank is waiting for another (rank 0 waits for receive of" in out, out
    assert "rank 1 waits for" in out, out
    assert "Traceback" not in out, out
    assert took < 60, out
