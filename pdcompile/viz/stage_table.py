"""The per-stage table of a compiled pipeline (what `Pipeline.summary()` prints).

Per stage: replicas and ranks, node count with its first and last node, parameters, predicted
compute, the bytes it sends downstream per minibatch and the predicted time to send them,
predicted memory per worker. Node facts come from the traced graph (`node.meta["pd.stage"]`),
times and memory from the Plan, bytes from node shapes (propagated on a copy of the graph from
the pipeline's example minibatch when the graph carries none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx as fx

from pdcompile.cost.ties import SharedWeights
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.kinds import kind
from pdcompile.units import format_bytes, format_seconds
from pdcompile.util.module_copy import copy_module


@dataclass(frozen=True)
class StageRow:
    """One stage of the table."""

    index: int
    replicas: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    parameters: int
    compute: float
    comm: float
    sends: float  # bytes sent to later stages per minibatch
    memory: float

    @property
    def first(self) -> str:
        """The stage's first node in graph order."""
        return self.nodes[0] if self.nodes else "-"

    @property
    def last(self) -> str:
        """The stage's last node in graph order."""
        return self.nodes[-1] if self.nodes else "-"


def stage_nodes(graph: fx.GraphModule, stages: int) -> list[list[fx.Node]]:
    """The fx nodes of each stage in graph order (the output node left out)."""
    out: list[list[fx.Node]] = [[] for _ in range(stages)]
    for node in graph.graph.nodes:
        if node.op == "output" or "pd.stage" not in node.meta:
            continue
        stage = int(node.meta["pd.stage"])
        if 0 <= stage < stages:
            out[stage].append(node)
    return out


def node_bytes(graph: fx.GraphModule, *, example_inputs: Sequence[Any] | None = None,
               cost_graph: nx.DiGraph | None = None) -> dict[str, float]:
    """Bytes of each node's output per minibatch: from a CostGraph when given, else from shapes
    on the nodes, else from shapes propagated on a copy of the graph (empty if impossible)."""
    if cost_graph is not None:
        return {str(n): float(d.get("act", 0.0)) for n, d in cost_graph.nodes(data=True)}
    from pdcompile.meta import get_shape, has_shape

    nodes = [n for n in graph.graph.nodes if n.op != "output"]
    if nodes and all(has_shape(n) for n in nodes):
        return {n.name: float(get_shape(n).nbytes) for n in nodes}
    if example_inputs is None:
        return {}
    import torch

    from pdcompile.errors import PdcompileError
    from pdcompile.passes.shapes import annotate_shapes

    shaped = copy_module(graph)
    inputs = tuple(example_inputs)
    weights = next(iter(shaped.parameters()), None)
    if weights is not None and weights.device.type == "meta":  # a loaded export's graph
        inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        with torch.random.fork_rng():
            annotate_shapes(shaped, inputs)
    except (PdcompileError, RuntimeError, TypeError, ValueError):
        return {}
    return {n.name: float(get_shape(n).nbytes) for n in shaped.graph.nodes
            if n.op != "output" and has_shape(n)}


def crossing_edges(graph: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """Every (producer, consumer) pair of nodes in different stages."""
    out = []
    for node in graph.graph.nodes:
        if node.op == "output" or "pd.stage" not in node.meta:
            continue
        for src in node.all_input_nodes:
            if "pd.stage" in src.meta and src.meta["pd.stage"] != node.meta["pd.stage"]:
                out.append((src, node))
    return out


def stage_rows(pipe: Any, *, cost_graph: nx.DiGraph | None = None) -> list[StageRow]:
    """The rows of the table for a Pipeline."""
    plan = pipe.plan
    count = len(plan.stages)
    graph = pipe.graph
    per_stage = stage_nodes(graph, count) if graph is not None else [[] for _ in range(count)]
    sizes = (node_bytes(graph, example_inputs=pipe.example_inputs, cost_graph=cost_graph)
             if graph is not None else {})
    sent: list[float] = [0.0] * count
    seen: set[tuple[str, int]] = set()
    if graph is not None:
        for src, dst in crossing_edges(graph):
            key = (src.name, int(dst.meta["pd.stage"]))
            if key not in seen:  # one tensor goes once to each stage that reads it
                seen.add(key)
                sent[int(src.meta["pd.stage"])] += sizes.get(src.name, 0.0)
    rows = []
    for index, stage in enumerate(plan.stages):
        names = tuple(n.name for n in per_stage[index]) or tuple(stage.nodes)
        params = sum(p.numel() for p in pipe.stage_modules[index].parameters())
        rows.append(StageRow(index, stage.replicas, tuple(stage.ranks), names, params,
                             stage.compute, stage.comm, sent[index], stage.memory))
    return rows


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 2] + ".."


