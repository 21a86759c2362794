"""Shared fixtures: every test starts from the same seeds, with one thread; outside the slow lane
no test starts a process."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import settings

from tests.helpers.paths import PROFILES
from tests.helpers.spawn_guard import forbid_processes

# CI replays the same property-test examples every run (a red CI is then a regression, not a
# draw); local runs explore fresh examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed() -> None:
    import torch

    random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_process(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`pytest -m "not slow"` stays fast: a test that starts processes must be marked slow."""
    if request.node.get_closest_marker("slow") is None:
        forbid_processes(monkeypatch)


@pytest.fixture
def profiles_dir() -> Path:
    """The PipeDream profiles the package ships (pdcompile/data/pipedream)."""
    if not PROFILES.is_dir():
        pytest.fail(f"the PipeDream profiles are expected at {PROFILES}: the package lost its "
                    "data files (see [tool.setuptools.package-data] in pyproject.toml)")
    return PROFILES


@pytest.fixture
def local_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`local` without a measurement: bandwidth from the override, CPU figures from a cache."""
    monkeypatch.setenv("PDCOMPILE_LOCAL_BANDWIDTH", "2GB/s")
    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    (tmp_path / "local.json").write_text(json.dumps({"flops": 5e10, "mem_bandwidth": 1e10}))
