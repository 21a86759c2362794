"""`pdcompile inspect`: trace and cost a model (or read a profile), print a node table, draw it.

    pdcompile inspect pdcompile.models.vgg16:factory
    pdcompile inspect pdcompile/models/resnet50.py:factory --cost analytic --cluster h100-node \\
        --draw g.svg
    pdcompile inspect --profile resnet50 --coarsen 40

    pdcompile inspect pdcompile.models.democnn:factory --draw graph.png --json > graph.json

The table has one row per node (or per block with --coarsen): what it is, its output shape,
forward and backward seconds, output activation, parameter and kept bytes, then the totals.
--draw draws the graph with matplotlib (.svg/.png; .dot for graphviz), no graphviz needed;
--svg renders a richer DOT drawing with graphviz `dot` when it is installed.
Exit status: 0 ok, 1 a user error or bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import networkx as nx

from pdcompile.cli.common import add_cluster_option, load_cluster, load_factory
from pdcompile.cost import costgraph
from pdcompile.errors import PdcompileError
from pdcompile.units import format_bytes, format_seconds

DOT_HINT = ("graphviz's 'dot' program is not installed, so no SVG was drawn; install graphviz "
            "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; conda: "
            "conda install graphviz) and run again, or render the DOT file written to {dot} "
            "elsewhere (dot -Tsvg {dot} -o {svg})")


def register(subparsers: Any) -> None:
    """Add the `inspect` parser."""
    parser = subparsers.add_parser(
        "inspect", help="trace and cost a model (or read a profile): node table and graph",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="path/to/file.py:factory or "
                        "package.module:factory returning (model, example inputs), e.g. "
                        "pdcompile.models.vgg16:factory")
    parser.add_argument("--profile", metavar="PATH", help="a PipeDream graph.txt (or its "
                        "folder) instead, e.g. --profile vgg16")
    parser.add_argument("--costgraph", metavar="PATH",
                        help="a CostGraph JSON file instead (from --save), e.g. --costgraph g.json")
    parser.add_argument("--cost", default="measured", choices=("measured", "analytic"),
                        help="measured on this machine (default) or analytic on the device of "
                        "--cluster (FLOPs and bytes on a roofline), e.g. --cost analytic "
                        "--cluster h100-node")
    add_cluster_option(parser, default="A")
    parser.add_argument("--leaf", action="append", default=[], metavar="MODULE",
                        help="qualified name of a submodule to keep as one node (repeatable), e.g. "
                        "--leaf encoder.attn")
    parser.add_argument("--warmup", type=int, default=2,
                        help="measured: untimed runs per node (default 2)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="measured: timed runs per node (default 5), e.g. --repeats 20")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="measured on a CPU: wall clock (default) or CPU time, "
                        "steadier on a busy machine")
    parser.add_argument("--caches", default="warm", choices=("warm", "cold"),
                        help="measured: time each run with the node's data in the caches "
                        "(warm, default) or after evicting the last-level cache (cold: as a "
                        "pipeline meets a node; slower to profile), e.g. --caches cold")
    parser.add_argument("--coarsen", type=int, metavar="N",
                        help="fuse chains until at most N blocks remain (shows blocks), e.g. "
                        "--coarsen 40")
    parser.add_argument("--top", type=int, metavar="N",
                        help="show only the N nodes with the largest fwd+bwd (totals stay whole), "
                        "e.g. --top 10")
    parser.add_argument("--draw", metavar="PATH", help="draw the graph with matplotlib "
                        "(.svg, .png or .dot), e.g. --draw graph.svg")
    parser.add_argument("--svg", metavar="PATH", help="draw the graph to this SVG file with "
                        "graphviz `dot` (also writes PATH.dot), e.g. --svg graph.svg")
    parser.add_argument("--save", metavar="PATH",
                        help="write the CostGraph as JSON (for plan --costgraph), e.g. "
                        "--save g.json")
    parser.add_argument("--json", action="store_true",
                        help="print the CostGraph and its totals as JSON")
    parser.set_defaults(func=run)


# --------------------------------------------------------------------------------- library
def cost_graph_of_model(spec: str, *, cost: str = "measured", cluster: str = "A",
                        leaves: tuple[str, ...] = (), warmup: int = 2, repeats: int = 5,
                        clock: str = "wall", progress: bool = True,
                        caches: str = "warm") -> nx.DiGraph:
    """Trace, shape and cost the model a factory spec names; node `shape` attributes added."""
    import torch

    from pdcompile.cost.costed_graph import costed
    from pdcompile.meta import get_shape

    torch.set_num_threads(1)
    model, inputs = load_factory(spec)
    device = load_cluster(cluster, planned=False).device if cost == "analytic" else None
    gm, graph = costed(model, inputs, cost=cost, name=spec, leaf_modules=leaves, device=device,
                       caches=caches, warmup=warmup, repeats=repeats, clock=clock,
                       progress=progress)
    for node in gm.graph.nodes:
        if node.name in graph:
            graph.nodes[node.name]["shape"] = str(get_shape(node))
    graph.graph["source"] = cost if cost == "analytic" else \
        f"measured ({clock} clock{', cold caches' if caches == 'cold' else ''})"
    if cost == "analytic" and device is not None:
        graph.graph["source"] = f"analytic on {device.name}"
    return graph


def load_graph(args: argparse.Namespace) -> nx.DiGraph:
    """The CostGraph the arguments name."""
    sources = [x for x in (args.model, args.profile, args.costgraph) if x]
    if len(sources) != 1:
        raise PdcompileError("give exactly one of MODEL (file.py:factory or "
                             "package.module:factory), --profile graph.txt or --costgraph g.json")
    if args.profile:
        from pdcompile.profiles import load_pipedream

        graph = load_pipedream(args.profile)
        graph.graph["source"] = "imported (PipeDream profile)"
        return graph
    if args.costgraph:
        graph = costgraph.load(args.costgraph)
        graph.graph["source"] = f"CostGraph file {args.costgraph}"
        return graph
    return cost_graph_of_model(args.model, cost=args.cost, cluster=args.cluster,
                               leaves=tuple(args.leaf), warmup=args.warmup,
                               repeats=args.repeats, clock=args.clock,
                               progress=not args.json and sys.stderr.isatty(),
                               caches=getattr(args, "caches", "warm"))


def table(graph: nx.DiGraph, *, top: int | None = None) -> str:
    """The node table with totals, as text."""
    order = costgraph.topological_order(graph)
    shown = order
    if top is not None:
        ranked = sorted(order, key=lambda n: -(graph.nodes[n]["fwd"] + graph.nodes[n]["bwd"]))
        keep = set(ranked[:top])
        shown = [n for n in order if n in keep]
    header = ("node", "what", "output", "fwd", "bwd", "act", "params", "keep")
    rows: list[tuple[str, ...]] = []
    for node in shown:
        data = graph.nodes[node]
        members = data.get("members", [node])
        what = str(data.get("label", ""))
        if len(members) > 1:
            what = f"{len(members)} nodes, last {what}"
        rows.append((str(node), _clip(what, 40), _clip(str(data.get("shape", "")), 28),
                     format_seconds(data["fwd"]), format_seconds(data["bwd"]),
                     format_bytes(data["act"]), format_bytes(data["params"]),
                     format_bytes(data.get("keep", data["act"]))))
    sums = costgraph.totals(graph)
    keep_total = sum(float(d.get("keep", d["act"])) for _, d in graph.nodes(data=True))
    total = (f"total ({graph.number_of_nodes()})", "", "", format_seconds(sums["fwd"]),
             format_seconds(sums["bwd"]), format_bytes(sums["act"]),
             format_bytes(sums["params"]), format_bytes(keep_total))
    widths = [max(len(r[i]) for r in [header, total, *rows]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [row[i].ljust(widths[i]) if i < 3 else row[i].rjust(widths[i])
                 for i in range(len(row))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(header), rule, *(line(r) for r in rows), rule, line(total)]
    if top is not None and len(shown) < len(order):
        out.append(f"(showing the {len(shown)} most expensive of {len(order)} nodes; totals "
                   "cover all)")
    return "\n".join(out)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


_DOT_NEWLINE = chr(92) + "n"  # the two characters backslash, n: a line break inside a label


def _dot_escape(text: str) -> str:
    return text.replace(chr(92), chr(92) * 2).replace('"', chr(92) + '"')


def to_dot(graph: nx.DiGraph) -> str:
    """Graphviz DOT source: one box per node with its costs, edges labelled with bytes."""
    ids = {node: f"n{i}" for i, node in enumerate(graph.nodes)}
    lines = [f"digraph {json.dumps(str(graph.graph.get('name') or 'costgraph'))} {{",
             "  rankdir=TB;", '  node [shape=box, fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8, color="#666666"];']
    peak = max((d["fwd"] + d["bwd"] for _, d in graph.nodes(data=True)), default=0.0) or 1.0
    for node, data in graph.nodes(data=True):
        parts = (str(node), _clip(str(data.get("label", "")), 40), str(data.get("shape", "")),
                 f"fwd {format_seconds(data['fwd'])}  bwd {format_seconds(data['bwd'])}",
                 f"params {format_bytes(data['params'])}" if data["params"] else "")
        label = _DOT_NEWLINE.join(_dot_escape(x) for x in parts if x)
        heat = (data["fwd"] + data["bwd"]) / peak
        colour = f"0.0 {0.05 + 0.6 * heat:.3f} 1.0"
        lines.append(f'  {ids[node]} [label="{label}", style=filled, fillcolor="{colour}"];')
    for u, v in graph.edges:
        size = costgraph.edge_bytes(graph, u, v)
        lines.append(f'  {ids[u]} -> {ids[v]} [label="{format_bytes(size)}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw_svg(graph: nx.DiGraph, path: str | Path, *, dot_program: str = "dot") -> Path:
    """Write PATH.dot and render it to PATH with graphviz; PdcompileError with a hint if `dot`
    is missing or fails."""
    svg = Path(path)
    dot_file = svg.with_suffix(".dot")
    dot_file.write_text(to_dot(graph))
    program = shutil.which(dot_program)
    if program is None:
        raise PdcompileError(DOT_HINT.format(dot=dot_file, svg=svg))
    done = subprocess.run([program, "-Tsvg", str(dot_file), "-o", str(svg)],
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise PdcompileError(f"graphviz failed to draw {dot_file}: "
                             f"{done.stderr.strip()[:300]}")
    return svg


def run(args: argparse.Namespace) -> int:
    """The subcommand."""
    if args.top is not None and args.top < 1:  # before profiling; -2 showed all nodes but 2
        raise PdcompileError(f"--top takes a positive node count, not {args.top}; e.g. --top 10")
    graph = load_graph(args)
    mapping = None
    if args.coarsen is not None:
        if args.coarsen < 1:
            raise PdcompileError(f"--coarsen takes a positive block count, not {args.coarsen}")
        shapes = {n: d.get("shape", "") for n, d in graph.nodes(data=True)}
        graph, mapping = costgraph.coarsen(graph, target=args.coarsen)
        for block, members in mapping.items():
            graph.nodes[block]["shape"] = shapes.get(members[-1], "")
    if args.save:
        costgraph.save(graph, args.save)
    if args.json:
        data = costgraph.to_dict(graph)
        data["totals"] = costgraph.totals(graph)
        data["source"] = graph.graph.get("source", "")
        print(json.dumps(data, indent=1))
    else:
        name = graph.graph.get("name", "")
        print(f"{name}: {graph.number_of_nodes()} "
              f"{'blocks' if mapping is not None else 'nodes'}, "
              f"{graph.number_of_edges()} edges; costs: {graph.graph.get('source', '')}; "
              f"batch size {graph.graph.get('batch_size') or '?'}")
        print(table(graph, top=args.top))
    if args.draw:
        from pdcompile.viz.plan_graph import costgraph_picture, write_picture

        picture = costgraph_picture(graph, collapse=graph.number_of_nodes() + 1)
        drawn = write_picture(picture, args.draw, f"{graph.graph.get('name', '')}: "
                              f"{graph.number_of_nodes()} nodes (edges: bytes per minibatch)")
        print(f"wrote {drawn}", file=sys.stderr if args.json else sys.stdout)
    if args.svg:
        svg = draw_svg(graph, args.svg)
        if not args.json:
            print(f"wrote {svg} (and {svg.with_suffix('.dot')})")
    return 0
