"""The fast lane starts no processes: outside `@pytest.mark.slow`, starting a Python process (the
interpreter, torchrun) or a multiprocessing child fails the test at once, naming the fix."""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FIX = "it starts {what}: mark it @pytest.mark.slow (processes belong to the slow lane)"


def _is_python(args: Any) -> bool:
    """Whether a subprocess command line runs the Python interpreter or torchrun."""
    argv = [args] if isinstance(args, (str, bytes)) else list(args)
    program = str(argv[0]).split()[0] if argv else ""
    name = Path(program).name
    return program == sys.executable or name.startswith("python") or name == "torchrun"


def forbid_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now until `monkeypatch` undoes it, starting a process fails the running test."""
    execute_child: Callable[..., Any] = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> Any:
        if _is_python(args):
            pytest.fail(FIX.format(what=f"a process ({args!r})"), pytrace=False)
        return execute_child(self, args, *rest, **kw)

    def guarded_start(self: multiprocessing.process.BaseProcess) -> None:
        pytest.fail(FIX.format(what=f"a multiprocessing child ({self.name})"), pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded_child)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
