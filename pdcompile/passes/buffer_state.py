"""A buffer the model's forward changes in place keeps its state in one stage.

Every stage holds its own copy of the buffers it reads (passes/split.py), and a buffer's value
carries over from one microbatch to the next: a running mean, a counter, a queue, spectral
norm's power iteration. Values cut from the graph travel between stages; the copies do not. So
a cut that left a changed buffer in several stages trained silently on copies that drifted
apart: a change made in stage 1 to the value stage 0 sent was lost at the end of the
microbatch, and a stage reading its copy before (or without) the change read the buffer as it
was at the start. Nor can a value travel back: a stage that reads the buffer before a later
stage changes it would need, for its next microbatch, the change that the later stage has not
made yet.

`keep_buffer_state_together` moves the nodes that change such a buffer or take the buffer
itself as an argument into one of their stages (the latest where it can, with what depends on
them; else the earliest or one between, with what they depend on): one stage holds the buffer,
and later stages receive the values of its changes as any other value. A cut where every choice
would leave a stage with nothing to run, and any cut that still holds a changed buffer in
several stages (`check_buffer_state`), is refused naming the buffer, the nodes and their stages.
`snapshot_buffer_reads` gives the operations of that stage a copy of the buffer to read, so
that the next microbatch's change leaves what autograd saved of this one's alone, and
`detach_what_changes_buffers` keeps the buffer out of autograd's graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from pdcompile.errors import PlanError
from pdcompile.meta import SHAPE_KEY, TREE_KEY
from pdcompile.passes.inplace import alias_classes, mutated_input
from pdcompile.runtime.grad_mode import detached
from pdcompile.util.attr_path import get_path


@dataclass(frozen=True)
class BufferState:
    """A buffer that forward changes: its attribute reads (`attrs`), the nodes that change it
    (`changes`) and those that take the buffer itself as an argument (`holders`: a stage running
    one holds a copy; a reader after a direct change reads the change instead, through
    make_mutations_explicit, and so may run in a later stage)."""

    target: str
    attrs: tuple[fx.Node, ...]
    changes: tuple[fx.Node, ...]
    holders: tuple[fx.Node, ...]

    def nodes(self) -> tuple[fx.Node, ...]:
        """What must run in one stage."""
        return (*self.attrs, *self.changes, *self.holders)


def changed_buffers(gm: fx.GraphModule) -> list[BufferState]:
    """Every buffer (or tensor constant) that some node of `gm` changes in place, directly or
    through a view."""
    reads: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and _is_state(gm, str(node.target)):
            reads.setdefault(str(node.target), []).append(node)
    mutators: list[tuple[fx.Node, fx.Node]] = []
    for node in gm.graph.nodes:
        changed = mutated_input(node, gm) if node.op != "output" else None
        if changed is not None:
            mutators.append((node, changed))
    if not reads or not mutators:
        return []
    aliases = alias_classes(gm)
    found = []
    for target, attrs in reads.items():
        shared = set().union(*(aliases.get(a, {a}) for a in attrs))
        changes = tuple(n for n, m in mutators if m in shared)
        if changes:
            holders = tuple(dict.fromkeys(u for a in attrs for u in a.users
                                          if u.op != "output"))
            found.append(BufferState(target, tuple(attrs), changes, holders))
    return found


def keep_buffer_state_together(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """Move each changed buffer's nodes into one stage: the latest of theirs, else the earliest,
    else one between, taking along what depends on a node moved later and what a node moved
    earlier depends on (so every value still flows forward). Raises PlanError where each
    choice would leave a stage of the cut with nothing to run."""
    for state in changed_buffers(gm):
        stages = sorted({stage_of[n.name] for n in state.nodes()})
        if len(stages) == 1:
            continue
        busy = _busy(gm, stage_of)
        for target in (stages[-1], stages[0], *range(stages[-2], stages[0], -1)):
            moved = _moved(state, stage_of, target)
            if busy <= _busy(gm, moved):
                stage_of.update(moved)
                break
        else:
            raise PlanError(_message(state, stage_of, f"moving them into any stage from "
                                     f"{stages[0]} to {stages[-1]} would leave another stage "
                                     "with nothing to run"))


def _moved(state: BufferState, stage_of: dict[str, int], target: int) -> dict[str, int]:
    """`stage_of` with the buffer's nodes moved into stage `target`, taking along what a node
    moved later feeds and what a node moved earlier reads, where they lie beyond it."""
    moved = dict(stage_of)
    pending = list(state.nodes())
    while pending:
        node = pending.pop()
        if node.op == "output" or moved[node.name] == target:
            continue
        later = moved[node.name] < target
        moved[node.name] = target
        pending.extend(u for u in (node.users if later else node.all_input_nodes)
                       if u.op != "output" and (moved[u.name] < target) == later
                       and moved[u.name] != target)
    return moved


def buffer_groups(gm: fx.GraphModule) -> list[tuple[str, list[str]]]:
    """The node names that must run in one stage, one group per changed buffer (groups sharing
    a node merged), each with the buffers it keeps: the planner and the straight cut keep each
    group whole (with what lies between its nodes), so that every cut they make keeps a
    buffer's state in one stage instead of being refused by `keep_buffer_state_together`."""
    groups: list[tuple[str, set[str]]] = []
    for state in changed_buffers(gm):
        label, names = repr(state.target), {n.name for n in state.nodes()}
        for other in [g for g in groups if g[1] & names]:
            groups.remove(other)
            label, names = f"{other[0]}, {label}", names | other[1]
        groups.append((label, names))
    return [(label, sorted(names)) for label, names in groups]


