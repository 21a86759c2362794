"""The local machine's cache ($PDCOMPILE_CACHE/local.json) as others may leave it: damaged,
holding figures that are not numbers, zero or NaN, written by another host or another torch,
or by two threads at once (a folder that cannot be written: test_local_machine.py). The
figures used are always this machine's own finite positive ones (measured again where the
file has none)."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.machine import local as local_machine
from pdcompile.machine.loopback import Loopback
from tests.helpers.byte_damage import bounded

_MEASURED = Loopback(3e9, 2e-5, 1e9)
_CPU = (7e10, 2e10)
_FIELDS = [*Loopback._fields, "flops", "mem_bandwidth", "machine", "other"]


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache folder of its own, the measurements replaced by fixed figures (counted)."""
    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PDCOMPILE_LOCAL_BANDWIDTH", raising=False)
    monkeypatch.delenv("PDCOMPILE_LOCAL_ALLREDUCE_BANDWIDTH", raising=False)
    monkeypatch.setattr(local_machine, "measure_loopback", lambda: _MEASURED)
    monkeypatch.setattr(local_machine, "_measure_cpu", lambda: _CPU)
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache" / "local.json"


def _usable(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _number(key: str, value: object) -> bool:
    """A figure the cache may hold: a finite positive int or float, not a bool (JSON's true
    is no bandwidth), within what a machine can have (`local._PLAUSIBLE`)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or abs(value) > 1e300:
        return False
    low, high = local_machine._PLAUSIBLE[key]
    return _usable(value) and low <= value <= high


_VALUES = (st.none() | st.booleans() | st.floats() | st.integers(-10, 10**15)
           | st.integers(10**300, 10**400) | st.sampled_from([1e-300, 1e300, 5e-10, 1e6])
           | st.text(max_size=8) | st.lists(st.floats(), max_size=2))


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=7)
       | st.lists(st.integers(), max_size=3) | st.text(max_size=5) | st.binary(max_size=20))
def test_whatever_the_file_holds_the_figures_are_usable(cache: Path, doc: object) -> None:
    """Any document (JSON of any shape, NaN and Infinity included, or bytes): the device and
    loopback figures are finite and positive, the file's own where they are, else measured."""
    if isinstance(doc, bytes):
        cache.write_bytes(doc)
    else:
        cache.write_text(json.dumps(doc))
    device = local_machine.local_device()
    loop = local_machine.local_bandwidth()
    assert _usable(device.flops) and _usable(device.mem_bandwidth) and _usable(device.memory)
    assert all(_usable(v) for v in loop)
    given_ = doc if isinstance(doc, dict) and doc.get(
        "machine", local_machine.machine_identity()) == local_machine.machine_identity() else {}
    for key, used in (("flops", device.flops), ("bandwidth", loop.bandwidth)):
        value = given_.get(key)
        own = _number(key, value)
        if own and all(_number(k, given_.get(k))
                       for k in (("flops", "mem_bandwidth") if key == "flops"
                                 else Loopback._fields)):
            assert used == float(value)  # the file's own figure, kept
    assert json.loads(cache.read_text())["machine"] == local_machine.machine_identity()


def _fifo(cache: Path) -> None:
    os.mkfifo(cache)


def _zeros(cache: Path) -> None:
    os.symlink("/dev/zero", cache)


def _huge(cache: Path) -> None:
    with open(cache, "wb") as out:  # sparse: no disk used
        out.truncate(4 << 30)


@pytest.mark.parametrize("make", [_fifo, _zeros, _huge], ids=["fifo", "dev-zero", "4-gib"])
def test_a_cache_that_is_no_file_of_ours_is_measured_again(
        cache: Path, make: Callable[[Path], None]) -> None:
    """local.json a FIFO, a link to /dev/zero or a 4 GiB file: measured again at once, and the
    cache written anew. Before, reading it waited forever for a writer, or read until the
    memory was full."""
    make(cache)
    with bounded(30):
        assert local_machine.local_bandwidth() == _MEASURED
        assert local_machine.local_device().flops == _CPU[0]
    assert cache.is_file() and not cache.is_symlink()
    assert json.loads(cache.read_text())["bandwidth"] == _MEASURED.bandwidth


def test_another_machines_figures_are_measured_again(cache: Path) -> None:
    cache.write_text(json.dumps({"flops": 1e9, "mem_bandwidth": 1e9, "bandwidth": 1e6,
                                 "latency": 1.0, "allreduce_bandwidth": 1e6,
                                 "machine": "another-host x86_64 torch 1.0"}))
    assert local_machine.local_device().flops == _CPU[0]
    assert local_machine.local_bandwidth() == _MEASURED
    kept = json.loads(cache.read_text())
    assert kept["machine"] == local_machine.machine_identity() and kept["flops"] == _CPU[0]


def test_writers_at_once_leave_a_whole_file(cache: Path) -> None:
    """Threads writing the cache together: every read in between, and the file at the end,
    is whole JSON (each write is a rename over it)."""
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(40):
                local_machine._write_cache({"flops": float(n * 1000 + i + 1)})
                assert isinstance(json.loads(cache.read_text()), dict)
        except BaseException as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert _usable(local_machine.local_device().flops)
