"""Split: stage modules from split_module, with their receive/send lists, ties and buffers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from pdcompile.errors import PlanError
from pdcompile.meta import get_stage
from pdcompile.passes.split import ValueRef, even_plan, manual_plan, split
from pdcompile.passes.trace import trace


class Net(nn.Module):
    """emb (tied with head) -> a -> b (+ skip from emb) -> head; BatchNorm in b; a bias read by
    get_attr in the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 6)
        self.b = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.bias = nn.Parameter(torch.zeros(11))

    def forward(self, idx: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.emb(idx)
        h = torch.relu(self.a(e))
        y = self.b(h) + e
        return self.head(y) * scale + self.bias, h


STAGE = {"idx": 0, "scale": 0, "emb": 0, "a": 1, "relu": 1, "b_0": 2, "b_1": 2, "add": 2}


def cut(model: nn.Module) -> tuple[torch.fx.GraphModule, object]:
    gm = trace(model)
    plan = manual_plan(gm, lambda n: STAGE.get(n.name, 3))
    return gm, split(gm, plan, model=model)


def test_receives_sends_and_skip_connections() -> None:
    model = Net()
    _, parts = cut(model)
    s0, s1, s2, s3 = parts.stages  # type: ignore[attr-defined]
    assert s0.sends == {1: ("emb",), 2: ("emb",)}  # the skip goes straight to stage 2
    assert s1.receives == {0: ("emb",)} and s1.sends == {2: ("relu",), 3: ("relu",)}
    assert s2.receives == {1: ("relu",), 0: ("emb",)} and s2.sends == {3: ("add",)}
    assert s3.receives == {2: ("add",), 1: ("relu",)}  # `h` is a model output: sent to the end
    assert s3.inputs == (ValueRef("add", 2), ValueRef("scale"))
    assert parts.edges == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]  # type: ignore[attr-defined]
    assert parts.output_refs == (ValueRef("add_1", 3), ValueRef("relu", 1))  # type: ignore


def test_every_node_has_its_stage() -> None:
    gm, _ = cut(Net())
    stages = {n.name: get_stage(n) for n in gm.graph.nodes}
    assert stages["emb"] == 0 and stages["relu"] == 1 and stages["b_1"] == 2
    assert stages["output"] == 3 and stages["bias"] == 3


def test_chained_stages_compute_the_model() -> None:
    model = Net()
    _, parts = cut(model)
    idx, scale = torch.randint(0, 11, (5,)), torch.tensor(2.0)
    values: dict[tuple[int, str], torch.Tensor] = {}
    for program in parts.stages:  # type: ignore[attr-defined]
        args = [{"idx": idx, "scale": scale}[r.name] if r.is_data else values[r.stage, r.name]
                for r in program.inputs]
        for name, value in zip(program.outputs, program.module(*args), strict=True):
            values[program.index, name] = value
    expected = model(idx, scale)
    got = [values[r.stage, r.name] for r in parts.output_refs]  # type: ignore[attr-defined]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_ties_buffers_and_owned_copies() -> None:
    model = Net()
    _, parts = cut(model)
    (tie,) = parts.ties  # type: ignore[attr-defined]
    assert tie.name == "emb.weight" and tie.stages == (0, 3)
    stages = parts.stages  # type: ignore[attr-defined]
    assert stages[3].param_names["head.weight"] == ("emb.weight", "head.weight")
    assert stages[3].param_names["bias"] == ("bias",)
    assert {b for names in stages[2].buffer_names.values() for b in names} == {
        "b.1.running_mean", "b.1.running_var", "b.1.num_batches_tracked"}
    model_tensors = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    for program in stages:
        owned = list(program.module.parameters()) + list(program.module.buffers())
        assert not model_tensors & {id(t) for t in owned}, "stages must own their tensors"


def test_values_cannot_flow_backwards() -> None:
    gm = trace(Net())
    plan = manual_plan(gm, {"emb": 1, "a": 0})
    with pytest.raises(PlanError, match="later stage"):
        split(gm, plan)


def test_empty_stage_is_refused() -> None:
    gm = trace(Net())
    plan = manual_plan(gm, lambda n: 0 if n.op == "placeholder" else (1 if n.name != "emb" else 0))
    plan2 = manual_plan(gm, lambda n: 0 if n.op == "placeholder" else 2 if n.name == "a" else
                        (3 if n.name not in ("emb",) else 0))
    split(gm, plan)
    with pytest.raises(PlanError, match="no operation"):
        split(gm, plan2)


