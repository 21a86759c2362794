"""The PipeDream paper's Table 1 (SOSP'19, measured on V100 clusters) against our planner and
cost model, row by row.

For each of the 12 rows whose model we ship a profile of: the paper's configuration and measured
speed-up over data parallelism (epoch time); our plan's configuration and predicted speed-up
(`pdcompile.plan(..., schedule="1f1b")` on the paper's cluster with the row's servers, the
profile scaled to the per-worker minibatch the paper's runs used: `cost/minibatch.py`); the
paper's own configuration priced by us (`price_plan`) and its predicted speed-up; the error of
each against the paper; and what dominates the time of data parallelism and of the pipeline in
our model (compute, all-reduce, activations on the wire).

How the paper's configurations are built (it gives replica counts, not cuts):
* "15-1": stage 0 on ranks 0..14, stage 1 on rank 15, cut after a prefix of the graph's
  topological order; the cut is the one our closed form prices fastest among all prefixes
  (the paper's optimizer chose its cut the same way, by its own model).
* "straight": one worker per stage on all the row's workers, the planner's best straight cut
  (`plan(..., stages=N)`).
* "16": plain data parallelism on all 16 workers (speed-up 1 by definition).

    python benchmarks/paper.py            # prints the table (markdown)
    python benchmarks/paper.py --json F   # also writes the rows as JSON (the golden file's form)

Deterministic: profiles and cluster models only, no timing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdcompile import Cluster  # noqa: E402
from pdcompile.cost.costgraph import topological_order  # noqa: E402
from pdcompile.cost.links import nic_busy_seconds  # noqa: E402
from pdcompile.cost.minibatch import at_minibatch  # noqa: E402
from pdcompile.plan import Plan, Stage  # noqa: E402
from pdcompile.planner.costmodel import ModelOptions, plan_terms  # noqa: E402
from pdcompile.planner.search import plan, price_plan  # noqa: E402
from pdcompile.profiles import load_pipedream  # noqa: E402

GOLDEN = ROOT / "tests" / "planner" / "paper_table1.json"

# Samples per minibatch of each shipped profile, read off its tensors: the Input's activation
# (images: 128 x 3 x 224 x 224 x 4 bytes for VGG-16 and ResNet-50, 256 for AlexNet) and the LSTM
# state (1 x batch x 1024 x 4 bytes: GNMT-8's 131,072 bytes are 32 sentences, GNMT-16's 524,288
# are 128).
PROFILE_MINIBATCH = {"vgg16": 128, "resnet50": 128, "alexnet": 256, "gnmt": 32,
                     "gnmt_large": 128}
# The per-worker minibatch of the paper's runs, data parallelism and PipeDream alike
# (msr-fiddle/pipedream, commit 7db6a1c, runtime/*/driver_configs/*.yml: `batch_size`).
RUN_MINIBATCH = {"vgg16": 64, "resnet50": 128, "alexnet": 256, "gnmt": 64, "gnmt_large": 64}


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's Table 1: model (our shipped profile), cluster preset, servers,
    the configuration PipeDream's optimizer chose, the measured speed-up (epoch time)."""

    profile: str
    cluster: str
    servers: int
    config: str
    speedup: float

    @property
    def shape(self) -> str:
        per = Cluster.preset(self.cluster).levels[0].workers
        return f"{self.servers}x{per}"


# Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019,
# Table 1 (speed-up over data parallelism in epoch time; cluster A: 4 V100 per server on PCIe,
# 10 Gbps between servers; cluster B: 8 V100 per server on NVLink, 25 Gbps between).
TABLE_1 = (
    PaperRow("vgg16", "A", 4, "15-1", 5.28),
    PaperRow("vgg16", "B", 2, "15-1", 2.98),
    PaperRow("resnet50", "A", 4, "16", 1.0),
    PaperRow("resnet50", "B", 2, "16", 1.0),
    PaperRow("alexnet", "A", 4, "15-1", 4.92),
    PaperRow("alexnet", "B", 2, "15-1", 2.04),
    PaperRow("gnmt_large", "A", 1, "straight", 1.46),
    PaperRow("gnmt_large", "A", 4, "straight", 2.34),
    PaperRow("gnmt_large", "B", 2, "straight", 3.14),
    PaperRow("gnmt", "A", 1, "straight", 1.5),
    PaperRow("gnmt", "A", 3, "straight", 2.95),
    PaperRow("gnmt", "B", 2, "16", 1.0),
)


