"""In-place operations made explicit in the graph, so that cutting it keeps their meaning.

An fx graph records `x.add_(1)` as a node whose result later code ignores: the code after it
reads the node of `x`, and nothing in the graph says that it must run after the mutation. A
planner that sees only data edges could then put a later reader of `x` in an earlier stage than
the mutation, and a stage that sends `x` would send the mutated value to a reader that ran
before it. `make_mutations_explicit` rewires every reader of `x` that comes after an in-place
node to read the in-place node's result (the same tensor), so the order becomes a data edge the
cost graph and the planner see; `operator.setitem` (`x[i] = v`, which returns None) becomes
`set_item`, which returns `x`. The split pass (passes/split.py) then only has to keep a value a
stage sends unchanged by the stage's later mutations (`snapshot_before_mutations`) and to
mutate a copy of a received value (`copy_mutated_inputs`): a received activation is a leaf
that autograd forbids mutating in place, and on the local backend it shares its storage with
the sender's. Views count: a value sent before a later change of a view of it in its stage is
sent as a copy too (`alias_classes`). A change of a view also changes the values it shares
memory with: their readers after the change read `changed_alias(value, change)`, which returns
the value and runs in the change's stage (passes/split.py), so that a change made in one stage
to a view of a value made in an earlier stage reaches a reader in a third stage (the changing
stage sends its changed copy on).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pdcompile.meta import SHAPE_KEY, TREE_KEY, get_tree

# Python's augmented assignments (in place on tensors, a new object on numbers), each with the
# operation making a new object: what they do on numbers
_OUT_OF_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub,
                 operator.imul: operator.mul, operator.itruediv: operator.truediv,
                 operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
                 operator.ipow: operator.pow, operator.iand: operator.and_,
                 operator.ior: operator.or_, operator.ixor: operator.xor,
                 operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
                 operator.imatmul: operator.matmul}
_AUGMENTED = frozenset(_OUT_OF_PLACE)
# kinds of values (meta.ValueTree.kinds) that an augmented assignment replaces, not changes
_IMMUTABLE = frozenset({"int", "float", "bool", "complex", "size", "SymInt", "SymFloat",
                        "SymBool"})


def set_item(target: Any, index: Any, value: Any) -> Any:
    """`target[index] = value`, returning `target` (so that later readers depend on it)."""
    target[index] = value
    return target


def changed_alias(value: Any, change: Any) -> Any:
    """`value` after `change`, an in-place change of memory it shares (returns `value`): its
    later readers depend on the change through this call, and it runs where the change does."""
    return value


def clone_leaves(value: Any) -> Any:
    """A copy of every tensor of a container (tuple, list, dict), its structure kept: the copy
    taken before an in-place change of memory one of its items shares."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, value)


def _copy_of(graph: fx.Graph, value: fx.Node) -> fx.Node:
    """A node copying `value` (at the graph's insertion point): torch.clone, or `clone_leaves`
    where it is a container (an LSTM's `(out, (h, c))`, whose item `out` a stage changes in
    place), which keeps the container's structure for the split to send it as its leaves."""
    tree = get_tree(value)
    if tree is None or tree.is_leaf:
        return graph.call_function(torch.clone, (value,))
    copy = graph.call_function(clone_leaves, (value,))
    copy.meta.update({k: v for k, v in value.meta.items() if k in (SHAPE_KEY, TREE_KEY)})
    return copy


def is_changed_alias(node: fx.Node) -> bool:
    """Whether `node` is a `changed_alias` call (the split runs it in its change's stage)."""
    return node.op == "call_function" and node.target is changed_alias


def mutated_input(node: fx.Node, root: torch.nn.Module | None = None) -> fx.Node | None:
    """The node whose value `node` changes in place (its first argument), or None.

    In place: methods named `name_` (`x.add_(y)`), functions named so (`torch.relu_`), calls with
    `inplace=True` (`F.relu(x, inplace=True)`, `nn.ReLU(inplace=True)` given `root`), augmented
    assignments on tensors (`x += y`), `x[i] = v` and aten overloads whose schema writes their
    first argument (`aten.add_.Tensor`).
    """
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method":
        return first if _trailing_underscore(str(node.target)) else None
    if node.op == "call_module":
        module = _submodule(root, str(node.target))
        return first if module is not None and getattr(module, "inplace", False) is True else None
    if node.op != "call_function":
        return None
    target = node.target
    if target in _AUGMENTED:
        return first if _is_tensor(first) else None
    if target in (operator.setitem, set_item):
        return first
    if node.kwargs.get("inplace") is True:
        return first
    if isinstance(target, torch._ops.OpOverload):
        arguments = target._schema.arguments
        writes = bool(arguments) and arguments[0].alias_info is not None \
            and arguments[0].alias_info.is_write
        return first if writes else None
    name = getattr(target, "__name__", "")
    return first if _trailing_underscore(name) else None