def test_even_plan_is_contiguous_and_balanced() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    gm = trace(model)
    plan = even_plan(gm, 4, replicas=[2, 1, 1, 1])
    assert [len(s.nodes) for s in plan.stages] == [3, 2, 2, 2]  # input + 2 layers, then 2 each
    assert plan.config == "2-1-1-1" and plan.stages[1].ranks == (2,)
    with pytest.raises(PlanError, match="too few"):
        even_plan(gm, 20)


def test_tuple_values_are_unpacked_where_made() -> None:
    class Rnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = self.lstm(x)
            return self.out(y)

    model = Rnn()
    gm = trace(model)
    plan = manual_plan(gm, {"x": 0, "lstm": 0, "getitem": 1, "out": 1})
    parts = split(gm, plan, model=model)
    assert parts.stages[0].sends == {1: ("getitem",)}


# the planner's 4-stage cut of a small GNMT (random costs) whose stages interleave in the
# traced order: the encoder's second LSTM (stage 2) is traced before the decoder's embedding
# (stage 1); split_module emitted stage 2 first and looked up 'decoder_attention_query' (KeyError)
GNMT_STAGES = (
    ("src", "encoder_embedding", "encoder_dropout", "encoder_bidir", "getitem",
     "encoder_dropout_1"),
    ("tgt", "decoder_embedding", "decoder_dropout", "decoder_first", "getitem_4",
     "decoder_attention_query"),
    ("encoder_rnns_0", "getitem_2", "getitem_3", "getitem_5", "transpose", "bmm"),
    ("getitem_1", "mul", "softmax", "bmm_1", "cat", "decoder_dropout_1", "decoder_rnns_0",
     "getitem_6", "getitem_7", "decoder_classifier"),
)


def _gnmt() -> tuple[nn.Module, torch.fx.GraphModule]:
    from pdcompile.models import gnmt
    from pdcompile.passes.shapes import annotate_shapes

    model, inputs = gnmt.factory(batch_size=4, src_len=6, tgt_len=6, hidden=32, layers=2)
    gm = trace(model)
    annotate_shapes(gm, inputs)
    return model, gm


