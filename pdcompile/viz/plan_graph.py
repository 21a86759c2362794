"""Picture of a partitioned graph: nodes grouped and coloured by stage, cut edges labelled.

Stages are columns from left to right, each a coloured box titled with its index, replicas and
ranks; inside it the stage's nodes in graph order. Every edge that crosses a stage boundary is
drawn in black and labelled with the bytes it carries per minibatch (forward; the gradient going
back is the same size). A stage with more than `collapse` nodes is drawn as one box with its
node count and first and last node, so large graphs stay readable; `stage=K` expands stage K
alone and draws its neighbours collapsed. Drawn with matplotlib (PNG or SVG by the extension), so
no graphviz is needed; `to_dot` gives the same picture as graphviz DOT source for those who
have it (a `.dot` path writes that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from pdcompile.errors import PdcompileError
from pdcompile.units import format_bytes
from pdcompile.viz.stage_table import node_bytes, stage_nodes

PALETTE = ("#8fb8e8", "#9fd89f", "#f5b971", "#d7b8e8", "#f2a0a0", "#a8dcd9", "#e8d88f",
           "#c9c9c9", "#b8c8f0", "#f0c0d8")
COLLAPSE = 40  # stages with more nodes than this are drawn as one box


@dataclass
class PlanPicture:
    """What the drawing shows, independent of how it is drawn (tests read this).

    `columns[s]`: the boxes of stage s, each a node name or, for a collapsed stage, the single
    entry "stage s"; `edges`: (from box, to box, label) with label "" inside a stage;
    `titles[s]`: the stage's title.
    """

    columns: list[list[str]]
    titles: list[str]
    edges: list[tuple[str, str, str]]
    labels: dict[str, str] = field(default_factory=dict)
    collapsed: set[int] = field(default_factory=set)


def plan_picture(pipe: Any, *, cost_graph: nx.DiGraph | None = None, collapse: int = COLLAPSE,
                 stage: int | None = None) -> PlanPicture:
    """The boxes and edges to draw for a Pipeline (see the module docstring)."""
    graph = pipe.graph
    if graph is None:
        raise PdcompileError("this pipeline has no traced graph to draw (Pipeline.graph is None)")
    count = len(pipe.plan.stages)
    per_stage = [[(n.name, _node_label(graph, n)) for n in nodes]
                 for nodes in stage_nodes(graph, count)]
    edges = [(src.name, node.name) for node in graph.graph.nodes if node.op != "output"
             for src in node.all_input_nodes]
    sizes = node_bytes(graph, example_inputs=pipe.example_inputs, cost_graph=cost_graph)
    return _picture(per_stage, edges, sizes, pipe.plan, collapse=collapse, stage=stage)


def costgraph_picture(graph: nx.DiGraph, plan: Any = None, *, collapse: int = COLLAPSE,
                      stage: int | None = None) -> PlanPicture:
    """The same picture for a CostGraph (a profile, or a model's costs) and the Plan made from
    it; without a plan, the whole graph is one stage. Nodes the plan does not place (inputs)
    join the stage of their first placed successor."""
    from pdcompile.cost.costgraph import edge_bytes, topological_order
    from pdcompile.plan import Plan, Stage

    order = topological_order(graph)
    if plan is None:
        plan = Plan(stages=(Stage(tuple(order), 1, (0,)),), time_per_minibatch=0.0, dp_time=0.0,
                    workers=1, planner="none")
    placed = plan.stage_of()
    stage_of: dict[str, int] = {}
    for node in reversed(order):
        if node in placed:
            stage_of[node] = placed[node]
        else:
            after = [stage_of[v] for v in graph.successors(node) if v in stage_of]
            stage_of[node] = min(after, default=0)
    per_stage: list[list[tuple[str, str]]] = [[] for _ in plan.stages]
    for node in order:
        label = str(graph.nodes[node].get("label", ""))
        text = str(node) if not label or label == str(node) \
            else f"{node}\n{short_label(label, LABEL_CHARS)}"
        per_stage[min(stage_of[node], len(per_stage) - 1)].append((str(node), text))
    sizes = {str(u): edge_bytes(graph, u, v) for u, v in graph.edges}
    return _picture(per_stage, [(str(u), str(v)) for u, v in graph.edges], sizes, plan,
                    collapse=collapse, stage=stage)


LABEL_CHARS = 50  # what fits on one line of a node's box at 6.5 points


def short_label(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, cut after a whole top-level argument with "...",
    never inside a token or a nested value: "Conv2d(3, 16, kernel_size=(3, 3), ...)"."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    depth, cuts = 0, []
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
            if depth == 1:
                cuts.append(i + 1)  # right after the opening bracket: no argument kept
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 1:
            cuts.append(i)
    fitting = [c for c in cuts if c + len("...)" if text[c - 1] == "(" else ", ...)") <= limit]
    if not fitting:
        return text[:limit - 4].rstrip() + " ..."
    cut = fitting[-1]
    kept = text[:cut]
    return f"{kept}...)" if kept.endswith("(") else f"{kept}, ...)"


def _picture(per_stage: list[list[tuple[str, str]]], pairs: list[tuple[str, str]],
             sizes: dict[str, float], plan: Any, *, collapse: int,
             stage: int | None) -> PlanPicture:
    count = len(per_stage)
    if stage is not None and not 0 <= stage < count:
        raise PdcompileError(f"stage {stage} does not exist: the plan has stages 0..{count - 1}")
    if collapse < 1:
        raise PdcompileError(f"collapse takes a positive node count, not {collapse}")
    if stage is not None:
        collapsed = {s for s in range(count) if s != stage}
    else:
        collapsed = {s for s in range(count) if len(per_stage[s]) > collapse}
    box: dict[str, str] = {}
    home: dict[str, int] = {}
    columns: list[list[str]] = []
    labels: dict[str, str] = {}
    titles = []
    for s, nodes in enumerate(per_stage):
        info = plan.stages[s]
        ranks = ",".join(str(r) for r in info.ranks)
        many = info.replicas > 1
        titles.append(f"stage {s}: {info.replicas} replica{'s' if many else ''}"
                      f" (rank{'s' if many else ''} {ranks})")
        for name, _ in nodes:
            home[name] = s
        if s in collapsed:
            name = f"stage {s}"
            first = nodes[0][0] if nodes else "-"
            last = nodes[-1][0] if nodes else "-"
            labels[name] = f"{len(nodes)} nodes\n{first}\n..\n{last}"
            columns.append([name])
            for node, _ in nodes:
                box[node] = name
        else:
            columns.append([name for name, _ in nodes])
            for name, text in nodes:
                box[name] = name
                labels[name] = text
    edges: dict[tuple[str, str], float] = {}
    inner: set[tuple[str, str]] = set()
    sent: set[tuple[str, str]] = set()
    for src, dst in pairs:
        if src not in box or dst not in box:
            continue
        key = (box[src], box[dst])
        if key[0] == key[1]:
            continue
        if home[src] != home[dst]:
            if (src, key[1]) not in sent:  # a tensor goes once to each box that reads it
                sent.add((src, key[1]))
                edges[key] = edges.get(key, 0.0) + sizes.get(src, float("nan"))
        else:
            inner.add(key)
    out = [(a, b, "") for a, b in sorted(inner)]
    out += [(a, b, "?" if value != value else format_bytes(value))
            for (a, b), value in edges.items()]
    return PlanPicture(columns, titles, out, labels, collapsed)


def _node_label(graph: Any, node: Any) -> str:
    target = node.target
    if node.op == "call_module":
        try:
            what = type(graph.get_submodule(str(target))).__name__
        except AttributeError:
            what = str(target)
    elif node.op in ("call_function", "call_method"):
        what = getattr(target, "__name__", str(target))
    else:
        what = node.op
    return node.name if what == node.name else f"{node.name}\n{what}"


def draw_plan(pipe: Any, path: str | Path, *, graph: nx.DiGraph | None = None,
              collapse: int = COLLAPSE, stage: int | None = None,
              title: str | None = None) -> Path:
    """Draw `pipe`'s partitioned graph to `path` (.svg, .png or .dot); returns the path.

    `graph`: the CostGraph the plan came from, for the bytes on the cut edges (otherwise they
    come from shapes of the example minibatch).
    """
    picture = plan_picture(pipe, cost_graph=graph, collapse=collapse, stage=stage)
    return write_picture(picture, path, title or f"{pipe.name}: {pipe.plan.config} on "
                         f"{pipe.plan.workers} workers (edges: bytes per minibatch)")


def write_picture(picture: PlanPicture, path: str | Path, title: str) -> Path:
    """Write a picture to `path`: .svg or .png drawn with matplotlib, .dot as DOT source."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = target.suffix.lower()
    if suffix == ".dot":
        target.write_text(to_dot(picture))
        return target
    if suffix not in (".svg", ".png"):
        raise PdcompileError(f"plan drawing {target} must end in .svg, .png or .dot")
    _draw(picture, target, title)
    return target


def _draw(picture: PlanPicture, target: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    col_w, gap, row_h = 2.6, 1.2, 0.55
    rows = max(len(c) for c in picture.columns)
    collapsed_h = 2.0
    height = max(rows * row_h, collapsed_h) + 1.2
    # wide enough for the title (about 0.075 inch per character at 9 points), so none is cut
    width = max(len(picture.columns) * (col_w + gap) + 0.4, 0.075 * len(title) + 0.8)
    fig = Figure(figsize=(min(width, 60.0), min(height, 120.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_xlim(0, width)
    ax.set_ylim(-height + 0.2, 0.8)
    ax.axis("off")
    centre: dict[str, tuple[float, float]] = {}
    half_h: dict[str, float] = {}
    for s, column in enumerate(picture.columns):
        x0 = 0.3 + s * (col_w + gap)
        colour = PALETTE[s % len(PALETTE)]
        extent = collapsed_h if s in picture.collapsed else len(column) * row_h
        ax.add_patch(FancyBboxPatch((x0, -extent - 0.15), col_w, extent + 0.2,
                                    boxstyle="round,pad=0.05", facecolor=colour, alpha=0.35,
                                    edgecolor="#444444", linewidth=0.8))
        ax.text(x0 + col_w / 2, 0.25, picture.titles[s], ha="center", va="center",
                fontsize=8, fontweight="bold")
        for i, name in enumerate(column):
            h = collapsed_h - 0.3 if s in picture.collapsed else row_h * 0.8
            y = -(collapsed_h / 2) if s in picture.collapsed else -(i + 0.5) * row_h
            ax.add_patch(FancyBboxPatch((x0 + 0.15, y - h / 2), col_w - 0.3, h,
                                        boxstyle="round,pad=0.02", facecolor=colour,
                                        edgecolor="#222222", linewidth=0.6))
            ax.text(x0 + col_w / 2, y, picture.labels.get(name, name), ha="center",
                    va="center", fontsize=6.5 if s not in picture.collapsed else 8)
            centre[name] = (x0 + col_w / 2, y)
            half_h[name] = h / 2
    for src, dst, label in picture.edges:
        (x1, y1), (x2, y2) = centre[src], centre[dst]
        if label:  # crosses a stage boundary: from the right side to the left side
            start, end = (x1 + col_w / 2 - 0.15, y1), (x2 - col_w / 2 + 0.15, y2)
            ax.annotate("", xy=end, xytext=start,
                        arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 1.0,
                                    "connectionstyle": "arc3,rad=0.08"})
            ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.08, label,
                    ha="center", va="bottom", fontsize=7, color="#b00000",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
        else:
            adjacent = abs(y1 - y2) <= row_h * 1.01
            start, end = (x1, y1 - half_h[src]), (x2, y2 + half_h[dst])
            if not adjacent:  # a skip inside the stage: bend around the boxes on the side
                start, end = (x1 + col_w / 2 - 0.15, y1), (x2 + col_w / 2 - 0.15, y2)
            ax.annotate("", xy=end, xytext=start,
                        arrowprops={"arrowstyle": "->", "color": "#777777", "linewidth": 0.6,
                                    "connectionstyle": "arc3,rad=0.0" if adjacent else
                                    "arc3,rad=-0.4"})
    ax.text(0.3, -height + 0.45, title, fontsize=9, ha="left", va="center")
    fig.savefig(target, dpi=100)


def _dot_text(text: str) -> str:
    return json.dumps(text)


def to_dot(picture: PlanPicture) -> str:
    """Graphviz DOT source of the picture: one cluster per stage, cut edges labelled."""
    lines = ["digraph plan {", "  rankdir=LR; compound=true;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=9];',
             '  edge [fontname="Helvetica", fontsize=8];']
    for s, column in enumerate(picture.columns):
        colour = PALETTE[s % len(PALETTE)]
        lines.append(f"  subgraph cluster_{s} {{")
        lines.append(f"    label={_dot_text(picture.titles[s])}; style=filled; "
                     f'color="#444444"; fillcolor="{colour}40";')
        for name in column:
            lines.append(f"    {_dot_text(name)} [label={_dot_text(picture.labels.get(name, name))}"
                         f', fillcolor="{colour}"];')
        lines.append("  }")
    for src, dst, label in picture.edges:
        attrs = f" [label={_dot_text(label)}, penwidth=1.5]" if label else ' [color="#888888"]'
        lines.append(f"  {_dot_text(src)} -> {_dot_text(dst)}{attrs};")
    lines.append("}")
    return "\n".join(lines) + "\n"


__all__ = ["COLLAPSE", "PlanPicture", "costgraph_picture", "draw_plan", "plan_picture", "to_dot",
           "write_picture"]
