"""Dump the planner's plans on a fixed set of inputs to JSON, to diff two versions of the planner.

A change meant to make planning faster must leave every plan as it was; run this with the old
code and the new (e.g. `PYTHONPATH=<old checkout> python benchmarks/plan_dump.py --out old.json`,
then with `PYTHONPATH=$PWD`) and compare with `--diff old.json new.json`: stages, replicas,
ranks, in-flight counts, recomputation, nodes and every price as exact floats (only the solve
time and the ILP's are left out). Each case is also timed in CPU seconds (the machine may be
shared).

Sets: `fidelity` (the 84 plans of the fidelity table: 14 shipped profiles x clusters A, B, C x
1f1b and 1f1b-flush), `xl` (GPT-2 XL, analytic H100 costs, on flat 24, 32, 128 and on servers),
`random` (random-cost chains of benchmarks/planner_fidelity.py `chain`), `flat` (the shipped
profiles on flat clusters of 8 and 128 workers), `dags` (random DAGs of
benchmarks/random_dags.py `dag`: branches, joins, skips, zero and extreme costs, on flat and
server clusters).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

XL_CLUSTERS = ("24@450GB/s~3us:h100", "32@450GB/s~3us:h100", "128@450GB/s~3us:h100",
               "4x8@450GB/s,400Gbps~3us,5us:h100", "8x16@450GB/s,400Gbps~3us,5us:h100")
RANDOM_CASES = ((1000, 100, "24@450GB/s~3us:h100"), (1000, 100, "32@450GB/s~3us:h100"),
                (5000, 300, "128@450GB/s~3us:h100"),
                (5000, 300, "8x16@450GB/s,400Gbps~3us,5us:h100"),
                (300, 30, "8@450GB/s~3us:h100"))
FLAT_CLUSTERS = ("8@1e10", "128@450GB/s~3us:h100")
DAG_CASES = ((300, 1, "2@1e10"), (300, 2, "8@450GB/s~3us:h100"), (1000, 1, "A"),
             (1000, 2, "B"), (2000, 1, "128@450GB/s~3us:h100"),
             (2000, 2, "8x16@450GB/s,400Gbps~3us,5us:h100"), (800, 3, "4x4@1e10,1.25e9:v100"),
             (3000, 4, "32@450GB/s~3us:h100"))


def cases(sets: list[str]) -> list[tuple[str, Any]]:
    """(name, thunk returning (graph, cluster, schedule)) for each case of `sets`."""
    from planner_fidelity import chain, gpt2_xl_graph
    from random_dags import dag

    import pdcompile
    from pdcompile.profiles import SHIPPED, load_pipedream

    out: list[tuple[str, Any]] = []
    if "fidelity" in sets:
        names = sorted(p.name for p in SHIPPED.iterdir() if (p / "graph.txt").is_file())
        for name in names:
            for cluster in ("A", "B", "C"):
                for schedule in ("1f1b", "1f1b-flush"):
                    out.append((f"{name} {cluster} {schedule}",
                                lambda n=name, c=cluster, s=schedule:
                                (load_pipedream(SHIPPED / n), pdcompile.Cluster.preset(c), s)))
    if "flat" in sets:
        names = sorted(p.name for p in SHIPPED.iterdir() if (p / "graph.txt").is_file())
        for name in names:
            for cluster in FLAT_CLUSTERS:
                out.append((f"{name} {cluster} 1f1b",
                            lambda n=name, c=cluster: (load_pipedream(SHIPPED / n), c, "1f1b")))
    if "dags" in sets:
        for nodes, seed, cluster in DAG_CASES:
            out.append((f"dag {nodes} seed {seed} {cluster}",
                        lambda n=nodes, k=seed, c=cluster: (dag(n, k), c, "1f1b")))
    if "xl" in sets:
        for cluster in XL_CLUSTERS:
            out.append((f"gpt2-xl {cluster}",
                        lambda c=cluster: (gpt2_xl_graph(), c, "1f1b")))
    if "random" in sets:
        for nodes, skips, cluster in RANDOM_CASES:
            out.append((f"chain {nodes}+{skips} {cluster}",
                        lambda n=nodes, k=skips, c=cluster: (chain(n, skips=k), c, "1f1b")))
    return out


def dump(sets: list[str], only: str | None, shard: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """{case: {"plan": plan without its solve time, "cpu": CPU seconds of the plan call}};
    `shard` (i, n): every n-th case from the i-th."""
    import pdcompile
    from pdcompile.errors import PlanError

    result: dict[str, Any] = {}
    for number, (name, make) in enumerate(cases(sets)):
        if (only and only not in name) or number % shard[1] != shard[0]:
            continue
        graph, cluster, schedule = make()
        cpu = time.process_time()
        try:
            plan = pdcompile.plan(graph, cluster, schedule=schedule)
        except PlanError as err:  # a refusal is compared as its message
            result[name] = {"plan": {"refused": str(err), "extra": {}},
                            "cpu": time.process_time() - cpu}
            print(f"{name}: refused ({str(err)[:80]})", flush=True)
            continue
        cpu = time.process_time() - cpu
        data = plan.to_dict()
        data.pop("solve_seconds", None)
        data["extra"].pop("ilp_seconds", None)  # the ILP's wall time
        result[name] = {"plan": data, "cpu": cpu}
        print(f"{name}: {plan.config} {plan.time_per_minibatch * 1e3:.3f} ms, {cpu:.2f} s CPU",
              flush=True)
    return result


def _timeless(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan without its solve times (dumps written before they were left out)."""
    extra = {k: v for k, v in plan["extra"].items() if k != "ilp_seconds"}
    return {**{k: v for k, v in plan.items() if k != "solve_seconds"}, "extra": extra}


def diff(old_path: str, new_path: str) -> int:
    """Print each case whose plan differs; the number of such cases (each path may be
    several dumps' files, comma-separated)."""
    old, new = ({name: case for path in paths.split(",")
                 for name, case in json.loads(Path(path).read_text()).items()}
                for paths in (old_path, new_path))
    bad = 0
    for name in old.keys() | new.keys():
        if name not in old or name not in new:
            print(f"{name}: only in {'new' if name in new else 'old'}")
            bad += 1
        elif _timeless(old[name]["plan"]) != _timeless(new[name]["plan"]):
            a, b = old[name]["plan"], new[name]["plan"]
            keys = [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
            print(f"{name}: differs in {sorted(keys)}")
            bad += 1
    same = len(old.keys() & new.keys()) - bad
    print(f"{same} identical, {bad} different")
    for name in sorted(old.keys() & new.keys()):
        print(f"  {name}: CPU s {old[name]['cpu']:.2f} -> {new[name]['cpu']:.2f}")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="fidelity,xl,random",
                        help="comma-separated: fidelity, xl, random, flat, dags")
    parser.add_argument("--only", help="only the cases whose name contains this")
    parser.add_argument("--out", help="the JSON file to write")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th")
    parser.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), help="compare two dumps")
    args = parser.parse_args()
    if args.diff:
        sys.exit(1 if diff(*args.diff) else 0)
    index, shards = (int(x) for x in args.shard.split("/"))
    result = dump(args.sets.split(","), args.only, (index, shards))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
