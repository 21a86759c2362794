"""Split: one `torch.fx.GraphModule` per pipeline stage, cut from the traced graph by a Plan.

The cutting itself is `torch.fx.passes.split_module` (the Plan's decision is the callback); this
pass only reads its result and records, for every stage, what each input placeholder is (a model
input read from the data, or a value another stage sends), which values it sends to which stage
(skip connections go straight from producer to consumer, never relayed), which parameters it
shares with other stages (tied embeddings: `ties`) and the original name of each parameter and
buffer. Parameters that the traced graph reads with `get_attr` (e.g. a tied embedding used in
`F.linear`) are moved into the stage that reads them, so that every stage owns its weights.
Each stage module is a deep copy: stages do not share tensors with each other or with the model.
Buffers the model registered with `persistent=False` stay out of the stages' state dicts too.

Any assignment of nodes to stages that follows a topological order splits. The graph is
reordered stage by stage first (split_module emits stages in the order of their first nodes and
failed where they interleave); a tuple's items are read in the stage that makes it; constants
(input-less operations such as torch.export's `arange`, and what is made of them alone) go with
their users, each later stage computing its own copy; in-place operations keep their meaning
across stages (passes/inplace.py); a buffer that forward changes in place keeps its state in one
stage (passes/buffer_state.py: the nodes that change it and read it before are moved into the
latest of their stages). A split_module failure that slips through all this is a PlanError
naming the node and its stages, never a KeyError.

Only tensors, numbers and sizes can travel between stages. Where the shapes pass has run, the
split checks every value a stage would send before anything runs: a structured value (a
Hugging Face ModelOutput, any container registered with torch's pytree) is sent as its leaves
and rebuilt by the receiver (`passes/crossing.py`); a value that cannot travel at all is a
PlanError naming it and the stages.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

from pdcompile.errors import PlanError
from pdcompile.meta import get_output_spec, get_tree, has_stage, set_stage
from pdcompile.passes.buffer_state import (
    buffer_groups,
    check_buffer_state,
    detach_what_changes_buffers,
    keep_buffer_state_together,
    snapshot_buffer_reads,
)
from pdcompile.passes.crossing import flatten_value, rebuild_value, spec_text
from pdcompile.passes.inplace import (
    changed_alias,
    copy_mutated_inputs,
    is_changed_alias,
    make_mutations_explicit,
    may_alias,
    mutated_input,
    snapshot_before_mutations,
)
from pdcompile.passes.output_constants import constants_from_last_stage
from pdcompile.passes.parameter_changes import check_parameter_changes
from pdcompile.plan import Plan, Stage
from pdcompile.runtime.grad_mode import detached
from pdcompile.util.attr_path import get_path
from pdcompile.util.module_copy import copy_module

# kinds of values (meta.ValueTree.kinds) that can travel between stages; None leaves of a
# structure are not sent (the receiver puts None back); a dtype travels as a number, a device
# arrives as the receiver's own (runtime/stage_runtime.py, _encode)
_CROSSING_KINDS = frozenset({"tensor", "int", "float", "bool", "size", "NoneType", "dtype",
                             "device"})


@dataclass(frozen=True)
class ValueRef:
    """Where a value comes from: a model input (`stage` is None) or an output of `stage`."""

    name: str
    stage: int | None = None

    @property
    def is_data(self) -> bool:
        """True for a model input (read from the data, not received from a stage)."""
        return self.stage is None


@dataclass
class StageProgram:
    """One stage: its module, where each of its inputs comes from and where its outputs go.

    `inputs[i]` feeds the module's i-th placeholder; `outputs` are the names of the values its
    forward returns (a tuple, in this order); `receives[src]` / `sends[dst]` are the value names
    exchanged with another stage, in message order; `param_names[name]` and `buffer_names[name]`
    give the model's qualified names of each of the module's parameters and buffers; `kinds`
    names the exchanged values that are not tensors (e.g. the int of `x.size(1)`), which travel
    as 0-d tensors (filled in by Pipeline from an example run); `transient_buffers` names the
    module's buffers that the model registered with `persistent=False` (GPT-2's causal mask,
    BERT's position ids): like PyTorch, state dicts leave them out.
    """

    index: int
    module: fx.GraphModule
    inputs: tuple[ValueRef, ...]
    outputs: tuple[str, ...]
    receives: dict[int, tuple[str, ...]] = field(default_factory=dict)
    sends: dict[int, tuple[str, ...]] = field(default_factory=dict)
    param_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    buffer_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # exchanged non-tensors: "int", "size"...
    # buffers the model registered with persistent=False: not in state dicts, kept by exports
    transient_buffers: tuple[str, ...] = ()

    @property
    def data_inputs(self) -> tuple[str, ...]:
        """The model inputs this stage reads from the data."""
        return tuple(ref.name for ref in self.inputs if ref.is_data)


@dataclass(frozen=True)
class TiedParameter:
    """One parameter of the model held by several stages: `members` are (stage, name in stage)."""

    name: str
    members: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages holding a copy, ascending."""
        return tuple(sorted({s for s, _ in self.members}))


