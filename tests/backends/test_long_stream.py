"""A long run on an endless data iterator stays within a fixed address space: `pdcompile run`
without --steps trains until stopped, reading minibatches as it needs them, under an
RLIMIT_AS cap a little above what importing torch reserves (a run that read its stream ahead,
as asynchronous runs did, fails within seconds)."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from tests.helpers.processes import run_bounded

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# address space a process may take beyond what `import torch` reserves (624 MB here): gloo's
# threads and their stacks, malloc's arenas, the model, a window of minibatches (measured on the
# 2-core VM, 2026-11-25: workers of this run peaked at 1078 and 1137 MB, +454 and +513 MB)
HEADROOM = 1000 * 2**20
STEPS = 3000

DATA = """\
import torch

def endless():
    while True:
        yield torch.randn(8, 16), torch.randint(0, 4, (8,))
"""


def _torch_reserves() -> int:
    """Bytes of address space a fresh process holds after importing torch (measured here)."""
    code = ("import re, torch, torch.distributed; print(re.search(r'VmSize:\\s+(\\d+)', "
            "open('/proc/self/status').read()).group(1))")
    done = run_bounded([sys.executable, "-c", code], timeout=120)
    return int(done.stdout.split()[-1]) * 1024


def _capped(cap: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-flush"])
def test_an_endless_stream_trains_until_stopped_under_a_memory_cap(tmp_path: Path,
                                                                   schedule: str) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 16),),
                             example_target=torch.randint(0, 4, (8,)),
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule=schedule, microbatches=2)
    export = tmp_path / "pipe"
    pipe.export(str(export))
    (tmp_path / "data.py").write_text(DATA)
    cap = _torch_reserves() + HEADROOM
    run_dir = tmp_path / "run"
    losses = run_dir / "losses.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcompile", "run", str(export), "--data",
         f"{tmp_path / 'data.py'}:endless", "--threads", "1", "--run-dir", str(run_dir)],
        preexec_fn=lambda: _capped(cap), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        rows = 0
        while rows < STEPS + 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            rows = len(losses.read_text().splitlines()) if losses.is_file() else 0
        assert proc.poll() is None, f"the run ended after {rows - 1} steps:\n" + \
            (proc.communicate()[0] or "")
        assert rows >= STEPS + 1, f"{rows - 1} steps in 420 s"
        os.kill(proc.pid, signal.SIGINT)  # stopped as a user stops it
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "stopped by SIGINT" in out and "MemoryError" not in out, out
    steps = [int(line.split(",")[0]) for line in losses.read_text().splitlines()[1:]]
    assert steps[:STEPS] == list(range(1, STEPS + 1))
    assert re.search(r"^step 1 loss \d", out, re.M), out  # no total: the stream is endless
