"""The `local` cluster's figures: loopback bandwidth and CPU speed, measured once, then cached."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from pdcompile.machine import local as local_machine
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.loopback import Loopback


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh cache folder ($PDCOMPILE_CACHE), no bandwidth override; returns the cache file."""
    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PDCOMPILE_LOCAL_BANDWIDTH", raising=False)
    monkeypatch.delenv("PDCOMPILE_LOCAL_ALLREDUCE_BANDWIDTH", raising=False)
    return tmp_path / "cache" / "local.json"


def _counting(monkeypatch: pytest.MonkeyPatch, measure: object) -> list[int]:
    calls: list[int] = []

    def wrapped() -> Loopback:
        calls.append(1)
        return measure()  # type: ignore[operator, no-any-return]

    monkeypatch.setattr(local_machine, "measure_loopback", wrapped)
    return calls


def test_loopback_measured_once_then_read_from_the_cache(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two real gloo ranks on 127.0.0.1, threads of this process (1 MiB, well under a second),
    once: the fast lane, which starts no process, measures an empty cache this way too."""
    calls = _counting(monkeypatch, functools.partial(local_machine.measure_loopback,
                                                     numel=2**18))
    assert not cache.exists()
    bandwidth, latency, ring = measured = local_machine.local_bandwidth()
    assert calls == [1]
    assert 1e6 < bandwidth < 1e13 and 0 < latency < 0.1  # 1 MB/s .. 10 TB/s, under 100 ms
    assert 1e6 < ring < 1e13
    assert json.loads(cache.read_text()) == {"bandwidth": bandwidth, "latency": latency,
                                             "allreduce_bandwidth": ring,
                                             "machine": local_machine.machine_identity()}
    assert local_machine.local_bandwidth() == measured  # the cache, not a new run
    level = Cluster.preset("local-2").levels[0]
    assert level.bandwidth == bandwidth and level.allreduce_bandwidth == ring
    assert calls == [1]


def test_cache_logic(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch, lambda: Loopback(3e9, 2e-5, 1e9))
    assert local_machine.local_bandwidth() == (3e9, 2e-5, 1e9)
    assert local_machine.local_bandwidth() == (3e9, 2e-5, 1e9)
    assert calls == [1]
    # the CPU figures join the same file; the bandwidth stays
    device = local_machine.local_device(2)
    data = json.loads(cache.read_text())
    assert data["bandwidth"] == 3e9 and data["flops"] == device.flops > 0
    assert device.mem_bandwidth == data["mem_bandwidth"] > 0
    # the override wins over the cache without touching it
    monkeypatch.setenv("PDCOMPILE_LOCAL_BANDWIDTH", "2GB/s")
    assert local_machine.local_bandwidth() == (2e9, 50e-6, 2e9)  # all-reduce: the same
    monkeypatch.setenv("PDCOMPILE_LOCAL_ALLREDUCE_BANDWIDTH", "500MB/s")
    assert local_machine.local_bandwidth() == (2e9, 50e-6, 5e8)
    assert Cluster.preset("local-2").levels[0].allreduce_rate == 5e8
    assert json.loads(cache.read_text())["bandwidth"] == 3e9 and calls == [1]
    monkeypatch.delenv("PDCOMPILE_LOCAL_BANDWIDTH")
    # a damaged cache is measured again and rewritten
    cache.write_text("{not json")
    assert local_machine.local_bandwidth() == (3e9, 2e-5, 1e9)
    assert calls == [1, 1] and json.loads(cache.read_text())["bandwidth"] == 3e9
    # a cache written before the all-reduce was measured is measured again
    cache.write_text(json.dumps({"bandwidth": 4e9, "latency": 1e-5}))
    assert local_machine.local_bandwidth() == (3e9, 2e-5, 1e9)
    assert calls == [1, 1, 1]


def test_unwritable_cache_only_costs_a_measurement(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PDCOMPILE_CACHE", str(blocker / "cache"))  # under a file: cannot mkdir
    monkeypatch.delenv("PDCOMPILE_LOCAL_BANDWIDTH", raising=False)
    calls = _counting(monkeypatch, lambda: Loopback(1e9, 1e-5, 4e8))
    assert local_machine.local_bandwidth() == (1e9, 1e-5, 4e8)
    assert local_machine.local_bandwidth() == (1e9, 1e-5, 4e8)
    assert calls == [1, 1]
    assert not os.path.exists(blocker / "cache")


def test_measure_loopback_rejects_a_tiny_size() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        local_machine.measure_loopback(numel=1)
