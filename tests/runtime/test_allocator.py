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

# allocate, fill and free blocks of 8 MiB and a little more each time, as a training step frees
# and reallocates its activations; print the minor page faults the loop took. Growing sizes keep
# glibc's default behaviour deterministic: each block is larger than the last one freed, so its
# adaptive mmap threshold never catches up and every block is freshly mapped and faulted in.
_LOOP = textwrap.dedent("""
    import resource, sys, torch
    from pdcompile.runtime.allocator import tune_allocator
    applied = tune_allocator()
    def block(i):
        y = torch.empty(2 * 2**20 + 1024 * i)
        y.fill_(1.0)
        del y
    for i in range(3):  # warm up: the heap grows to hold a block once
        block(i)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(3, 53):
        block(i)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(applied, after - before)
""")


def _faults(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _LOOP], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="mallopt settings exist on glibc only")
def test_tuned_loop_reuses_memory_instead_of_faulting_pages_in() -> None:
    applied, tuned = _faults({ENV: ""})
    not_applied, system = _faults({ENV: "system"})
    assert applied and not not_applied
    pages = 8 * 2**20 // 4096  # one block
    # glibc's defaults return each block to the kernel and fault the next one in again (50
    # blocks); tuned, the freed block is reused and the heap only grows by 4 KiB per block
    assert system > 40 * pages
    assert tuned < pages


def test_system_setting_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "system")
    assert tune_allocator() is False


@pytest.mark.skipif(not GLIBC, reason="mallopt settings exist on glibc only")
def test_tuning_is_applied_and_repeatable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert tune_allocator() is True
    assert tune_allocator() is True