def buffers_kept_together(gm: fx.GraphModule, graph: nx.DiGraph) -> list[tuple[str, list[str]]]:
    """`buffer_groups` as groups of the CostGraph `graph` (of `gm`'s trace): each group's nodes
    that the graph has, with every node on a path between two of them (a block the planner can
    fuse, costgraph.grouped), groups that then share a node merged."""
    found: list[tuple[str, set[str]]] = []
    for label, names in buffer_groups(gm):
        hull = convex_hull(graph, {n for n in names if n in graph})
        for other in [g for g in found if g[1] & hull]:
            found.remove(other)
            label, hull = f"{other[0]}, {label}", convex_hull(graph, hull | other[1])
        if len(hull) > 1:
            found.append((label, hull))
    return [(label, sorted(names)) for label, names in found]


def convex_hull(graph: nx.DiGraph, names: set[str]) -> set[str]:
    """`names` with every node of `graph` on a path between two of them."""
    after = set(names).union(*(nx.descendants(graph, n) for n in names))
    before = set(names).union(*(nx.ancestors(graph, n) for n in names))
    return after & before


def snapshot_buffer_reads(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """Each operation of a stage that reads a changed buffer (or a view of it) reads a copy
    taken where it runs. One process runs a microbatch's backward before the next forward
    changes the buffer again; a pipeline runs several forwards first, and autograd refused the
    backward of an operation that had saved the buffer itself (`h * self.scale` after
    `self.scale.mul_(0.9)`: "modified by an inplace operation"). A value sent to a later stage
    is a copy already."""
    changed = False
    shared = alias_classes(gm)
    for state in changed_buffers(gm):
        members = set().union(*(shared.get(a, {a}) for a in state.attrs))
        for node in [n for n in gm.graph.nodes if n in members]:
            for user in list(node.users):
                if user.op == "output" or user in members or \
                        stage_of.get(user.name) != stage_of.get(node.name):
                    continue
                _read_through(gm, user, node, torch.clone, stage_of[node.name], stage_of)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def detach_what_changes_buffers(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """The values an in-place change writes into a buffer are read through `detached`. A stage
    receives every floating-point value as a leaf that takes a gradient, so a value the model
    had detached (`running.mul_(0.9).add_(h.detach().mean(0))`) gave the buffer an autograd
    history when it crossed from another stage, and the next microbatch's backward ran into the
    last one's freed graph. In one process a value that needs a gradient written into a buffer
    fails the same way at the second step, so detaching it changes nothing that trains there."""
    changed = False
    for state in changed_buffers(gm):
        if any(_needs_grad(gm, str(a.target)) for a in state.attrs):
            continue
        for change in state.changes:
            for value in change.all_input_nodes[1:]:
                if value.op in ("get_attr",) or value.target is detached:
                    continue
                _read_through(gm, change, value, detached, stage_of[change.name], stage_of)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _read_through(gm: fx.GraphModule, user: fx.Node, value: fx.Node, fn: Any, stage: int,
                  stage_of: dict[str, int]) -> None:
    """`user` reads `fn(value)`, a node inserted before it on `stage`, instead of `value`."""
    with gm.graph.inserting_before(user):
        through = gm.graph.call_function(fn, (value,))
    through.meta.update({k: v for k, v in value.meta.items() if k in (SHAPE_KEY, TREE_KEY)})
    stage_of[through.name] = stage
    user.replace_input_with(value, through)


def _needs_grad(gm: fx.GraphModule, target: str) -> bool:
    value = get_path(gm, target)
    return isinstance(value, torch.Tensor) and value.requires_grad


def check_buffer_state(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """Raise PlanError where a buffer that forward changes in place would be held, or changed,
    by more than one stage of the cut `stage_of` (node name -> stage)."""
    for state in changed_buffers(gm):
        if len({stage_of[n.name] for n in (*state.changes, *state.holders)}) > 1:
            raise PlanError(_message(state, stage_of, "each stage would keep a copy of its own"))


def _busy(gm: fx.GraphModule, stage_of: dict[str, int]) -> set[int]:
    return {stage_of[n.name] for n in gm.graph.nodes
            if n.op not in ("placeholder", "get_attr", "output")}


def _is_state(gm: fx.GraphModule, target: str) -> bool:
    """A tensor attribute that is no parameter (a buffer, a tensor constant)."""
    try:
        value = get_path(gm, target)
    except AttributeError:
        return False
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _message(state: BufferState, stage_of: dict[str, int], why: str) -> str:
    def where(nodes: tuple[fx.Node, ...]) -> str:
        return ", ".join(f"{n.name!r} (stage {stage_of[n.name]})" for n in nodes)

    readers = tuple(n for n in state.holders if n not in state.changes)
    read = f" and read by {where(readers)}" if readers else ""
    return (f"buffer {state.target!r} is changed in place by {where(state.changes)}{read}; "
            f"its value carries over from one microbatch to the next, so these nodes must run in "
            f"one stage, and {why}: cut so that one stage holds them")


__all__ = ["BufferState", "buffer_groups", "buffers_kept_together", "changed_buffers",
           "check_buffer_state", "convex_hull", "detach_what_changes_buffers",
           "keep_buffer_state_together", "snapshot_buffer_reads"]
