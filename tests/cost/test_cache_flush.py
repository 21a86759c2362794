"""Cold-cache profiling: the last-level cache is evicted right before every timed run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pdcompile.cost import node_costs as cost_pass
from pdcompile.cost.cache_flush import (
    DEFAULT_BYTES,
    MAX_BYTES,
    CacheFlush,
    last_level_cache_bytes,
    step_bytes,
)
from pdcompile.errors import PdcompileError
from pdcompile.meta import get_cost
from pdcompile.passes.trace import trace


def _fake_sysfs(root: Path, caches: list[tuple[int, str]]) -> Path:
    for i, (level, size) in enumerate(caches):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_the_highest_cache_level_is_the_last(tmp_path: Path) -> None:
    sysfs = _fake_sysfs(tmp_path, [(1, "48K"), (1, "32K"), (2, "2048K"), (3, "105M")])
    assert last_level_cache_bytes(torch.device("cpu"), sysfs=sysfs) == 105 * 2**20


def test_unreadable_sizes_fall_back(tmp_path: Path) -> None:
    sysfs = _fake_sysfs(tmp_path, [(2, "lots")])
    assert last_level_cache_bytes(torch.device("cpu"), sysfs=sysfs) == DEFAULT_BYTES
    assert last_level_cache_bytes(torch.device("cpu"), sysfs=tmp_path / "none") == DEFAULT_BYTES


def test_a_flush_writes_its_whole_buffer_and_stays_bounded() -> None:
    flush = CacheFlush(torch.device("cpu"), size=2**20)
    flush()
    assert flush.nbytes == 2**20 and flush.calls == 1
    assert bool((flush._buffer == 1.0).all())
    assert CacheFlush(torch.device("cpu"), size=4 * MAX_BYTES).nbytes == MAX_BYTES


class _CountingFlush:
    """Stands in for CacheFlush: counts its calls."""

    def __init__(self, device: torch.device, size: int | None = None, *,
                 touched: int | None = None) -> None:
        self.calls = 0
        self.touched = touched

    def __call__(self) -> None:
        self.calls += 1


def _counting_flushes(monkeypatch: pytest.MonkeyPatch) -> list[_CountingFlush]:
    """The cost pass's flushes from now on, counting instead of writing."""
    made: list[_CountingFlush] = []

    def factory(device: torch.device, *, touched: int | None = None) -> _CountingFlush:
        made.append(_CountingFlush(device, touched=touched))
        return made[-1]

    monkeypatch.setattr(cost_pass, "CacheFlush", factory)
    return made


def test_cold_profiles_flush_before_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _counting_flushes(monkeypatch)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    gm = trace(model)
    cost_pass.annotate_costs(gm, (torch.randn(8, 32),), warmup=1, repeats=3, caches="cold")
    computing = [n for n in gm.graph.nodes if n.op == "call_module"]
    # 3 nodes (linear, relu, linear), forward and backward, warm-up and timed runs each
    assert made and made[0].calls == len(computing) * 2 * (1 + 3)
    assert all(get_cost(n).fwd >= 0 for n in computing)
    made.clear()
    cost_pass.annotate_costs(trace(model), (torch.randn(8, 32),), warmup=1, repeats=3)
    assert not made  # warm, the default, never flushes


def test_a_flush_writes_no_more_than_a_training_step_touches() -> None:
    """On a host reporting a huge last-level cache, a tiny model's cold profile writes what its
    own training step streams (weights, gradients, activations and theirs), not the cache."""
    assert CacheFlush(torch.device("cpu"), size=480 * 2**20, touched=3 * 2**20).nbytes == 3 * 2**20
    assert CacheFlush(torch.device("cpu"), size=2**20, touched=3 * 2**20).nbytes == 2**20
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    params = sum(p.numel() for p in model.parameters()) * 4
    assert step_bytes(model, 1000) == 2 * params + 2 * 1000
    frozen = nn.Linear(8, 8).requires_grad_(False)
    assert step_bytes(frozen, 0) == (64 + 8) * 4  # no gradients to write


def test_cold_profiles_flush_what_the_model_touches(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _counting_flushes(monkeypatch)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    cost_pass.annotate_costs(trace(model), (torch.randn(8, 32),), warmup=0, repeats=1,
                             caches="cold")
    params = sum(p.numel() for p in model.parameters()) * 4
    outputs = (8 * 32 + 8 * 32 + 8 * 32 + 8 * 4) * 4  # the input and the three layers' outputs
    assert made[0].touched == 2 * params + 2 * outputs


@pytest.mark.parametrize("kwargs, message", [
    ({"caches": "lukewarm"}, "use one of warm, cold"),
    ({"caches": "cold", "source": "analytic"}, "measured costs only"),
])
def test_bad_cache_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    gm = trace(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(PdcompileError, match=message):
        cost_pass.annotate_costs(gm, (torch.randn(2, 4),), **kwargs)