def _trailing_underscore(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _submodule(root: torch.nn.Module | None, target: str) -> torch.nn.Module | None:
    if root is None:
        return None
    try:
        return root.get_submodule(target)
    except AttributeError:
        return None


def _is_tensor(node: fx.Node) -> bool:
    """Whether the node's value is a tensor (True where the shapes pass has not said)."""
    tree = get_tree(node)
    if tree is not None:
        return tree.is_leaf and tree.kinds == ("tensor",)
    value = node.meta.get("val", node.meta.get("example_value"))
    return value is None or isinstance(value, torch.Tensor)


def make_mutations_explicit(gm: fx.GraphModule) -> bool:
    """Rewire each reader of a value that comes after an in-place change of it to read the
    in-place node, and each later reader of a value sharing its memory (a view's base, another
    view) to read `changed_alias(value, change)`; `x[i] = v` becomes `set_item`. Returns whether
    the graph changed (idempotent: a second call changes nothing)."""
    graph = gm.graph
    changed = _numbers_out_of_place(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    aliases = alias_classes(gm)
    for node in list(graph.nodes):
        mutated = mutated_input(node, gm)
        if mutated is None:
            continue
        if node.target is operator.setitem:
            node.target = set_item
            changed = True
        for user in list(mutated.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(mutated, node)
                changed = True
        for other in sorted(aliases.get(mutated, ()), key=order.__getitem__):
            if other in (mutated, node) or other.op == "get_attr" or order[other] > order[node]:
                continue
            late = [u for u in other.users if u is not node and order[u] > order[node]
                    and not (is_changed_alias(u) and u.args[1] is node)]
            if not late:
                continue
            with graph.inserting_after(node):
                after = graph.call_function(changed_alias, (other, node))
            for user in late:
                user.replace_input_with(other, after)
            order = {n: i for i, n in enumerate(graph.nodes)}
            aliases = alias_classes(gm)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _numbers_out_of_place(graph: fx.Graph) -> bool:
    """`n *= 4` on a number as `operator.mul`: fx writes `operator.imul` as `n *= 4;  imul = n`,
    which rebinds `n` in the generated code, so a later reader of the old number (timm's Hiera
    reads its batch size again after `B *= 4`; a stage returns it after the change) read the
    new one. Returns whether a node changed."""
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _OUT_OF_PLACE or not node.args:
            continue
        first = node.args[0]
        tree = get_tree(first) if isinstance(first, fx.Node) else None
        if isinstance(first, fx.Node) and tree is not None and tree.is_leaf \
                and tree.kinds[0] in _IMMUTABLE:
            node.target = _OUT_OF_PLACE[node.target]
            changed = True
    return changed


# operations whose result may share memory with their first argument (an in-place change of
# one shows in the other): views, `contiguous`, items of `split`
_VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "narrow", "select",
    "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "split", "chunk",
    "unbind", "split_with_sizes", "tensor_split", "movedim", "moveaxis", "swapaxes", "swapdims",
    "diagonal", "unfold", "as_strided", "detach", "contiguous", "getitem", "T", "mT", "H",
    "real", "imag", "view_as_real", "view_as_complex", "alias", "slice", "_unsafe_view",
    "changed_alias", "detached"})


def may_alias(node: fx.Node, root: torch.nn.Module) -> bool:
    """Whether `node`'s value may share memory with its first argument."""
    if mutated_input(node, root) is not None:
        return True  # an in-place operation returns the tensor it changed
    if node.op == "call_module":
        return isinstance(_submodule(root, str(node.target)), torch.nn.Identity)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in target._schema.returns)
    name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
    return name in _VIEWS


def alias_classes(gm: fx.GraphModule) -> dict[fx.Node, frozenset[fx.Node]]:
    """For every node, the nodes whose values may share its memory (views of one another)."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(node: fx.Node) -> fx.Node:
        while parent.get(node, node) is not node:
            node = parent[node]
        return node

    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if isinstance(first, fx.Node) and may_alias(node, gm):
            parent[find(node)] = find(first)
    groups: dict[fx.Node, set[fx.Node]] = {}
    for node in gm.graph.nodes:
        groups.setdefault(find(node), set()).add(node)
    return {node: frozenset(groups[find(node)]) for node in gm.graph.nodes}


def snapshot_before_mutations(gm: fx.GraphModule, stage_of: dict[str, int],
                              stage: Callable[[fx.Node], int]) -> None:
    """A value read by a later stage before a mutation in its own stage (of it or of a view
    sharing its memory) is sent as a copy taken before the mutation: a stage sends its values
    when its forward ends."""
    graph = gm.graph
    mutators = [n for n in graph.nodes if mutated_input(n, gm) is not None]
    if not mutators:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    aliases = alias_classes(gm)
    for node in mutators:
        home = stage_of[node.name]
        mutated = mutated_input(node, gm)
        assert mutated is not None
        for value in sorted(aliases.get(mutated, {mutated}), key=order.__getitem__):
            if value.op in ("placeholder", "get_attr") or stage_of.get(value.name) != home \
                    or order[value] >= order[node]:
                continue  # received values are copied first (copy_mutated_inputs)
            early = [u for u in value.users if order.get(u, -1) < order[node]
                     and u.op != "output" and stage(u) > home]
            if not early:
                continue
            with graph.inserting_after(value):
                copy = _copy_of(graph, value)
            stage_of[copy.name] = home
            for user in early:
                user.replace_input_with(value, copy)
            order = {n: i for i, n in enumerate(graph.nodes)}
    graph.lint()
    gm.recompile()


def copy_mutated_inputs(sub: fx.GraphModule) -> None:
    """A stage module mutates copies of the values it receives, never the received tensors."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    aliases = alias_classes(sub)
    changed: set[fx.Node] = set()
    for node in list(sub.graph.nodes):
        mutated = mutated_input(node, sub)
        if mutated is None:
            continue
        for received in aliases.get(mutated, {mutated}):  # it, or the value it is a view of
            if received.op != "placeholder" or received in changed:
                continue
            with sub.graph.inserting_after(placeholders[-1]):
                copy = _copy_of(sub.graph, received)
            for user in list(received.users):
                if user is not copy:
                    user.replace_input_with(received, copy)
            changed.add(received)
    if changed:
        sub.graph.lint()
        sub.recompile()


__all__ = ["alias_classes", "changed_alias", "clone_leaves", "copy_mutated_inputs",
           "is_changed_alias", "make_mutations_explicit", "may_alias", "mutated_input",
           "snapshot_before_mutations", "set_item"]
