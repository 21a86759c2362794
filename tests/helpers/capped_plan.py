"""A plan made in a child process whose address space is capped, as the planner-scale tests
need: the cap catches a search that would take the machine's memory, which a test in this
process could not survive."""

from __future__ import annotations

import json
import sys
import textwrap
from typing import Any

from tests.helpers.graphs import random_chain
from tests.helpers.paths import ROOT
from tests.helpers.processes import PEAK_RSS_KIB, run_bounded

CAP = 4 << 30  # bytes of address space; torch and OR-Tools take about 0.8 GB of it


def plan_random_chain_capped(*, nodes: int, skips: int, cluster: str,
                             cost_model: str | None = None) -> dict[str, Any]:
    """`pdcompile.plan` of `random_chain(nodes, skips=skips, seed=7)` on `cluster` in a process
    capped at `CAP` (torch and OR-Tools imported first, as in a user's process): its
    `stage_of`, stage `ranks`, planning `seconds` and `peak` resident KiB. Fails the test if the
    child fails, and checks that every node is placed and no edge runs backwards."""
    options = f", cost_model={cost_model!r}" if cost_model else ""
    script = textwrap.dedent(f"""
        import json, resource, time
        resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))
        import torch
        from ortools.sat.python import cp_model
        import pdcompile
        from tests.helpers.graphs import random_chain
        graph = random_chain({nodes}, skips={skips}, seed=7)
        started = time.perf_counter()
        plan = pdcompile.plan(graph, {cluster!r}{options})
        print(json.dumps({{"seconds": time.perf_counter() - started,
                          "stage_of": plan.stage_of(),
                          "ranks": [list(s.ranks) for s in plan.stages],
                          "peak": {PEAK_RSS_KIB}}}))
    """)
    result = run_bounded([sys.executable, "-c", script], timeout=300, cwd=ROOT,
                         name=f"plan of {nodes} nodes on {cluster}")
    assert result.returncode == 0, result.stdout[-2000:]
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    graph = random_chain(nodes, skips=skips, seed=7)
    assert set(out["stage_of"]) == set(graph.nodes)
    assert all(out["stage_of"][u] <= out["stage_of"][v] for u, v in graph.edges)
    assert out["peak"] * 1024 < CAP
    return out