def row_cluster(row: PaperRow) -> Cluster:
    """The paper's cluster preset with the row's number of servers (its outermost level)."""
    preset = Cluster.preset(row.cluster)
    outer = replace(preset.levels[-1], workers=row.servers)
    return replace(preset, levels=preset.levels[:-1] + (outer,))


def config_of(given: Plan) -> str:
    """A plan's configuration as the paper writes it: "15-1", "straight", "16"."""
    replicas = [s.replicas for s in given.stages]
    if len(replicas) > 1 and all(r == 1 for r in replicas):
        return "straight"
    return "-".join(str(r) for r in replicas)


def paper_plan(graph: Any, row: PaperRow, cluster: Cluster) -> Plan:
    """The paper's configuration of `row` as a Plan (module docstring)."""
    order = topological_order(graph)
    workers = cluster.workers
    if row.config == "straight":
        return plan(graph, cluster, schedule="1f1b", stages=workers)
    if row.config == str(workers):
        return Plan(stages=(Stage(tuple(order), workers, tuple(range(workers))),),
                    time_per_minibatch=0.0, dp_time=0.0, workers=workers, planner="paper")
    first, second = (int(x) for x in row.config.split("-"))
    best: tuple[float, Plan] | None = None
    for cut in range(1, len(order)):
        given = Plan(stages=(Stage(tuple(order[:cut]), first, tuple(range(first))),
                             Stage(tuple(order[cut:]), second,
                                   tuple(range(first, first + second)))),
                     time_per_minibatch=0.0, dp_time=0.0, workers=workers, planner="paper")
        priced = price_plan(graph, given, cluster, schedule="1f1b", simulate=False)
        if best is None or priced.time_per_minibatch < best[0]:
            best = (priced.time_per_minibatch, given)
    assert best is not None
    return best[1]


def anatomy(graph: Any, priced: Plan, cluster: Cluster) -> str:
    """What dominates a priced plan's time in our model: per stage, its work per minibatch over
    its replicas split into compute and all-reduce, and the bytes its busiest edge carries."""
    built = plan_terms(graph, [(s.nodes, s.ranks) for s in priced.stages], cluster,
                       options=ModelOptions(schedule="1f1b"),
                       in_flight=[s.in_flight for s in priced.stages])
    parts = []
    shown = _shown_stages(priced.extra.get("bound", ""), len(built.terms))
    for s, term in enumerate(built.terms):
        if s not in shown:
            continue
        r = term.replicas
        wire = max((size for (a, c), size in built.costs.edges.items() if s in (a, c)),
                   default=0.0)
        parts.append(f"s{s}: compute {term.compute / r * 1e3:.1f} + all-reduce "
                     f"{term.allreduce / r * 1e3:.1f} ms" + (f", wire {wire / 2**20:.0f} MiB"
                                                           if wire else ""))
    bound = priced.extra.get("bound", "")
    return f"{bound}: " + "; ".join(parts)


def nic_ms(graph: Any, priced: Plan, cluster: Cluster) -> float:
    """Milliseconds per minibatch the busiest server's network interface needs for the plan's
    transfers and cross-server all-reduces together (`cost.links.nic_busy_seconds`)."""
    built = plan_terms(graph, [(s.nodes, s.ranks) for s in priced.stages], cluster,
                       options=ModelOptions(schedule="1f1b"),
                       in_flight=[s.in_flight for s in priced.stages])
    return nic_busy_seconds(built.ranks, dict(built.costs.edges), built.costs.params,
                            cluster) * 1e3


