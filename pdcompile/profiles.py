"""Reader of PipeDream's layer profiles (`graph.txt`) into a CostGraph.

Format (one node per line, then one edge per line starting with a tab):

    nodeX -- <layer description> -- forward_compute_time=F, backward_compute_time=B, \
activation_size=A, parameter_size=P
    \tnodeU -- nodeV

F and B are milliseconds per minibatch, A and P bytes; A may be a list `[a; b; c]` (summed).

PipeDream's own profiles of 14 models ship inside the package (`pdcompile/data/pipedream`, MIT
licensed, provenance in its README.md): `load_pipedream("vgg16")` finds one by name.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import networkx as nx

from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.errors import ProfileError
from pdcompile.util.bounded_file import NotPlainFile, read_plain_file, refusal

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NODE_EXAMPLE = ("node4 -- Conv2d(3, 64, kernel_size=(3, 3)) -- forward_compute_time=1.2, "
                 "backward_compute_time=2.5, activation_size=411041792.0, parameter_size=7168.0")


def _number(text: str, where: str, field: str, *, in_list: bool = False) -> float:
    """A field's value: a number, or (not nested) a list `[a; b; c]` of numbers, summed."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]") and not in_list:
        return sum(_number(part, where, field, in_list=True)
                   for part in text[1:-1].split(";") if part.strip())
    try:
        value = float(text)
    except ValueError:
        raise ProfileError(f"{where}: {field}={_short(text)!r} is not a number (or a list "
                           "[a; b] of numbers)") from None
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: {field}={_short(text)!r} must be a finite non-negative "
                           "number")
    return value


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


MAX_PROFILE_BYTES = 1 << 26
"""The largest graph.txt read (64 MiB): 268 times the largest PipeDream profile shipped
(nasnetalarge: 249,981 bytes, 1,251 layers), some 300,000 layers. The file is read whole, and
a FIFO named as one blocked the reader forever, a sparse file of gigabytes filled memory."""

SHIPPED = Path(__file__).resolve().parent / "data" / "pipedream"
"""PipeDream's profiles as the package ships them: SHIPPED / name / "graph.txt"."""


def shipped_profiles() -> list[str]:
    """Names of the PipeDream profiles that ship with the package (vgg16, resnet50, ...)."""
    return sorted(p.name for p in SHIPPED.iterdir() if (p / "graph.txt").is_file())


def profile_path(name_or_path: str | Path) -> Path:
    """The graph.txt a `--profile` argument means: a file, a folder holding graph.txt, or the
    name of a shipped profile; anything else raises ProfileError listing the shipped names."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "graph.txt"
    if path.exists():
        return path
    if isinstance(name_or_path, str) and "/" not in name_or_path and "\\" not in name_or_path:
        shipped = SHIPPED / name_or_path / "graph.txt"
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_profiles())
    raise ProfileError(f"cannot read profile {name_or_path!s}: no such file; give a PipeDream "
                       f"graph.txt, a folder holding one, or a shipped profile's name ({names})")


def in_place(description: str) -> bool:
    """Whether a profiled layer writes its output into its input's storage ("ReLU(inplace)",
    "Add(inplace)", as torchvision's models build them): its output is then no new tensor, so it
    keeps nothing for the backward that its input's producer has not kept already (its `keep` is
    0; its `act`, what a stage boundary after it sends, stays). PipeDream's profiles count every
    layer's output once, so without this a conv, BN, ReLU chain counts one tensor twice."""
    head = description.strip().split("(", 1)
    return len(head) == 2 and head[1].split(")", 1)[0].strip() in ("inplace", "inplace=True")


def load_pipedream(path: str | Path) -> nx.DiGraph:
    """Read a PipeDream `graph.txt` (a path, or a shipped profile's name such as "vgg16"); a
    malformed line raises ProfileError with file:line."""
    file = profile_path(path)
    try:
        lines = read_plain_file(file, MAX_PROFILE_BYTES).decode().splitlines()
    except NotPlainFile as why:
        raise ProfileError(refusal(
            why, file, role="profile", limit=MAX_PROFILE_BYTES,
            because="268 times the largest PipeDream profile shipped",
            fix="give a PipeDream graph.txt, a folder holding one, or a shipped profile's "
                "name")) from None
    except OSError as err:
        raise ProfileError(f"cannot read profile {file}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ProfileError(f"profile {file} is not text (byte {err.start} is not UTF-8); give "
                           f"a PipeDream graph.txt, lines like {_NODE_EXAMPLE!r}") from None
    name = file.parent.name if file.name == "graph.txt" else file.stem
    graph = new_cost_graph(name=name)
    edges: list[tuple[str, str, str]] = []
    for number, line in enumerate(lines, start=1):
        where = f"{file}:{number}"
        if not line.strip():
            continue
        if line.startswith("\t") or line.startswith("    "):
            parts = [p.strip() for p in line.strip().split(" -- ")]
            if len(parts) != 2 or not all(parts):
                raise ProfileError(f"{where}: an edge line is '<tab>nodeU -- nodeV', got {line!r}")
            edges.append((parts[0], parts[1], where))
            continue
        head, sep, rest = line.partition(" -- ")
        description, sep2, costs = rest.rpartition(" -- ")
        if not sep or not sep2 or not head.strip():
            raise ProfileError(f"{where}: a node line is like {_NODE_EXAMPLE!r}, got {line!r}")
        values: dict[str, str] = {}
        for item in re.split(r",\s*(?=[a-z_]+=)", costs.strip()):
            key, eq, value = item.partition("=")
            if not eq:
                raise ProfileError(f"{where}: expected key=value, got {item!r}")
            values[key.strip()] = value
        missing = [f for f in _FIELDS if f not in values]
        if missing:
            raise ProfileError(f"{where}: node line lacks {', '.join(missing)}")
        node = head.strip()
        if node in graph:
            raise ProfileError(f"{where}: node {node!r} is defined twice")
        fwd, bwd, act, params = (_number(values[f], where, f) for f in _FIELDS)
        add_block(graph, node, fwd=fwd / 1000.0, bwd=bwd / 1000.0, act=act, params=params,
                  keep=0.0 if in_place(description) else None, label=description.strip())
    for u, v, where in edges:
        for end in (u, v):
            if end not in graph:
                raise ProfileError(f"{where}: edge names {end!r}, which has no node line")
        graph.add_edge(u, v)
    if graph.number_of_nodes() == 0:
        raise ProfileError(f"{file}: no node lines; expected lines like {_NODE_EXAMPLE!r}")
    inputs = [n for n, d in graph.nodes(data=True) if d["label"].startswith("Input")]
    if inputs:
        act = graph.nodes[inputs[0]]["act"]
        graph.graph["input_bytes"] = act
    return graph
