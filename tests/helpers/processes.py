"""Processes the tests start: bounded by a timeout, killed with their children when they overrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Python expression, for a child's script: the child's own peak resident memory in KiB
# (VmHWM, which exec starts afresh). `resource.getrusage(...).ru_maxrss` is kept across fork and
# exec, so a child of a large pytest process reported the parent's peak (1.27 GB in a CI run,
# for a script that peaks at 354 MB).
PEAK_RSS_KIB = ("int(next(line.split()[1] for line in open('/proc/self/status') "
                "if line.startswith('VmHWM:')))")


def start_bounded(args: list[str], *, cwd: Path | None = None,
                  env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`args` in its own session (so `finish_bounded` can kill its children), stdout and stderr
    together."""
    return subprocess.Popen(args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish_bounded(proc: subprocess.Popen[str], *, timeout: float, name: str) -> str:
    """What `proc` printed once it exits; on overrun its whole process group is killed and the
    test fails with what it printed."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} did not finish within {timeout} s:\n{out}")
    return out


def run_bounded(args: list[str], *, timeout: float, cwd: Path | None = None,
                env: dict[str, str] | None = None,
                name: str | None = None) -> subprocess.CompletedProcess[str]:
    """`args` run to the end within `timeout` (`start_bounded`, `finish_bounded`)."""
    proc = start_bounded(args, cwd=cwd, env=env)
    out = finish_bounded(proc, timeout=timeout, name=name or str(args))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def run_cli(args: list[str], env: dict[str, str] | None = None,
            timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """`python -m pdcompile run ...` (it starts torchrun and the workers)."""
    return run_bounded([sys.executable, "-m", "pdcompile", "run", *args], timeout=timeout,
                       env={**os.environ, **(env or {})}, name="pdcompile run")


def printed_losses(output: str) -> list[float]:
    """The losses of a `pdcompile run`: its loss file (`step,loss` lines), which the summary's
    one `losses: PATH` line names."""
    lines = [line for line in output.splitlines() if line.startswith("losses: ")]
    assert len(lines) == 1, output
    rows = Path(lines[0][len("losses: "):]).read_text().splitlines()
    assert rows[0] == "step,loss", rows[:2]
    steps = [int(row.split(",")[0]) for row in rows[1:]]
    assert steps == list(range(1, len(steps) + 1)), steps  # every step, in order
    return [float(row.split(",")[1]) for row in rows[1:]]


def run_export_losses(folder: Path, *, nproc: int, steps: int, timeout: float = 240
                      ) -> list[float]:
    """`pdcompile run FOLDER --nproc N --steps S --threads 1`, which must succeed; its losses."""
    done = run_cli([str(folder), "--nproc", str(nproc), "--steps", str(steps), "--threads", "1"],
                   timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:]
    return printed_losses(done.stdout)