@dataclass
class SplitResult:
    """All stages plus the model's inputs, its output structure and the tied parameters.

    `unused`: the model's parameters and persistent buffers that no stage holds (its forward
    never reads them: a head kept for another task, a layer left in the model), under their
    names. No step changes them, as in one process (they get no gradient); they are kept so
    that the pipeline's state_dict is the model's, which `load_state_dict` accepts strictly.
    """

    stages: list[StageProgram]
    data_inputs: tuple[str, ...]
    output_refs: tuple[ValueRef, ...]
    output_spec: pytree.TreeSpec
    ties: tuple[TiedParameter, ...] = ()
    unused: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Stage edges (src, dst), src < dst, sorted; a skip connection is its own edge."""
        return sorted({(s.index, dst) for s in self.stages for dst in s.sends})


def assign_stages(gm: fx.GraphModule, plan: Plan) -> dict[str, int]:
    """Stage of every fx node (output excluded), written to node.meta["pd.stage"].

    Nodes the Plan does not list (attribute reads, nodes of a coarsened plan's gaps) follow the
    first stage that uses them, or, without users, the last stage of their inputs. Raises
    PlanError when a value would flow from a later stage back to an earlier one.
    """
    given = plan.stage_of()
    stage_of: dict[str, int] = {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    check_plan_nodes(gm, plan)
    for node in nodes:
        if node.name in given:
            stage_of[node.name] = given[node.name]
        elif node.op != "get_attr" and node.all_input_nodes:
            stage_of[node.name] = max(stage_of.get(p.name, 0) for p in node.all_input_nodes)
    for node in reversed(nodes):
        if node.name not in stage_of:
            users = [stage_of[u.name] for u in node.users if u.name in stage_of]
            stage_of[node.name] = min(users) if users else 0
    keep_buffer_state_together(gm, stage_of)  # a changed buffer's state in one stage
    # a tuple's items are read where it is made, and input-less operations (arange, zeros) run
    # where they are used, unless that leaves their stage with nothing to run: then the tuple
    # crosses as its leaves (_send_leaves) and the constant is sent
    items = [n for n in nodes if n.op == "call_function" and n.args
             and isinstance(n.args[0], fx.Node) and _reads_item(n)]
    constants = _constants(nodes)
    changes = [n for n in nodes if is_changed_alias(n)]
    movable = {n.name for n in items} | constants | {n.name for n in changes}
    busy = {stage_of[n.name] for n in nodes
            if n.op not in ("placeholder", "get_attr") and n.name not in movable}
    for node in items:  # where the tuple is made, or where its index is, if that is later
        if stage_of[node.name] in busy:  # (`w[rows]` with rows computed after w)
            made = max(stage_of[p.name] for p in node.all_input_nodes)
            stage_of[node.name] = min(stage_of[node.name], made)
    _detach_where_made(gm, [n for n in items if n.target is detached], stage_of)
    _constants_follow_users(nodes, stage_of, len(plan.stages) - 1, constants, busy)
    _views_where_changed(gm, stage_of)
    _changes_where_made(gm, changes, stage_of, busy)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]  # with what that added
    for node in nodes:
        for user in node.users:
            if user.op == "output" or node.op == "get_attr":
                continue
            if stage_of[user.name] < stage_of[node.name]:
                raise PlanError(_out_of_order(user, node, stage_of))
    check_buffer_state(gm, stage_of)
    check_parameter_changes(gm, stage_of, plan)
    for node in nodes:
        set_stage(node, stage_of[node.name])
    last = len(plan.stages) - 1
    for node in gm.graph.nodes:
        if node.op == "output":
            set_stage(node, last)
    return stage_of


def _views_where_changed(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """An in-place change of a view made in an earlier stage changes a view of its own: the
    views from the base value up are made again in the change's stage, so that the change
    reaches the base's copy there (a view that crosses between stages arrives as a tensor of
    its own, no longer sharing the base's memory); so are the views of that base that the
    change's `changed_alias` nodes hand on. Items of tuples (`getitem`) count as bases."""
    for node in [n for n in gm.graph.nodes if n.op != "output"]:
        mutated = mutated_input(node, gm)
        if mutated is None:
            continue
        home = stage_of[node.name]
        chain, base = _earlier_views(mutated, home, gm, stage_of)
        if not chain:
            continue
        made: dict[fx.Node, fx.Node] = {}

        def again(views: list[fx.Node], before: fx.Node, made: dict[fx.Node, fx.Node] = made,
                  home: int = home) -> None:
            with gm.graph.inserting_before(before):
                for view in reversed(views):  # from the base up
                    if view not in made:
                        made[view] = gm.graph.node_copy(view, lambda a: made.get(a, a))
                        stage_of[made[view].name] = home

        again(chain, node)
        node.replace_input_with(mutated, made[mutated])
        _erase_unused(chain, gm, stage_of, home)
        for user in list(node.users):  # what the change hands on, taken from the views here
            if not is_changed_alias(user) or user.args[1] is not node:
                continue
            other = user.args[0]
            assert isinstance(other, fx.Node)
            views, root = _earlier_views(other, home, gm, stage_of, later=True)
            if views and root is base:
                again(views, user)
                user.replace_input_with(other, made[other])


def _erase_unused(views: list[fx.Node], gm: fx.GraphModule, stage_of: dict[str, int],
                  home: int) -> None:
    """Views of the change's stage made again there whose originals nothing reads any more:
    they would still read the earlier stage's view, which would cross for nothing (those of
    other stages stay, so that no stage is left without an operation)."""
    for view in views:  # from the changed view down to the base
        if not view.users and stage_of.get(view.name) == home:
            gm.graph.erase_node(view)


def _earlier_views(value: fx.Node, home: int, gm: fx.GraphModule, stage_of: dict[str, int],
                   *, later: bool = False) -> tuple[list[fx.Node], fx.Node]:
    """The views from which `value` is made (it first), where one of them is made before stage
    `home` (`later`: or after it; none otherwise), and the value they view: up to a value that
    is not a view (an in-place change, a changed value, a tuple's item, a module's output)."""
    chain: list[fx.Node] = []
    while value.op in ("call_function", "call_method") \
            and (stage_of.get(value.name, home) <= home or later) \
            and mutated_input(value, gm) is None \
            and not is_changed_alias(value) and value.target is not operator.getitem \
            and may_alias(value, gm) and isinstance(value.args[0], fx.Node):
        chain.append(value)
        value = value.args[0]
    # views made in the change's stage are made again with the others only where the chain
    # crosses from another stage (a view there of a view made earlier: `x[:][:, 1].copy_()`)
    if all(stage_of.get(v.name, home) == home for v in chain):
        return [], value
    return chain, value


def _out_of_order(user: fx.Node, node: fx.Node, stage_of: dict[str, int]) -> str:
    """Why a stage would read a value from a later one, in the names of the graph the user cut
    (a `changed_alias` is the pass's own: it names the in-place change it stands for)."""
    if is_changed_alias(node) and isinstance(node.args[1], fx.Node):
        value, change = node.args[0], node.args[1]
        name = value.name if isinstance(value, fx.Node) else repr(value)
        return (f"node {user.name!r} (stage {stage_of[user.name]}) reads {name!r} after "
                f"{change.name!r} (stage {stage_of[change.name]}) changed memory it shares in "
                f"place, so it must run in that stage or later; put {user.name!r} in stage "
                f"{stage_of[change.name]} or later, or {change.name!r} earlier")
    return (f"node {user.name!r} (stage {stage_of[user.name]}) uses {node.name!r} from the "
            f"later stage {stage_of[node.name]}; stages must follow the graph's order "
            "(put both in one stage, or cut later)")


def _changes_where_made(gm: fx.GraphModule, changes: list[fx.Node], stage_of: dict[str, int],
                        busy: set[int]) -> None:
    """A value after an in-place change of memory it shares (`changed_alias`) is taken in the
    change's stage, which holds the changed copy; a stage that would be left with nothing to run
    keeps a `changed_alias` of that copy, received from the change's stage."""
    for node in changes:
        change = node.args[1]
        assert isinstance(change, fx.Node)
        home = stage_of[change.name]
        other = node.args[0]
        assert isinstance(other, fx.Node)
        if stage_of.get(other.name, 0) > home:
            continue  # made after the change's stage from another value: it stays after that
        if stage_of[node.name] == home or stage_of[node.name] in busy:
            stage_of[node.name] = home
            continue
        with gm.graph.inserting_before(node):
            taken = gm.graph.call_function(changed_alias, node.args)
        stage_of[taken.name] = home
        node.args = (taken, taken)


def _detach_where_made(gm: fx.GraphModule, cuts: list[fx.Node], stage_of: dict[str, int]) -> None:
    """A `detached` left in a later stage than its value (its own stage had nothing else to
    run) reads a copy detached where the value is made, so that what crosses needs no gradient:
    sent as it was, it would come back with a zero gradient and run a backward that eager mode
    never runs (through a module called under the model's `no_grad`, whose saved input a later
    in-place change may have moved on)."""
    for node in cuts:
        source = node.args[0]
        if not isinstance(source, fx.Node) or source.op in ("placeholder", "get_attr") \
                or stage_of[node.name] <= stage_of[source.name]:
            continue
        with gm.graph.inserting_after(source):
            early = gm.graph.call_function(detached, (source,))
        stage_of[early.name] = stage_of[source.name]
        node.replace_input_with(source, early)


def _constants(nodes: list[fx.Node]) -> set[str]:
    """Operations computed from no input at all: `torch.arange(6)`, `torch.zeros(2, 3)` (input-
    less under torch.export) and what is computed from them alone (`arange(6).unsqueeze(0)`)."""
    found: set[str] = set()
    for node in nodes:
        tree = get_tree(node)
        if node.op in ("call_function", "call_method") \
                and all(p.name in found for p in node.all_input_nodes) \
                and (node.all_input_nodes or node.op == "call_function") \
                and (tree is None or tree.kinds == ("tensor",)) \
                and node.target not in _GLOBAL_STATE:
            found.add(node.name)
    return found


# calls without inputs that set the state of what follows them, not values
_GLOBAL_STATE = (torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast)


def _constants_follow_users(nodes: list[fx.Node], stage_of: dict[str, int], last: int,
                            constants: set[str], busy: set[int]) -> None:
    """Move each constant of a `busy` stage (one with other operations to run) to the first
    stage that uses it (`_copy_constants` gives later users their own copy)."""
    for node in reversed(nodes):
        if node.name not in constants or stage_of[node.name] not in busy:
            continue
        users = [last if u.op == "output" else stage_of[u.name] for u in node.users]
        if users:
            stage_of[node.name] = min(users)


def _copy_constants(gm: fx.GraphModule, stage_of: dict[str, int], constants: set[str]) -> None:
    """Each later stage that uses a constant computes its own copy of it (and of the constants
    it is made of) rather than receiving it, where a copy equals it: no random draw, no
    in-place change."""
    graph = gm.graph
    repeatable = {n.name for n in graph.nodes if n.name in constants and _repeatable(n, gm)}
    copies: dict[tuple[str, int], fx.Node] = {}

    def copy_in(node: fx.Node, stage: int, before: fx.Node) -> fx.Node:
        if stage_of[node.name] == stage:
            return node
        key = (node.name, stage)
        if key not in copies:
            inputs = {p: copy_in(p, stage, before) for p in node.all_input_nodes}
            with graph.inserting_before(before):
                copies[key] = graph.node_copy(node, lambda p: inputs[p])
            stage_of[copies[key].name] = stage
        return copies[key]

    for user in list(graph.nodes):
        if user.op in ("output", "placeholder", "get_attr"):
            continue
        for node in user.all_input_nodes:
            if node.name in repeatable and stage_of[node.name] < stage_of[user.name]:
                user.replace_input_with(node, copy_in(node, stage_of[user.name], user))
    graph.lint()
    gm.recompile()


# operations that draw random numbers or leave memory unset: two copies would differ
_UNREPEATABLE = ("rand", "normal", "bernoulli", "poisson", "multinomial", "dropout", "empty",
                 "uniform", "exponential", "geometric", "cauchy", "log_normal")


def _repeatable(node: fx.Node, gm: fx.GraphModule) -> bool:
    name = str(getattr(node.target, "__name__", node.target)).lower()
    if any(word in name for word in _UNREPEATABLE) or mutated_input(node, gm) is not None:
        return False
    return all(mutated_input(user, gm) is not node for user in node.users)


def _order_by_stage(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """Reorder the graph stage by stage (graph order inside a stage).

    split_module emits the stages in the order their first nodes appear and reads each stage's
    inputs from those emitted before it: where a later stage's node came first (a topological
    order that interleaves stages, e.g. GNMT's encoder layer in stage 2 traced before its
    decoder embedding in stage 1), it looked up a value no stage had produced yet (KeyError).
    Every edge goes from a stage to the same or a later one, so this order is topological too.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    front = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    index = {n: i for i, n in enumerate(body)}
    body.sort(key=lambda n: (stage_of[n.name], index[n]))
    if [n for n in nodes if n.op not in ("output",)] == front + body:
        return
    anchor = next(n for n in nodes if n.op == "output")
    for node in reversed(front + body):
        anchor.prepend(node)
        anchor = node
    graph.lint()
    gm.recompile()


def _reads_item(node: fx.Node) -> bool:
    """`x[i]` of any value, or `x.field` of a structured value (a ModelOutput's field), or `x`
    cut off from autograd where the model's `no_grad` began or a module called under it ended
    (`runtime.grad_mode.detached`: made where `x` is, what crosses needs no gradient)."""
    if node.target is operator.getitem or node.target is detached:
        return True
    if node.target is getattr:
        tree = get_tree(node.args[0])  # type: ignore[arg-type]
        return tree is not None and not tree.is_leaf
    return False


def manual_plan(gm: fx.GraphModule, assignment: Mapping[str, int] | Callable[[fx.Node], int],
                *, replicas: Sequence[int] | None = None) -> Plan:
    """A Plan from an explicit node -> stage assignment (for tests and hand-made pipelines).

    `assignment` maps node names (missing ones follow their inputs) or is a function of the node.
    `replicas[s]` workers run stage s (default 1); ranks are numbered stage after stage.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    stage_of: dict[str, int] = {}
    for node in nodes:
        if callable(assignment):
            stage_of[node.name] = int(assignment(node))
        elif node.name in assignment:
            stage_of[node.name] = int(assignment[node.name])
        else:
            stage_of[node.name] = max((stage_of.get(p.name, 0) for p in node.all_input_nodes),
                                      default=0)
    count = max(stage_of.values(), default=0) + 1
    return _plan_from(stage_of, count, replicas)


def even_plan(gm: fx.GraphModule, stages: int, *,
              replicas: Sequence[int] | None = None) -> Plan:
    """A straight cut of the graph's topological order into `stages` contiguous pieces of about
    equal weight (parameters of the node's module plus one per node); inputs go to stage 0.

    A cut that falls inside a numbered block (a transformer layer such as `encoder.layer.3`)
    moves to the nearest boundary between blocks, if one lies within a quarter of a stage's
    weight, so that whole layers land on each side.
    """
    if stages < 1:
        raise PlanError(f"stages must be a positive integer ({stages} < 1)")
    # an item of a tuple is read where the tuple is made (assign_stages), so it is no operation
    # a cut may fall before
    items = {n for n in gm.graph.nodes if n.op == "call_function" and n.args
             and isinstance(n.args[0], fx.Node) and _reads_item(n)}
    body = [n for n in gm.graph.nodes
            if n.op not in ("output", "get_attr", "placeholder") and n not in items]
    tied, kept = _tied_to_previous(gm, body)  # a changed buffer's nodes stay in one stage
    units = len(body) - len(tied)
    if units < stages:
        together = f", {len(tied)} of them kept with others in one stage (the nodes that " \
            f"change or read buffer {kept}, whose value carries over between microbatches)" \
            if tied else ""
        raise PlanError(f"the model has {len(body)} operations{together}, too few for {stages} "
                        f"stages; use at most {units} stages")
    read = _attribute_params(gm, body)
    weights = [1.0 + _node_params(gm, n) + read.get(n.name, 0.0) for n in body]
    total = sum(weights)
    stage_of = {n.name: 0 for n in gm.graph.nodes if n.op == "placeholder"}
    done = 0.0
    left = units + 1
    for index, (node, weight) in enumerate(zip(body, weights, strict=True)):
        previous = stage_of[body[index - 1].name] if index else -1
        done += weight
        if index in tied:
            stage_of[node.name] = previous
            continue
        left -= 1  # units from this one on: keep at least one for every stage still to come
        stage = min(stages - 1, int((done - weight / 2) / total * stages))
        stage = max(stage, stages - left)
        stage = min(max(stage, previous), previous + 1)  # the first operation runs on stage 0
        stage_of[node.name] = stage
    _snap_to_blocks(body, weights, stage_of, total / stages / 4, tied)
    current, ordered = 0, {}
    for node in gm.graph.nodes:  # an item goes with the operation before it (its tuple, or an
        # in-place change of the value it reads, which `make_mutations_explicit` makes its input)
        if node in items:
            ordered[node.name] = current
        elif node.name in stage_of:
            current = ordered[node.name] = stage_of[node.name]
    return _plan_from(ordered, stages, replicas)


def layer_block(node: fx.Node) -> str | None:
    """The numbered block a node belongs to ("bert.encoder.layer.3"), from the module it was
    traced in (fx and torch.export record `nn_module_stack`) or the module it calls."""
    stack = node.meta.get("nn_module_stack")
    path = str(list(stack.values())[-1][0]) if stack else \
        str(node.target) if node.op == "call_module" else ""
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part.isdigit() and index:
            return ".".join(parts[: index + 1])
    return None


def _tied_to_previous(gm: fx.GraphModule, body: list[fx.Node]) -> tuple[set[int], str]:
    """The positions in `body` whose node must run in the stage of the node before it: those
    from the first to the last node of a changed buffer's group (buffer_state.buffer_groups),
    and the buffers that ties them, for messages."""
    position = {n.name: i for i, n in enumerate(body)}
    tied: set[int] = set()
    labels = []
    for label, names in buffer_groups(gm):
        spots = [position[name] for name in names if name in position]
        if len(spots) > 1:
            tied.update(range(min(spots) + 1, max(spots) + 1))
            labels.append(label)
    return tied, ", ".join(labels)


def _snap_to_blocks(body: list[fx.Node], weights: list[float], stage_of: dict[str, int],
                    reach: float, tied: set[int]) -> None:
    """Move each cut of a straight plan to the nearest block boundary within `reach` (never to
    a position `tied` to the node before it)."""
    blocks = [layer_block(n) for n in body]
    done = [0.0]
    for weight in weights:
        done.append(done[-1] + weight)
    firsts = [i for i in range(1, len(body))
              if stage_of[body[i].name] != stage_of[body[i - 1].name]]
    for k, first in enumerate(firsts):
        if blocks[first] is None or blocks[first] != blocks[first - 1]:
            continue  # not inside a block
        low = firsts[k - 1] + 1 if k else 1
        high = firsts[k + 1] - 1 if k + 1 < len(firsts) else len(body) - 1
        candidates = [j for j in range(low, high + 1) if blocks[j] != blocks[j - 1]
                      and j not in tied
                      and (blocks[j] is not None or blocks[j - 1] is not None)
                      and abs(done[j] - done[first]) <= reach]
        if not candidates:
            continue
        best = min(candidates, key=lambda j: abs(done[j] - done[first]))
        stage = stage_of[body[first].name]
        for j in range(min(best, first), max(best, first)):
            stage_of[body[j].name] = stage if best < first else stage - 1
        firsts[k] = best


def _node_params(gm: fx.GraphModule, node: fx.Node) -> float:
    if node.op == "call_module":
        return float(sum(p.numel() for p in gm.get_submodule(str(node.target)).parameters()))
    return 0.0


def _attribute_params(gm: fx.GraphModule, body: list[fx.Node]) -> dict[str, float]:
    """Parameter counts of the parameters read with `get_attr` (graphs from torch.export),
    each given to the first operation that uses it."""
    order = {n.name: i for i, n in enumerate(body)}
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not _is_param(gm, str(node.target)):
            continue
        users = [u for u in node.users if u.name in order]
        if users:
            first = min(users, key=lambda u: order[u.name]).name
            out[first] = out.get(first, 0.0) + gm.get_parameter(str(node.target)).numel()
    return out


def _plan_from(stage_of: dict[str, int], count: int, replicas: Sequence[int] | None) -> Plan:
    replicas = list(replicas) if replicas is not None else [1] * count
    if len(replicas) != count or any(r < 1 for r in replicas):
        raise PlanError(f"replicas must give a positive worker count for each of the {count} "
                        f"stages, got {replicas}")
    stages, rank = [], 0
    for s in range(count):
        nodes = tuple(name for name, st in stage_of.items() if st == s)
        stages.append(Stage(nodes=nodes, replicas=replicas[s],
                            ranks=tuple(range(rank, rank + replicas[s]))))
        rank += replicas[s]
    return Plan(stages=tuple(stages), time_per_minibatch=0.0, dp_time=0.0, workers=rank,
                planner="manual", status="GIVEN")


def check_plan_nodes(gm: fx.GraphModule, plan: Plan) -> None:
    """Raise PlanError when `plan` names nodes `gm` does not have (a plan of another model)."""
    known = {n.name for n in gm.graph.nodes if n.op != "output"}
    foreign = [name for name in plan.stage_of() if name not in known]
    if foreign:
        raise PlanError(f"the plan names nodes the traced graph does not have: {foreign[:5]}; "
                        "plan the cost graph of this model (to_cost_graph of the same trace)")


def split(gm: fx.GraphModule, plan: Plan, *, model: torch.nn.Module | None = None) -> SplitResult:
    """Cut `gm` into the Plan's stages (see the module docstring); annotates "pd.stage".

    `model` is the module `gm` was traced from (default `gm`), used to name parameters and to
    find parameters shared between stages.
    """
    root = model if model is not None else gm
    make_mutations_explicit(gm)
    stage_of = assign_stages(gm, plan)
    count = len(plan.stages)
    last = count - 1
    used = {stage_of[n.name] for n in gm.graph.nodes
            if n.op not in ("placeholder", "get_attr", "output")}
    empty = [s for s in range(count) if s not in used]
    if empty:
        raise PlanError(f"stages {empty} of the plan have no operation to run; use fewer stages "
                        f"(at most {len(used)}) or move operations into them")
    _copy_constants(gm, stage_of, _constants(list(gm.graph.nodes)))
    constants_from_last_stage(gm, stage_of, last)  # a None (or number) the model returns
    snapshot_buffer_reads(gm, stage_of)
    detach_what_changes_buffers(gm, stage_of)
    snapshot_before_mutations(
        gm, stage_of, lambda user: last if user.op == "output" else stage_of[user.name])
    _send_leaves(gm, stage_of, last)
    _order_by_stage(gm, stage_of)
    for node in gm.graph.nodes:
        set_stage(node, last if node.op == "output" else stage_of[node.name])

    def callback(node: fx.Node) -> int:
        return stage_of[node.name]

    try:
        top = split_in_tuples(gm, callback)
    except KeyError as err:  # a value split_module looked up before any stage made it
        raise PlanError(_unsplittable(gm, str(err.args[0]) if err.args else "?", stage_of)) \
            from None
    data_inputs = tuple(n.name for n in top.graph.nodes if n.op == "placeholder")
    outputs_of: dict[str, tuple[int, tuple[str, ...]]] = {}  # submod node name -> stage, outputs
    getitem_of: dict[str, ValueRef] = {}
    programs: dict[int, StageProgram] = {}
    claimed: set[str] = set(data_inputs)  # names of values some stage sends, or inputs
    for node in top.graph.nodes:
        if node.op == "call_module":
            index = int(str(node.target).rsplit("_", 1)[1])
            sub = top.get_submodule(str(node.target))
            assert isinstance(sub, fx.GraphModule)
            inputs = _stage_inputs(sub, node, getitem_of, gm)
            copy_mutated_inputs(sub)
            out_node = next(n for n in sub.graph.nodes if n.op == "output")
            names = _unique_outputs(sub, out_node, claimed)
            claimed.update(names)
            outputs_of[node.name] = (index, names)
            programs[index] = StageProgram(index, sub, inputs, names)
        elif node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) \
                and node.args[0].name in outputs_of:
            index, names = outputs_of[node.args[0].name]
            getitem_of[node.name] = ValueRef(names[int(node.args[1])], index)  # type: ignore[arg-type]
    out_node = next(n for n in top.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(_plain_containers(out_node.args[0]))
    recorded = get_output_spec(gm)  # the model's own output structure of a flattened output
    if recorded is not None and recorded.num_leaves == len(leaves):
        spec = recorded
    output_refs = tuple(_ref_of(leaf, getitem_of) for leaf in leaves)
    stages = [programs[s] for s in range(count)]
    for program in stages:
        for ref in program.inputs:
            if not ref.is_data:
                _link(stages, ref, program.index)
    for ref in output_refs:
        if not ref.is_data and ref.stage != last:
            _link(stages, ref, last)
    ties = _name_and_copy(stages, root)
    return SplitResult(stages, data_inputs, output_refs, spec, ties, _unused(stages, root))


def split_in_tuples(gm: fx.GraphModule, callback: Callable[[fx.Node], int], *,
                    native: bool | None = None) -> fx.GraphModule:
    """`split_module` with every stage returning a tuple, one-output stages too (what its
    `tuple_return=True` does since torch 2.12; `native` None: use it where torch has it).

    Before 2.12 a one-output stage returns its value bare and the top graph uses the call
    itself; here its output is wrapped and the top graph reads item 0, the same shape."""
    if native is None:
        native = "tuple_return" in inspect.signature(split_module).parameters
    if native:
        return split_module(gm, gm, callback, keep_original_order=True, tuple_return=True)
    top = split_module(gm, gm, callback, keep_original_order=True)
    for node in list(top.graph.nodes):
        if node.op != "call_module":
            continue
        sub = top.get_submodule(str(node.target))
        assert isinstance(sub, fx.GraphModule)
        out = next(n for n in sub.graph.nodes if n.op == "output")
        if isinstance(out.args[0], tuple):
            continue
        out.args = ((out.args[0],),)
        sub.recompile()
        with top.graph.inserting_after(node):
            item = top.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item)
    top.recompile()
    return top


def _unused(stages: list[StageProgram], root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state of `root` (parameters, persistent buffers) that no stage holds, detached."""
    held = {original for program in stages
            for names in (*program.param_names.values(), *program.buffer_names.values())
            for original in names}
    return {name: value.detach() for name, value in root.state_dict(keep_vars=True).items()
            if name not in held and isinstance(value, torch.Tensor)}


def _unsplittable(gm: fx.GraphModule, name: str, stage_of: dict[str, int]) -> str:
    """The message for a plan torch.fx's split_module could not cut at value `name`."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    users = sorted({stage_of.get(u.name, -1) for u in node.users}) if node is not None else []
    return (f"node {name!r} (stage {stage_of.get(name, '?')}, used by stages {users}) could not "
            "be passed between the stages of this plan; move it into the stage that uses it, "
            "and please report the model and the plan (Plan.to_json()) as a pdcompile bug")


def _send_leaves(gm: fx.GraphModule, stage_of: dict[str, int], last: int) -> None:
    """Check every value used by a later stage; send structured ones as their leaves.

    Needs "pd.tree" (the shapes pass); values without it are checked when they are sent.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}

    def stage(user: fx.Node) -> int:
        return last if user.op == "output" else stage_of[user.name]

    changed = False
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        home = stage_of[node.name]
        later = sorted({stage(u) for u in node.users if stage(u) > home})
        tree = get_tree(node)
        if not later or tree is None:
            continue
        bad = [k for k in tree.kinds if k not in _CROSSING_KINDS]
        if bad:
            raise PlanError(
                f"node {node.name!r} (stage {home}) is used by stage {later[0]}, but its value "
                f"holds a {bad[0]}, and only tensors, numbers, sizes, dtypes and devices can "
                f"cross stages; cut "
                f"elsewhere (so that its users stay in stage {home}) or return tensors from it")
        if tree.is_leaf:
            continue
        try:
            text = spec_text(_as_tuple(tree.spec) if _items_only(node, stage, home) else tree.spec)
        except ValueError as err:
            raise PlanError(f"node {node.name!r} (stage {home}) sends a structured value to "
                            f"stage {later[0]}, but {err}; register its type with "
                            "torch.utils._pytree.register_pytree_node(..., serialized_type_name="
                            "...), or cut elsewhere") from None
        with graph.inserting_after(node):
            flat = graph.call_function(flatten_value, (node,))
        stage_of[flat.name] = home
        leaves: list[Any] = []
        previous = flat
        for index, kind in enumerate(tree.kinds):
            if kind == "NoneType":
                leaves.append(None)
                continue
            with graph.inserting_after(previous):
                previous = graph.call_function(operator.getitem, (flat, index))
            stage_of[previous.name] = home
            leaves.append(previous)
        for target in later:
            users = [u for u in node.users if u is not flat and stage(u) == target]
            with graph.inserting_before(min(users, key=order.__getitem__)):
                rebuilt = graph.call_function(rebuild_value, (list(leaves), text))
            stage_of[rebuilt.name] = target
            for user in users:
                user.replace_input_with(node, rebuilt)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
        for node in graph.nodes:
            set_stage(node, last if node.op == "output" else stage_of[node.name])


def _items_only(node: fx.Node, stage: Callable[[fx.Node], int], home: int) -> bool:
    """Whether later stages read the value only as `value[i]` (then any sequence, such as the
    `torch.return_types.max` of `x.max(dim)`, can travel as a plain tuple)."""
    return all(u.target is operator.getitem and isinstance(u.args[1], int)
               for u in node.users if stage(u) > home)


def _as_tuple(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """The same leaves in a plain tuple (whose structure can always be written down)."""
    return pytree.TreeSpec(tuple, None, list(spec.children()))


def _unique_outputs(sub: fx.GraphModule, out_node: fx.Node, claimed: set[str]
                    ) -> tuple[str, ...]:
    """The names of what a stage returns, unique among every stage's: split_module names each
    stage's nodes in its own namespace, so two stages could return different values under one
    name, and a stage that received one and sent the other decoded a tensor as a number (or a
    number as a tensor). Nodes whose name another stage's output took are renamed."""
    renamed = False
    for value in out_node.args[0]:  # type: ignore[union-attr]
        assert isinstance(value, fx.Node)
        if value.name in claimed and value.op != "placeholder":
            taken = {n.name for n in sub.graph.nodes} | claimed
            number = 1
            while f"{value.name}_s{number}" in taken:
                number += 1
            value._rename(f"{value.name}_s{number}")
            renamed = True
    if renamed:
        sub.recompile()
    return tuple(a.name for a in out_node.args[0] if isinstance(a, fx.Node))  # type: ignore[union-attr]


def _plain_containers(value: Any) -> Any:
    """`value` with fx's immutable_list and immutable_dict (what a graph's output holds for a
    list or dict the model returned) as the list and dict the model returned: the loss function
    received an immutable_list that it could not, say, append to, and whose structure differed
    from the model's."""
    if isinstance(value, fx.immutable_collections.immutable_list):
        return [_plain_containers(v) for v in value]
    if isinstance(value, fx.immutable_collections.immutable_dict):
        return {k: _plain_containers(v) for k, v in value.items()}
    if type(value) in (tuple, list):
        return type(value)(_plain_containers(v) for v in value)
    if type(value) is dict:
        return {k: _plain_containers(v) for k, v in value.items()}
    return value


def _ref_of(leaf: Any, getitem_of: dict[str, ValueRef]) -> ValueRef:
    if isinstance(leaf, fx.Node):
        if leaf.op == "placeholder":
            return ValueRef(leaf.name)
        if leaf.name in getitem_of:
            return getitem_of[leaf.name]
    raise PlanError(f"the model's output {leaf!r} is neither an input nor computed by a stage; "
                    "return tensors computed by the model")


def _link(stages: list[StageProgram], ref: ValueRef, dst: int) -> None:
    """Record that `ref` travels from its stage straight to `dst` (once per value)."""
    assert ref.stage is not None
    src = stages[ref.stage]
    if ref.name not in src.sends.get(dst, ()):
        src.sends[dst] = src.sends.get(dst, ()) + (ref.name,)
        stages[dst].receives[ref.stage] = stages[dst].receives.get(ref.stage, ()) + (ref.name,)


def _stage_inputs(sub: fx.GraphModule, call: fx.Node, getitem_of: dict[str, ValueRef],
                  gm: fx.GraphModule) -> tuple[ValueRef, ...]:
    """Where each placeholder's value comes from; attribute reads become the stage's own."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    refs: list[ValueRef] = []
    changed = False
    for placeholder, arg in zip(placeholders, call.args, strict=True):
        assert isinstance(arg, fx.Node)
        if arg.op == "get_attr":
            _own_attribute(sub, placeholder, gm, str(arg.target))
            changed = True
        elif arg.op == "placeholder":
            refs.append(ValueRef(arg.name))
        else:
            refs.append(getitem_of[arg.name])
    if changed:
        sub.graph.lint()
        sub.recompile()
    return tuple(refs)


def _own_attribute(sub: fx.GraphModule, placeholder: fx.Node, gm: fx.GraphModule,
                   target: str) -> None:
    """Replace a placeholder fed by `gm.<target>` with the stage's own attribute."""
    value = gm.get_parameter(target) if _is_param(gm, target) else get_path(gm, target)
    name = target.replace(".", "_")
    while hasattr(sub, name):
        name += "_"
    if isinstance(value, torch.nn.Parameter):
        sub.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        sub.register_buffer(name, value)
    else:
        setattr(sub, name, value)
    with sub.graph.inserting_before(placeholder):
        read = sub.graph.get_attr(name)
    placeholder.replace_all_uses_with(read)
    sub.graph.erase_node(placeholder)


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def _name_and_copy(stages: list[StageProgram], root: torch.nn.Module) -> tuple[TiedParameter, ...]:
    """Give every stage its own copy of its tensors; record original names and cross-stage ties."""
    param_names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(p), []).append(name)
    buffer_names: dict[int, list[str]] = {}
    for name, b in root.named_buffers(remove_duplicate=False):
        buffer_names.setdefault(id(b), []).append(name)
    transient = _non_persistent(root)
    holders: dict[int, list[tuple[int, str]]] = {}
    for program in stages:
        for name, p in program.module.named_parameters(remove_duplicate=False):
            program.param_names[name] = tuple(param_names.get(id(p), [name]))
            holders.setdefault(id(p), []).append((program.index, name))
        for name, b in program.module.named_buffers(remove_duplicate=False):
            program.buffer_names[name] = tuple(buffer_names.get(id(b), [name]))
            # a tensor constant fx made of `torch.ones(4)` in forward is no buffer of the model
            if set(program.buffer_names[name]) <= transient or id(b) not in buffer_names:
                program.transient_buffers += (name,)
        program.module = copy_module(program.module)
    ties = []
    for members in holders.values():
        if len({s for s, _ in members}) > 1:
            first = stages[members[0][0]].param_names[members[0][1]][0]
            ties.append(TiedParameter(first, tuple(members)))
    return tuple(ties)


def _non_persistent(root: torch.nn.Module) -> set[str]:
    """Qualified names of the buffers registered with `persistent=False` (not in state dicts)."""
    return {f"{prefix}.{attr}" if prefix else attr
            for prefix, module in root.named_modules(remove_duplicate=False)
            for attr in module._non_persistent_buffers_set}


def stage_annotations_complete(gm: fx.GraphModule) -> bool:
    """Whether every node of `gm` carries "pd.stage" (true after `split`)."""
    return all(has_stage(n) for n in gm.graph.nodes)


__all__ = ["SplitResult", "StageProgram", "TiedParameter", "ValueRef", "assign_stages",
           "even_plan", "manual_plan", "split", "stage_annotations_complete"]
