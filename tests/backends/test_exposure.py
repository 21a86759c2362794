"""What a run exposes: a run on this machine listens on the loopback address only (the rendezvous
store included, which torchrun would bind to every address), garbage sent to its ports prints no
C++ trace, and a fault record forged by a program that did not start the run stops nothing."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.machine.local import free_port
from tests.helpers.paths import ROOT
from tests.helpers.processes import finish_bounded, start_bounded
from tests.helpers.sockets import children, listening

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DATA = '''
import time
import torch


def batches():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range({count}):
        time.sleep({pause})
        yield (x,), y
'''


def _export(folder: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pipe = pdcompile.compile(model, example_inputs=(torch.randn(8, 16),),
                             example_target=torch.randint(0, 4, (8,)),
                             loss_fn=nn.functional.cross_entropy, stages=[1, 1],
                             schedule="1f1b-flush", microbatches=2)
    pipe.export(str(folder))
    return folder


def _start(tmp_path: Path, *extra: str, count: int = 80, pause: float = 0.1
           ) -> subprocess.Popen[str]:
    folder = _export(tmp_path / "exported")
    (tmp_path / "slow_data.py").write_text(DATA.format(count=count, pause=pause))
    return start_bounded(
        [sys.executable, "-m", "pdcompile", "run", str(folder), "--nproc", "2", "--threads", "1",
         "--data", f"{tmp_path / 'slow_data.py'}:batches", *extra],
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _finish(proc: subprocess.Popen[str]) -> str:
    return finish_bounded(proc, timeout=150, name="pdcompile run")


def _sockets_while_training(proc: subprocess.Popen[str], *, workers: int
                            ) -> set[tuple[str, int]]:
    """Every listening socket of the run's processes, once its workers are up (for ~2 s)."""
    deadline = time.monotonic() + 90
    seen: set[tuple[str, int]] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        tree = children(proc.pid)
        now = listening(tree)
        if len(tree) >= workers + 2 and len(now) >= workers + 1:  # store + a gloo port each
            until = time.monotonic() + 2
            while time.monotonic() < until:
                seen |= listening(children(proc.pid))
                time.sleep(0.2)
            return seen
        time.sleep(0.2)
    pytest.fail(f"the run's workers never listened ({seen}); exit {proc.poll()}")


def test_a_local_run_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    proc = _start(tmp_path, "--master-port", str(port))
    try:
        sockets = _sockets_while_training(proc, workers=2)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert ("127.0.0.1", port) in sockets, sockets  # the store, on the port asked for
    exposed = {s for s in sockets if not s[0].startswith(("127.", "::1"))}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_a_c10d_rendezvous_listens_on_the_endpoint_named_only(tmp_path: Path) -> None:
    """torch's c10d rendezvous would host its store on every address; the agent hosts it on a
    socket bound to the endpoint's host, which torch's store then shares."""
    port = free_port()
    proc = _start(tmp_path, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "exposure")
    try:
        sockets = _sockets_while_training(proc, workers=2)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert ("127.0.0.1", port) in sockets, sockets
    exposed = {s for s in sockets if not s[0].startswith(("127.", "::1"))}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_garbage_and_forged_fault_records_stop_nothing(tmp_path: Path) -> None:
    import torch.distributed as dist

    port = free_port()
    proc = _start(tmp_path, "--master-port", str(port), "--fault-timeout", "4")
    try:
        sockets = _sockets_while_training(proc, workers=2)
        store = dist.TCPStore("127.0.0.1", port, None, False,
                              timeout=datetime.timedelta(seconds=10))
        # what a program that did not start the run can write: records in the old key names
        for key in ("pdcompile/0/fault", "pdcompile/-0/fault", "pdcompile/none/0/fault"):
            store.set(key, '{"rank": 1, "reason": "forged"}')
        for _, where in sorted(sockets):  # garbage at every port the run listens on
            for payload in (os.urandom(512), b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 64):
                try:
                    with socket.create_connection(("127.0.0.1", where), timeout=2) as conn:
                        conn.sendall(payload)
                except OSError:
                    pass
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert "forged" not in out.replace(str(tmp_path), "")  # the run folder's name has it
    assert "frame #" not in out and "Exception raised from" not in out, out
