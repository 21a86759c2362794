"""tune_allocator: glibc keeps freed blocks for reuse, so a training loop stops page-faulting."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from pdcompile.runtime.allocator import ENV, tune_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# allocate and free 8 MiB tensors as a training step does; print the minor page faults it took
_LOOP = textwrap.dedent("""
    import resource, sys, torch
    from pdcompile.runtime.allocator import tune_allocator
    applied = tune_allocator()
    x = torch.ones(2 * 2**20)
    for _ in range(3):  # warm up: the heap grows to hold the loop's blocks once
        y = x * 2
        z = y + 1
        del y, z
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        y = x * 2
        z = y + 1
        del y, z
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(applied, after - before)
""")


def _faults(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _LOOP], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="mallopt settings exist on glibc only")
def test_tuned_loop_reuses_memory_instead_of_faulting_pages_in() -> None:
    applied, tuned = _faults({ENV: ""})
    not_applied, system = _faults({ENV: "system"})
    assert applied and not not_applied
    pages = 8 * 2**20 // 4096
    # glibc's defaults return each 8 MiB block to the kernel and fault it in again
    assert system > 20 * pages
    assert tuned < pages


def test_system_setting_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "system")
    assert tune_allocator() is False


@pytest.mark.skipif(not GLIBC, reason="mallopt settings exist on glibc only")
def test_tuning_is_applied_and_repeatable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert tune_allocator() is True
    assert tune_allocator() is True
