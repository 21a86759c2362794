"""Processes the tests start: bounded by a timeout, killed with their children when they overrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_bounded(args: list[str], *, timeout: float, cwd: Path | None = None,
                env: dict[str, str] | None = None,
                name: str | None = None) -> subprocess.CompletedProcess[str]:
    """`args` in its own session, stdout and stderr together; on overrun its whole process group
    is killed and the test fails with what it printed."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name or args} did not finish within {timeout} s:\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def run_cli(args: list[str], env: dict[str, str] | None = None,
            timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """`python -m pdcompile run ...` (it starts torchrun and the workers)."""
    return run_bounded([sys.executable, "-m", "pdcompile", "run", *args], timeout=timeout,
                       env={**os.environ, **(env or {})}, name="pdcompile run")


def printed_losses(output: str) -> list[float]:
    """The losses `pdcompile run` prints on its one `losses [...]` line."""
    lines = [line for line in output.splitlines() if line.startswith("losses [")]
    assert len(lines) == 1, output
    return [float(v) for v in json.loads(lines[0][len("losses "):])]