def stage_table(rows: Sequence[StageRow], *, predicted: bool = True) -> str:
    """The rows as aligned text (`predicted=False`: no time and memory columns' values)."""

    def timed(text: str) -> str:
        return text if predicted else "-"

    header = ("stage", "replicas", "ranks", "nodes", "first", "last", "params", "compute",
              "sends/mb", "comm", "memory")
    body = [(str(r.index), str(r.replicas), _clip(",".join(map(str, r.ranks)), 12),
             str(len(r.nodes)), _clip(r.first, 22), _clip(r.last, 22), f"{r.parameters:,}",
             timed(format_seconds(r.compute)),
             format_bytes(r.sends) if r.sends else "-", timed(format_seconds(r.comm)),
             timed(format_bytes(r.memory))) for r in rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    left = {2, 4, 5}

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])


def pipeline_summary(pipe: Any) -> str:
    """Stage table, the plan's predicted totals, the schedule and the tied parameters."""
    plan = pipe.plan
    status = plan.status + (f", gap {plan.gap:.1%}" if plan.gap is not None else "")
    if plan.time_per_minibatch <= 0:
        totals = (f"config {plan.config} on {plan.workers} workers; the plan was given "
                  f"({plan.planner}) without a cluster, so nothing is predicted (pass a cluster "
                  "to compile() to price it)")
        return "\n".join([stage_table(stage_rows(pipe), predicted=False), "", totals,
                          *_schedule_lines(pipe)])
    lines = [stage_table(stage_rows(pipe)), "",
             f"config {plan.config} on {plan.workers} workers; predicted "
             f"{format_seconds(plan.time_per_minibatch)} per minibatch, "
             f"{plan.versus_data_parallel()}; planner {plan.planner} ({status}, "
             f"{plan.solve_seconds:.2f} s), cost model {plan.cost_model}"]
    if plan.prediction_text():
        lines.append(plan.prediction_text())
    return "\n".join(lines + _schedule_lines(pipe))


def _schedule_lines(pipe: Any) -> list[str]:
    lines = []
    shape = (f"minibatches stream through, {pipe.microbatches} in the exported loop"
             if not kind(pipe.schedule_name).microbatched else
             f"{pipe.microbatches} microbatches per minibatch")
    lines.append(f"schedule {pipe.schedule_name}, {shape}"
                 + (", vertical sync" if pipe.vertical_sync else "")
                 + ("" if pipe.stash else ", NO weight stashing"))
    for tie in pipe.parts.ties:
        lines.append(_tie_line(pipe, tie))
    return lines


def _tie_line(pipe: Any, tie: Any) -> str:
    """A tied parameter, the stages holding it and, where they sit on several ranks, the ranks
    its gradients are all-reduced over at each update and what that costs on the plan's
    cluster (cost/ties.py)."""
    stage_ranks = [s.ranks for s in pipe.plan.stages]
    ranks = sorted({r for s in tie.stages for r in stage_ranks[s]})
    text = f"tied: {tie.name} held by stages {list(tie.stages)} (gradients summed"
    if len(ranks) > 1:
        stage, name = tie.members[0]
        param = pipe.parts.stages[stage].module.get_parameter(name)
        text += f", {format_bytes(param.numel() * param.element_size())} all-reduced over " \
                f"ranks {ranks} at each update"
        if pipe.plan.cluster:
            cluster = Cluster.from_dict(pipe.plan.cluster)
            seconds = SharedWeights(tuple(tie.stages), float(param.numel()
                                                            * param.element_size()))
            text += f": {format_seconds(seconds.seconds(stage_ranks, cluster))}"
    return text + ")"


__all__ = ["StageRow", "crossing_edges", "node_bytes", "pipeline_summary", "stage_nodes",
           "stage_rows", "stage_table"]
