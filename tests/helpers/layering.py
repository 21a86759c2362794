"""The package's layers, and a checker that every import points down and no modules import each
other in a circle.

`LAYERS` is the table (lowest first); docs/architecture.md shows it as `layer_table()` renders
it (tests/test_layering.py keeps the two equal). A module belongs to the layer of the longest
pattern that names it or a package above it. A module may import its own layer and the layers
below, never one above; `APART` lists rooms of one layer that must not import each other. Every
import counts: at module level, inside functions, and under `if TYPE_CHECKING:` (a name in an
annotation is still a dependency). Importing `a.b.c` counts as importing the module `a.b.c`
only, not the packages above it (tests/test_layering.py checks that a room's `__init__.py`
imports nothing outside its room).

    python tests/helpers/layering.py      # check pdcompile, print the table and any violation
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx as nx


@dataclass(frozen=True)
class Layer:
    """One layer: its name, the modules or packages in it, and what they are."""

    name: str
    patterns: tuple[str, ...]
    what: str


LAYERS: tuple[Layer, ...] = (
    Layer("base", ("pdcompile.errors", "pdcompile.units", "pdcompile.util", "pdcompile.models"),
          "errors, units, messages and user code; the bundled models (torch only)"),
    Layer("data", ("pdcompile.plan", "pdcompile.timeline", "pdcompile.meta", "pdcompile.profiles",
                   "pdcompile.machine", "pdcompile.schedule.ir", "pdcompile.schedule.kinds",
                   "pdcompile.cost.costgraph"),
          "Plan, Timeline, node.meta, the cluster and device model, the schedule IR and the "
          "table of schedule kinds, the CostGraph and the PipeDream profile reader"),
    Layer("rules", ("pdcompile.schedule", "pdcompile.cost"),
          "torch-free rules: schedule generators, lowering, dependencies, validation, build(); "
          "cost formulas (links, crossing, memory, updates, closed forms, stage costs)"),
    Layer("runtime", ("pdcompile.runtime",),
          "what generated rank code calls: stage runtime, stash, transports, checkpoints, the "
          "fused Linear's autograd function"),
    Layer("passes, backends", ("pdcompile.passes", "pdcompile.backends",
                               "pdcompile.cost.node_costs", "pdcompile.cost.timers",
                               "pdcompile.cost.cache_flush", "pdcompile.cost.neighbours",
                               "pdcompile.cost.optimizer_timing",
                               "pdcompile.cost.costed_graph"),
          "trace, shapes, split, fuse, codegen and the cost pass (measured, analytic); local, "
          "distributed and simulated backends"),
    Layer("planner, viz", ("pdcompile.planner", "pdcompile.viz"),
          "plan(), price_plan(), refine_plan() and their parts; tables and pictures of plans, "
          "pipelines and timelines"),
    Layer("pipeline", ("pdcompile.pipeline", "pdcompile.export"),
          "the Pipeline object; an export's format, checks and writer"),
    Layer("api", ("pdcompile", "pdcompile.api", "pdcompile.export.read", "pdcompile.worker",
                  "pdcompile.demo"),
          "compile(), load(), the package's entry points, the worker processes, the demo"),
    Layer("cli", ("pdcompile.cli", "pdcompile.__main__"), "the command line"),
)

# rooms of one layer that do not import each other (they meet in the layers below)
APART: tuple[tuple[str, str], ...] = (
    ("pdcompile.passes", "pdcompile.backends"),
    ("pdcompile.backends", "pdcompile.passes"),
    ("pdcompile.planner", "pdcompile.viz"),
    ("pdcompile.viz", "pdcompile.planner"),
)


@dataclass(frozen=True)
class Import:
    """One import statement's target module, with where it was written."""

    source: str  # the importing module
    target: str  # the imported module (the longest module of the package the statement names)
    file: Path
    line: int


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a folder under `root`) by dotted name."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(root: Path, package: str) -> list[Import]:
    """Every import of a module of `package` by a module of `package`, wherever written."""
    known = modules(root, package)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for source, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = source.split(".") if path.name == "__init__.py" \
                        else source.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                         for alias in node.names]
            for name in names:
                if name != package and not name.startswith(package + "."):
                    continue
                target = resolve(name)
                if target is not None and target != source:
                    out.append(Import(source, target, path, node.lineno))
    return list(dict.fromkeys(out))  # `from m import a, b`: once


def layer_of(module: str, layers: Sequence[Layer]) -> int | None:
    """Index of the layer whose longest pattern names `module` or a package above it (a pattern
    without a dot, the package itself, names its `__init__` only)."""
    best: tuple[int, int] | None = None  # (pattern length, layer index)
    for index, layer in enumerate(layers):
        for pattern in layer.patterns:
            if module == pattern or ("." in pattern and module.startswith(pattern + ".")):
                if best is None or len(pattern) > best[0]:
                    best = (len(pattern), index)
    return None if best is None else best[1]


def violations(root: Path, package: str, layers: Sequence[Layer] = LAYERS,
               apart: Iterable[tuple[str, str]] = APART) -> list[str]:
    """What breaks the layering, one line each: a module with no layer, an import that points
    up, an import between rooms kept apart, and every cycle of imports."""
    out = []
    known = modules(root, package)
    for module in known:
        if layer_of(module, layers) is None:
            out.append(f"{module} ({known[module].relative_to(root)}) has no layer: add it to "
                       "LAYERS in tests/helpers/layering.py")
    edges = imports(root, package)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for edge in edges:
        graph.add_edge(edge.source, edge.target)
        low, high = layer_of(edge.target, layers), layer_of(edge.source, layers)
        where = f"{edge.file.relative_to(root)}:{edge.line}"
        if low is not None and high is not None and low > high:
            out.append(f"{where}: {edge.source} (layer {layers[high].name}) imports "
                       f"{edge.target} (layer {layers[low].name}, higher); move what it needs "
                       "down, or the importer up")
        for first, second in apart:
            if _within(edge.source, first) and _within(edge.target, second):
                out.append(f"{where}: {edge.source} imports {edge.target}, but {first} and "
                           f"{second} do not import each other")
    for cycle in sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1):
        lines = [f"{e.file.relative_to(root)}:{e.line} {e.source} -> {e.target}"
                 for e in edges if e.source in cycle and e.target in cycle]
        out.append(f"import cycle among {', '.join(cycle)}: " + "; ".join(sorted(set(lines))))
    return out


def _within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def layer_table(layers: Sequence[Layer] = LAYERS) -> str:
    """The table for docs/architecture.md: highest layer first, as the layers are drawn."""
    rows = ["| layer | modules and rooms | what |", "|---|---|---|"]
    for layer in reversed(layers):
        names = ", ".join(f"`{p.removeprefix('pdcompile.')}`" if p != "pdcompile"
                          else "`pdcompile` (`__init__`)" for p in layer.patterns)
        rows.append(f"| {layer.name} | {names} | {layer.what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    here = Path(__file__).resolve().parents[2]
    print(layer_table())
    found = violations(here, "pdcompile")
    print("\n".join(found) or "no upward imports, no cycles")
    sys.exit(1 if found else 0)
