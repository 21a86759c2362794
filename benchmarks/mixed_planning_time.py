"""Planning time on a mixed cluster, the code of a git revision against this tree's, in turn.

Each run plans in a fresh process (`pdcompile.plan` of a shipped PipeDream profile on a cluster
string), alternating: base, this tree, base, this tree, ... so that both see the same load on a
shared machine. Per run: CPU seconds of the planning call (`time.process_time` in the child),
wall seconds, the load average before it, and the plan it returned (config, each stage's ranks
and shares, the simulated time per minibatch, and `mixed_times`, every candidate kind's price),
which must not differ between the two codes.

    python benchmarks/mixed_planning_time.py [--base main] [--profile vgg16]
        [--cluster 16@1e10:a100*8,v100*8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
import torch
torch.set_num_threads(1)
import pdcompile
from pdcompile.machine.cluster import Cluster
from pdcompile.profiles import load_pipedream, profile_path
profile, spec = sys.argv[1], sys.argv[2]
graph = load_pipedream(profile_path(profile))
cluster = Cluster.parse(spec) if "@" in spec else Cluster.preset(spec)
cpu, wall = time.process_time(), time.perf_counter()
plan = pdcompile.plan(graph, cluster)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
print(json.dumps({"cpu": cpu, "wall": wall, "code": pdcompile.__file__,
                  "plan": {"config": plan.config, "ms": plan.time_per_minibatch * 1e3,
                           "stages": [[list(s.ranks), list(s.shares)] for s in plan.stages],
                           "found_by": plan.extra.get("found_by"),
                           "mixed_times": plan.extra.get("mixed_times")}}))
"""


def export(revision: str, into: Path) -> Path:
    """The package `pdcompile` of `revision`, written under `into` (`git archive`)."""
    archive = into / "base.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", revision, "pdcompile"], cwd=ROOT, stdout=out,
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "base", filter="data")
    return into / "base"


def run(code: Path, profile: str, cluster: str) -> dict[str, Any]:
    """One planning call in a fresh process with `code` first on its path."""
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    load = os.getloadavg()[0]
    # run from `code`: `python -c` puts the working directory first on the path
    done = subprocess.run([sys.executable, "-c", CHILD, profile, cluster], env=env, check=True,
                          capture_output=True, text=True, cwd=code)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["load"] = load
    if not out["code"].startswith(str(code)):
        raise RuntimeError(f"the child imported {out['code']}, not the code under {code}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git revision to compare against")
    parser.add_argument("--profile", default="vgg16")
    parser.add_argument("--cluster", default="16@1e10:a100*8,v100*8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "this tree": []}
    with tempfile.TemporaryDirectory() as scratch:
        base = export(args.base, Path(scratch))
        for round_ in range(args.rounds):
            for label, code in (("base", base), ("this tree", ROOT)):
                got = run(code, args.profile, args.cluster)
                runs[label].append(got)
                print(f"round {round_ + 1} {label:>9}: {got['cpu']:6.2f} s CPU "
                      f"{got['wall']:6.2f} s wall, load {got['load']:.2f}; "
                      f"{got['plan']['config']} {got['plan']['ms']:.2f} ms", flush=True)
    ended = datetime.datetime.now(datetime.timezone.utc)
    plans = {json.dumps(r["plan"], sort_keys=True) for rs in runs.values() for r in rs}
    print(f"{args.profile} on {args.cluster}, {platform.machine()} ({os.cpu_count()} cores), "
          f"{started:%Y-%m-%d %H:%M}-{ended:%H:%M} UTC, base {args.base}:")
    for label, rs in runs.items():
        cpu = ", ".join(f"{r['cpu']:.1f}" for r in rs)
        wall = ", ".join(f"{r['wall']:.1f}" for r in rs)
        load = ", ".join(f"{r['load']:.1f}" for r in rs)
        median = statistics.median(r["cpu"] for r in rs)
        print(f"  {label:>9}: CPU {cpu} s (median {median:.1f}), wall {wall} s, load {load}")
    print("  the same plan and mixed_times in every run" if len(plans) == 1
          else f"  PLANS DIFFER: {len(plans)} distinct")


if __name__ == "__main__":
    main()