def implied_dp(graph: Any, row: PaperRow, pipeline: float,
               cluster: Cluster) -> tuple[float, float | None]:
    """What the paper's speed-up says of its data parallelism, if our price of its pipeline is
    right: DP's time per minibatch (speed-up x pipeline), and the bandwidth a ring all-reduce
    without overlap would have achieved for DP to take that long (bytes each worker sends,
    2 (r-1)/r x parameters, over the time DP spends beyond its compute); None where DP would
    have to be faster than its compute alone (then the paper's pipeline was slower than our
    price of it, whatever the network did)."""
    workers = cluster.workers
    built = plan_terms(graph, [(topological_order(graph), tuple(range(workers)))], cluster,
                       options=ModelOptions(schedule="1f1b"))
    whole, params = built.terms[0], built.costs.params[0]
    dp = row.speedup * pipeline
    spent = dp * workers - whole.compute  # seconds per minibatch of one replica beyond compute
    if spent <= 0 or workers < 2:
        return dp, None
    return dp, 2.0 * (workers - 1) / workers * params / spent


def stage_split(graph: Any, priced: Plan, cluster: Cluster,
                stage: int = 0) -> tuple[float, float, float]:
    """One stage's compute and all-reduce (what the backward does not hide) per minibatch over
    its replicas, in seconds (`anatomy`'s figures as numbers), and its parameter bytes."""
    built = plan_terms(graph, [(s.nodes, s.ranks) for s in priced.stages], cluster,
                       options=ModelOptions(schedule="1f1b"),
                       in_flight=[s.in_flight for s in priced.stages])
    term = built.terms[stage]
    return (term.compute / term.replicas, term.allreduce / term.replicas,
            built.costs.params[stage])


def why_not_dp(r: dict[str, Any]) -> str:
    """Where the paper ran data parallelism and our planner does not: why our plan is faster in
    our model (DP's compute and all-reduce per minibatch against our plan's time and bound),
    how much faster DP's all-reduce would have to be to tie (the bus bandwidth over the link's
    per-flow rate), and what the original optimizer's own model picks on the same profile."""
    spare = r["our_ms"] - r["dp_compute_ms"]
    if spare <= 0:
        tie = "DP's compute alone is slower than our plan, so no network would tie it"
    else:
        factor = r["dp_allreduce_ms"] / spare
        tie = (f"DP ties our plan only with its all-reduce {factor:.0f}x faster "
               f"({factor * r['dp_ring_gbps']:.0f} Gbps of bus bandwidth, where a ring hop "
               f"between the servers gets {r['dp_ring_gbps']:.0f} Gbps)")
    return (f"- {r['profile']} {r['shape']} ({r['cluster']}), paper DP, ours "
            f"{r['our_config']}: our plan {r['our_ms']:.1f} ms per minibatch ({r['our_bound']}); "
            f"DP {r['dp_ms']:.1f} ms = compute {r['dp_compute_ms']:.1f} + all-reduce "
            f"{r['dp_allreduce_ms']:.1f} ms of {r['dp_params_mb']:.0f} MB of gradients "
            f"(what the backward does not hide); {tie}. The original optimizer's own model "
            f"(all-reduce at the link's bandwidth, no overlap) on the same profile picks "
            f"{r['original_optimizer']}: it does not choose DP either, so the paper's choice "
            "rests on something the profile does not carry (its measured DP run, or "
            "gradients smaller than the profile's parameters)")


def _shown_stages(bound: str, count: int) -> set[int]:
    """The stages worth a line: the bound's stage (or link ends), else the first and last."""
    found = {int(x) for x in re.findall(r"\d+", bound)}
    return found or {0, count - 1}


def row_graph(row: PaperRow) -> Any:
    """The row's profile at the per-worker minibatch the paper's runs used
    (`cost.minibatch.at_minibatch`)."""
    return at_minibatch(load_pipedream(row.profile), PROFILE_MINIBATCH[row.profile],
                        RUN_MINIBATCH[row.profile])