def test_stages_that_interleave_in_traced_order_split() -> None:
    model, gm = _gnmt()
    plan = manual_plan(gm, {n: s for s, names in enumerate(GNMT_STAGES) for n in names})
    parts = split(gm, plan, model=model)
    stages = [get_stage(n) for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr")]
    assert stages == sorted(stages)  # the graph is reordered stage by stage
    assert parts.stages[1].sends[2] == ("decoder_attention_query",)
    # the LSTM's unused state tuple is read where the LSTM runs, nothing but tensors crosses
    assert "getitem_5" not in {v for s in parts.stages for vs in s.sends.values() for v in vs}


@pytest.mark.parametrize("count", [pytest.param(20, id="20"),
                                   pytest.param(300, id="300", marks=pytest.mark.slow)])
def test_random_topological_cuts_of_gnmt_split(count: int) -> None:
    import random

    from tests.helpers.random_models import random_cut

    model, gm = _gnmt()
    rng = random.Random(24)
    for _ in range(count):
        plan = random_cut(gm, rng, stages=4, replicas=[1] * 4)
        parts = split(copy.deepcopy(gm), plan, model=model)
        assert len(parts.stages) == 4


class Positions(nn.Module):
    """Positions built in forward (an input-less `arange` under torch.export), used by two
    layers, and an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # a constant length: arange(ids.shape[1]) would read the input's (free) length under
        # torch.export, and so not be input-less
        positions = torch.arange(5, dtype=torch.float32).unsqueeze(-1)
        h = self.a(self.emb(ids) + positions)
        torch.relu_(h)
        return self.b(h) * positions


def _positions_graph() -> tuple[nn.Module, torch.fx.GraphModule, tuple[torch.Tensor]]:
    from pdcompile.passes.frontend import capture

    model, ids = Positions(), torch.randint(0, 10, (4, 5))
    captured = capture(model, (ids,), None, frontend="export")
    return model, captured.graph, (ids,)


def test_input_less_operations_run_in_each_stage_that_uses_them() -> None:
    from tests.helpers.transparency import check

    model, gm, inputs = _positions_graph()
    arange = next(n.name for n in gm.graph.nodes if not n.all_input_nodes
                  and n.op == "call_function")
    order = [n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    # arange in stage 0, its users in stages 1 and 2: each of them computes its own
    stage_of = {name: 0 for name in order[:order.index(arange) + 1]}
    linear = [n for n in order if n.startswith("linear")]
    stage_of |= {name: 1 for name in order[order.index(arange) + 1:order.index(linear[1])]}
    plan = manual_plan(gm, lambda n: stage_of.get(n.name, 2))
    pipe = check((model, inputs, torch.randn(4, 5, 4), nn.functional.mse_loss),
                 schedule="1f1b-flush", micro=2, plan=plan, frontend="export")
    sent = {v for s in pipe.parts.stages for vs in s.sends.values() for v in vs}
    assert not any(name.startswith("arange") for name in sent)
    for stage in pipe.stage_modules[1:]:
        assert any(n.op == "call_function" and not n.all_input_nodes
                   for n in stage.graph.nodes), stage.code


def test_a_stage_of_only_an_input_less_operation_splits() -> None:
    """The plan keeps a stage that computes only `arange`; the stage that uses it computes its
    own copy, so nothing needs to cross."""
    from tests.helpers.transparency import check

    model, gm, inputs = _positions_graph()
    arange = next(n.name for n in gm.graph.nodes if not n.all_input_nodes
                  and n.op == "call_function")
    plan = manual_plan(gm, lambda n: 0 if n.op == "placeholder" or n.name == arange else 1)
    pipe = check((model, inputs, torch.randn(4, 5, 4), nn.functional.mse_loss),
                 schedule="gpipe", micro=2, plan=plan, frontend="export")
    assert pipe.parts.stages[0].sends == {} and pipe.parts.stages[1].receives == {}


def test_split_module_failure_is_a_plan_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdcompile.passes.split as split_pass

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a")

    monkeypatch.setattr(split_pass, "split_module", broken)
    gm = trace(Net())
    with pytest.raises(PlanError, match=r"node 'a' \(stage 1, used by stages \[1\]\)"):
        split(gm, manual_plan(gm, lambda n: STAGE.get(n.name, 3)))


def test_a_stage_that_only_reads_items_receives_the_sequence_as_a_tuple() -> None:
    """The stage holds only `getitem` of `x.max(dim)` made in stage 0: the structseq
    (torch.return_types.max, whose type pytree cannot write down) crosses as a plain tuple."""
    from tests.helpers.random_models import RandomNet, Step, explicit_graph, squared_error
    from tests.helpers.transparency import check

    model = RandomNet((Step("linear", 0, 0), Step("max", 1, 0), Step("linear", 2, 0)), 1, (-1,))
    inputs = (torch.randn(8, 3, 4),)
    gm = explicit_graph(model, inputs)
    names = [n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    plan = manual_plan(gm, {n: 0 if names.index(n) <= names.index("max_1") else
                            1 if n == "getitem" else 2 for n in names})
    pipe = check((model, inputs, torch.randn(8, 1, 4), squared_error),
                 schedule="gpipe", micro=2, plan=plan)
    assert len(pipe.parts.stages[0].sends[1]) == 2  # the values and the indices


class PositionsOfLength(Positions):
    """Positions as long as the input: under torch.export (every dimension free) `arange`
    reads the input's length through `sym_size`, a number that crosses stages like a tensor."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], dtype=torch.float32).unsqueeze(-1)
        h = self.a(self.emb(ids) + positions)
        torch.relu_(h)
        return self.b(h) * positions


def test_every_cut_of_a_graph_with_a_symbolic_length_splits() -> None:
    from pdcompile.passes.frontend import capture
    from tests.helpers.transparency import check

    model, ids = PositionsOfLength(), torch.randint(0, 10, (4, 5))
    gm = capture(model, (ids,), None, frontend="export").graph
    assert any("sym_size" in str(n.target) for n in gm.graph.nodes)
    order = [n.name for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    for cut in range(2, len(order)):  # the placeholder alone would leave stage 0 empty
        first = set(order[:cut])
        plan = manual_plan(gm, lambda n, first=first: 0 if n.name in first else 1)
        check((model, (ids,), torch.randn(4, 5, 4), nn.functional.mse_loss),
              schedule="1f1b-flush", micro=2, plan=plan, frontend="export")


@pytest.mark.parametrize("cluster", [None, "2@1e10"])
def test_a_plan_of_another_model_is_refused_naming_its_nodes(cluster: str | None) -> None:
    """A plan whose nodes this model does not have (another model's `pdcompile plan --json`):
    priced on a cluster, it lost those nodes, every node fell into stage 0, and compile said
    "stages [1] of the plan have no operation to run; use fewer stages"."""
    import pdcompile
    from pdcompile.plan import Plan, Stage

    other = Plan(stages=(Stage(nodes=("node1", "node2"), replicas=1, ranks=(0,)),
                         Stage(nodes=("node3",), replicas=1, ranks=(1,))),
                 time_per_minibatch=0.0, dp_time=0.0, workers=2, planner="manual",
                 status="GIVEN")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    with pytest.raises(PlanError, match=r"the plan names nodes the traced graph does not have: "
                                        r"\['node1', 'node2', 'node3'\]"):
        pdcompile.compile(model, cluster, example_inputs=(torch.randn(8, 4),),
                          loss_fn=nn.functional.cross_entropy, plan=other)
