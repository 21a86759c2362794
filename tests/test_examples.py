"""Every example runs as written (at a small size, in a fresh process, with a time limit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

EXAMPLES = ROOT / "examples"


def _run(name: str, *args: str, timeout: float = 240) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_example_is_tested() -> None:
    tested = {"train_local.py", "plan_vgg16_cluster_a.py", "export_and_torchrun.py",
              "gpt2_xl_h100.py", "custom_leaf.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_an_example_runs_as_written_in_an_empty_folder(name: str, tmp_path: Path) -> None:
    """The file alone, copied into an empty folder and run there with no arguments, as a user
    who downloaded it would (the other tests run the smaller `--small` variants from the
    repository's root, where a path relative to it would still resolve)."""
    shutil.copy(EXAMPLES / name, tmp_path / name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=280, check=False)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_local() -> None:
    out = _run("train_local.py", "--small")
    assert "config straight on 2 workers" in out
    assert "trained 8 minibatches" in out and "pipeline output shape: (32, 4)" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_vgg16_cluster_a(profiles_dir: Path) -> None:
    out = _run("plan_vgg16_cluster_a.py", "--small", "--profile", str(profiles_dir / "vgg16"))
    assert "on A: 4x4 workers" in out
    assert "cost model native: configuration" in out and "cost model pipedream" in out
    # the pipeline beats data parallelism on cluster A for VGG-16, as in the paper
    speedups = [float(line.rsplit(" ", 1)[1].rstrip("x")) for line in out.splitlines()
                if line.startswith("cost model ")]
    assert len(speedups) == 2 and all(s > 1.0 for s in speedups)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_and_torchrun() -> None:
    out = _run("export_and_torchrun.py", "--small", timeout=280)
    assert "pdcompile run" in out and "--nproc 2" in out
    assert "trained 8 minibatches" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt2_on_meta_for_h100() -> None:
    out = _run("gpt2_xl_h100.py", "--layers", "2", "--batch-size", "2")
    assert "on meta (no memory)" in out and "h100-node: 8 workers" in out
    assert "over data parallelism" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_custom_leaf() -> None:
    out = _run("custom_leaf.py", "--small")
    assert "without a leaf: torch.fx cannot trace module 'blocks.0' (GatedMixer)" in out
    assert "leaf nodes: blocks_0, blocks_1, blocks_2, blocks_3" in out
    assert "trained 8 minibatches" in out