def measure(row: PaperRow) -> dict[str, Any]:
    """One row: our plan and the paper's config priced by us, with errors."""
    graph = row_graph(row)
    cluster = row_cluster(row)
    ours = plan(graph, cluster, schedule="1f1b")
    theirs = price_plan(graph, paper_plan(graph, row, cluster), cluster, schedule="1f1b")
    ours_speedup = ours.dp_time / ours.time_per_minibatch
    theirs_speedup = theirs.dp_time / theirs.time_per_minibatch
    dp = price_plan(graph, paper_plan(graph, PaperRow(row.profile, row.cluster, row.servers,
                                                      str(cluster.workers), 1.0), cluster),
                    cluster, schedule="1f1b", simulate=False)
    closed = price_plan(graph, theirs, cluster, schedule="1f1b", simulate=False)
    dp_compute, dp_allreduce, dp_params = stage_split(graph, dp, cluster)
    outer = cluster.levels[cluster.slowest_level_of(list(range(cluster.workers)))]
    implied = implied_dp(graph, row, theirs.time_per_minibatch, cluster)
    original = None
    if row.config == str(cluster.workers):  # what the original optimizer's model picks here
        picked = plan(graph, cluster, planner="dp", cost_model="pipedream", memory="16GiB")
        original = f"{config_of(picked)}, {picked.dp_time / picked.time_per_minibatch:.2f}x"
    return {
        "profile": row.profile, "cluster": row.cluster, "shape": row.shape,
        "paper_config": row.config, "paper_speedup": row.speedup,
        "profile_minibatch": PROFILE_MINIBATCH[row.profile],
        "run_minibatch": RUN_MINIBATCH[row.profile],
        "our_config": config_of(ours), "our_speedup": round(ours_speedup, 4),
        "our_ms": round(ours.time_per_minibatch * 1e3, 3),
        "dp_ms": round(ours.dp_time * 1e3, 3), "dp_fits": bool(ours.extra.get("dp_fits")),
        "paper_config_speedup": round(theirs_speedup, 4),
        "paper_config_fits": bool(theirs.extra.get("fits")),
        "paper_config_gib": round(max(s.memory for s in theirs.stages) / 2**30, 2),
        "our_error": round(ours_speedup / row.speedup - 1.0, 4),
        "paper_config_error": round(theirs_speedup / row.speedup - 1.0, 4),
        "paper_config_closed_speedup": round(closed.dp_time / closed.time_per_minibatch, 6),
        "paper_stages": [[list(s.nodes), list(s.ranks)] for s in theirs.stages],
        "original_optimizer": original,
        "implied_dp_ms": round(implied[0] * 1e3, 3),
        "implied_allreduce_gbps": None if implied[1] is None else round(implied[1] * 8 / 1e9, 3),
        "dp_nic_ms": round(nic_ms(graph, dp, cluster), 3),
        "paper_config_nic_ms": round(nic_ms(graph, theirs, cluster), 3),
        "paper_config_ms": round(theirs.time_per_minibatch * 1e3, 3),
        "our_nic_ms": round(nic_ms(graph, ours, cluster), 3),
        "dp_anatomy": anatomy(graph, dp, cluster),
        "our_bound": ours.extra.get("bound", ""),
        "dp_compute_ms": round(dp_compute * 1e3, 3),
        "dp_allreduce_ms": round(dp_allreduce * 1e3, 3),
        "dp_params_mb": round(dp_params / 1e6, 1),
        "dp_ring_gbps": round(outer.allreduce_rate * 8 / 1e9, 3),
        "pipeline_anatomy": anatomy(graph, theirs, cluster),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown, with the error summary under them."""
    lines = ["| model | cluster | paper: config, speed-up | ours: config, predicted | error | "
             "paper's config priced by us (peak GiB) | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['profile']} | {r['shape']} ({r['cluster']}) | {r['paper_config']}, "
            f"{r['paper_speedup']:.2f}x | {r['our_config']}, {r['our_speedup']:.2f}x | "
            f"{r['our_error']:+.0%} | {r['paper_speedup'] and r['paper_config_speedup']:.2f}x "
            f"({r['paper_config_gib']:.1f}{'' if r['paper_config_fits'] else ', over'}) | "
            f"{r['paper_config_error']:+.0%} |")
    lines.append("")
    piped = [r for r in rows if r["paper_config"] != "16"]
    for key, what in (("our_error", "our plan"), ("paper_config_error", "the paper's config")):
        errors = [abs(r[key]) for r in piped]
        within = sum(e <= 0.25 for e in errors)
        lines.append(f"- {what} on the {len(piped)} pipeline rows: median |error| "
                     f"{statistics.median(errors):.0%}, worst {max(errors):.0%}, "
                     f"{within} of {len(piped)} within 25%")
    dp_rows = [r for r in rows if r["paper_config"] == "16"]
    lines.append(f"- rows where the paper ran data parallelism: we pick DP on "
                 f"{sum(r['our_config'] == '16' for r in dp_rows)} of {len(dp_rows)}; "
                 f"DP fits the memory on {sum(r['dp_fits'] for r in dp_rows)} of {len(dp_rows)}; "
                 "the original optimizer's own cost model (`cost_model=\"pipedream\"`, 16 GiB) "
                 "on the same profiles picks: " + "; ".join(
                     f"{r['profile']} {r['shape']} ({r['cluster']}) {r['original_optimizer']}"
                     for r in dp_rows))
    lines.append("")
    apart = [r for r in dp_rows if r["our_config"] != r["paper_config"]]
    if apart:
        lines.append("Where the paper ran data parallelism and we do not, why (our model) and "
                     "which assumption differs:")
        lines.append("")
        lines.extend(why_not_dp(r) for r in apart)
        lines.append("")
    lines.append("What the paper's figure implies of its data parallelism, if our price of "
                 "the paper's configuration is right (DP ms per minibatch = paper speed-up x "
                 "our price; the ring all-reduce bandwidth, without overlap, that makes DP "
                 "that slow):")
    lines.append("")
    for r in rows:
        rate = r["implied_allreduce_gbps"]
        said = ("DP would have to beat its own compute" if rate is None
                else f"{rate:.2f} Gbps of all-reduce bandwidth")
        lines.append(f"- {r['profile']} {r['shape']} ({r['cluster']}): DP {r['implied_dp_ms']:.1f} "
                     f"ms per minibatch (ours {r['dp_ms']:.1f}): {said}")
    lines.append("")
    lines.append("Who shares a server's network interface (all flows of its workers at once, "
                 "one way, at the interface's bandwidth, `cost.links.nic_busy_seconds`): ms per "
                 "minibatch the busiest interface needs, against the plan's time per minibatch; "
                 "below it, the interface never limits the steady state:")
    lines.append("")
    for r in rows:
        lines.append(f"- {r['profile']} {r['shape']} ({r['cluster']}): DP {r['dp_nic_ms']:.1f} "
                     f"of {r['dp_ms']:.1f} | paper's config {r['paper_config_nic_ms']:.1f} of "
                     f"{r['paper_config_ms']:.1f} | ours {r['our_nic_ms']:.1f} of "
                     f"{r['our_ms']:.1f}")
    lines.append("")
    lines.append("What dominates, in our model (per stage: compute and all-reduce per minibatch "
                 "over its replicas, the largest message it sends or receives):")
    lines.append("")
    for r in rows:
        lines.append(f"- {r['profile']} {r['shape']} ({r['cluster']}): DP {r['dp_anatomy']} "
                     f"| paper's config {r['pipeline_anatomy']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--models", nargs="*", help="only these profiles")
    parser.add_argument("--golden", action="store_true",
                        help=f"rewrite the golden file the fast lane checks ({GOLDEN})")
    args = parser.parse_args(argv)
    rows = [measure(r) for r in TABLE_1 if not args.models or r.profile in args.models]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.golden:
        keep = ("profile", "cluster", "shape", "paper_config", "paper_speedup",
                "profile_minibatch", "run_minibatch", "our_config",
                "our_speedup", "paper_config_speedup", "paper_config_closed_speedup",
                "paper_stages")
        GOLDEN.write_text(json.dumps([{k: r[k] for k in keep} for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
