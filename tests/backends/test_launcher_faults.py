"""Faults of the launcher: killing `pdcompile run` (SIGINT, SIGTERM, SIGKILL) leaves no worker
alive 5 s later; a frozen worker (SIGSTOP) is named by its peer within 10 s and the launcher ends
within 15 s, naming it; a Python process that called `train_processes` takes its workers with it
when killed."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _export(folder: Path) -> Path:
    """Two stages of a small MLP under 1f1b-flush: any number of steps streams cheaply."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    x, y = torch.randn(32, 128), torch.randint(0, 4, (32,))
    pipe = pdcompile.compile(nn.Sequential(*layers, nn.Linear(128, 4)), example_inputs=(x,),
                             example_target=y, loss_fn=nn.functional.cross_entropy,
                             stages=[1, 1], schedule="1f1b-flush", microbatches=2,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01))
    pipe.export(str(folder))
    return folder


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process on the machine (/proc)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, exited and not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


class Run:
    """`python -m pdcompile run ...` in its own session, its output lines timestamped."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdcompile", "run", *args], cwd=cwd,
                                     env=ENV, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if text in line:
                    return when
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no line with {text!r} within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def cleanup(self, pids: list[int]) -> None:
        for pid in [self.proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(timeout=10)


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    return _export(tmp_path / "pipe")


@contextmanager
def running(exported: Path) -> Iterator[tuple[Run, list[int]]]:
    """A long `pdcompile run` of the export, training; the processes below the launcher."""
    run = Run([str(exported), "--steps", "1000000", "--threads", "1"], exported.parent)
    pids: list[int] = []
    try:
        run.wait_for("step 1/1000000", timeout=120)  # training
        pids = descendants(run.proc.pid)  # torchrun's agent and the two workers
        yield run, pids
    finally:
        run.cleanup(pids)


def _gone_within(pids: list[int], seconds: float) -> float:
    """Seconds until none of `pids` runs (fails past `seconds`)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not any(alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    pytest.fail(f"processes {left} still run {seconds} s after the launcher was killed")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killing_the_launcher_leaves_no_worker(exported: Path, sig: signal.Signals) -> None:
    with running(exported) as (run, pids):
        workers = [p for p in pids if rank_of(p) is not None]
        assert sorted(rank_of(p) for p in workers) == [0, 1], pids
        os.kill(run.proc.pid, sig)
        took = _gone_within(pids, 5.0)
        code = run.proc.wait(timeout=10)
        print(f"{sig.name}: every process gone {took:.2f} s after the signal")
        if sig != signal.SIGKILL:
            assert code == 128 + sig
            assert f"pdcompile run: stopped by {sig.name}; the workers were stopped" \
                in run.output()


def test_a_frozen_worker_is_named_and_the_launcher_ends(exported: Path) -> None:
    with running(exported) as (run, pids):
        (frozen,) = [p for p in pids if rank_of(p) == 1]
        frozen_at = time.monotonic()
        os.kill(frozen, signal.SIGSTOP)
        # named by its peer ("rank 0 stops: rank 1 died or failed (stopped responding for ...")
        # or, when the agent stopped that peer first, by the launcher's last line
        named = run.wait_for("stopped responding for", 15.0)
        code = run.proc.wait(timeout=30)
        ended = time.monotonic()
        print(f"named after {named - frozen_at:.2f} s, launcher ended after "
              f"{ended - frozen_at:.2f} s")
        assert named - frozen_at <= 10.0
        assert ended - frozen_at <= 15.0
        assert code == 1
        last = run.output().splitlines()[-1]
        # the cause, not the watchdog's kill ("killed by SIGKILL")
        assert last.startswith("pdcompile run: error: the distributed run failed: rank 1 "
                               "stopped responding for "), run.output()
        assert "s and was killed; the workers' messages are above" in last, run.output()
        assert not any(alive(p) for p in pids)
        assert "Traceback" not in run.output()


TRAINER = """\
import functools, itertools, sys

from pdcompile.worker import train_processes
from pdcompile.runtime.tensor_tree import load_tree


def example(folder):
    saved = load_tree(folder + "/example.safetensors")
    return itertools.repeat((tuple(saved["inputs"]), saved["target"]))


def progress(step, loss):
    print(f"step {step + 1}", flush=True)


if __name__ == "__main__":
    train_processes(sys.argv[1], 2, functools.partial(example, sys.argv[1]), steps=1000000,
                    progress=progress)
"""


def test_killing_a_python_launcher_takes_its_workers(exported: Path) -> None:
    """`train_processes` (launch) called by a script: SIGKILL of the script ends the workers."""
    script = exported.parent / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), str(exported)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step 3"):
                break
        else:
            pytest.fail("the script did not train")
        pids = descendants(proc.pid)
        assert sum(1 for p in pids if "pdcompile" in Path(f"/proc/{p}/cmdline").read_text()
                   or "multiprocessing" in Path(f"/proc/{p}/cmdline").read_text()) >= 2, pids
        os.kill(proc.pid, signal.SIGKILL)
        took = _gone_within(pids, 5.0)
        print(f"every worker gone {took:.2f} s after SIGKILL of the script")
    finally:
        for pid in [proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=10)
