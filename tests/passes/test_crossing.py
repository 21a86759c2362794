"""Structured values crossing stages go as their pytree leaves; what cannot cross is refused at
compile time, naming the node and the stages."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import pdcompile
from pdcompile.errors import PlanError
from pdcompile.passes.crossing import flatten_value, rebuild_value
from pdcompile.passes.split import manual_plan
from pdcompile.passes.trace import trace

SGD = functools.partial(torch.optim.SGD, lr=0.1)


@dataclasses.dataclass
class Features:
    hidden: torch.Tensor
    gate: torch.Tensor
    scale: float
    note: torch.Tensor | None = None


pytree.register_dataclass(Features, serialized_type_name="tests.passes.test_crossing.Features")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> Features:
        h = self.lin(x)
        return Features(hidden=h.tanh(), gate=h.sigmoid(), scale=float(x.shape[0]))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, features: Features) -> torch.Tensor:
        return self.lin(features.hidden * features.gate) / features.scale


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _cut(model: nn.Module) -> pdcompile.Plan:
    return manual_plan(trace(model, leaf_modules=[Block, Head]),
                       lambda n: 1 if n.name == "head" else 0)


def test_a_registered_container_crosses_as_its_leaves(tmp_path: Path) -> None:
    model = Model()
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,),
                             loss_fn=nn.functional.cross_entropy, optimizer=SGD,
                             schedule="1f1b-flush", microbatches=2, plan=_cut(model),
                             leaf_modules=[Block, Head])
    (sent,) = pipe.stage_programs[0].sends.values()
    assert len(sent) == 3  # hidden, gate, scale; the None field is not sent
    assert pipe.stage_programs[1].kinds == {sent[2]: "float"}
    losses = [pipe.step(x, target=y) for _ in range(2)]
    opt = SGD(model.parameters())
    for loss in losses:
        opt.zero_grad()
        total = 0.0
        for part, target in zip(x.chunk(2), y.chunk(2), strict=True):
            value = nn.functional.cross_entropy(model(part), target)
            (value / 2).backward()
            total += value.item() / 2
        opt.step()
        assert loss == pytest.approx(total, abs=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value)
    pipe.export(str(tmp_path / "pipe"))  # the stage code keeps its flatten / rebuild calls
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    assert loaded.step(x, target=y) == pipe.step(x, target=y)


class Labelled(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"x": x * 2, "label": "two"}


class Reader(nn.Module):
    def forward(self, value: dict[str, object]) -> torch.Tensor:
        return value["x"] + 1  # type: ignore[operator]


class Unsendable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Labelled()
        self.second = Reader()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_what_cannot_cross_is_refused_at_compile_time() -> None:
    model = Unsendable()
    plan = manual_plan(trace(model, leaf_modules=[Labelled, Reader]),
                       lambda n: 1 if n.name == "second" else 0)
    with pytest.raises(PlanError, match=r"node 'first' \(stage 0\) is used by stage 1, but its "
                                        r"value holds a str"):
        pdcompile.compile(model, example_inputs=(torch.randn(2, 3),), plan=plan,
                          leaf_modules=[Labelled, Reader])


def test_flatten_and_rebuild_round_trip() -> None:
    value = Features(torch.ones(2), torch.zeros(2), 3.0)
    leaves, spec = pytree.tree_flatten(value)
    rebuilt = rebuild_value(list(flatten_value(value)), pytree.treespec_dumps(spec))
    assert isinstance(rebuilt, Features) and rebuilt.scale == 3.0 and rebuilt.note is None
    assert len(leaves) == 3  # a None field is structure, not a leaf


needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="Hugging Face transformers is not installed: pip install -e .[models]")


@pytest.mark.slow
@needs_transformers
def test_hugging_face_model_output_crosses_stages() -> None:
    """BertModel kept whole returns BaseModelOutputWithPoolingAndCrossAttentions; the next stage
    reads it whole (this failed at the first step: "only tensors, numbers and sizes can")."""
    from transformers import BertConfig, BertModel

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32,
                                             hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0))
            self.head = PooledHead()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.bert(ids))

    torch.manual_seed(0)
    model = Classifier()
    ids, y = torch.randint(0, 50, (4, 6)), torch.randint(0, 3, (4,))
    leaves = [BertModel, PooledHead]
    plan = manual_plan(trace(model, leaf_modules=leaves),
                       lambda n: 1 if n.name == "head" else 0)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(ids,),
                             loss_fn=nn.functional.cross_entropy, optimizer=SGD,
                             schedule="1f1b-flush", microbatches=2, plan=plan,
                             leaf_modules=leaves)
    (sent,) = pipe.stage_programs[0].sends.values()
    assert len(sent) == 2  # last_hidden_state, pooler_output
    loss = pipe.step(ids, target=y)
    with torch.no_grad():
        want = nn.functional.cross_entropy(model(ids), y)
    assert loss == pytest.approx(want.item(), abs=1e-6)


class PooledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, output: object) -> torch.Tensor:
        pooled = output.pooler_output  # type: ignore[attr-defined]
        return self.lin(pooled + output.last_hidden_state.mean(dim=1))  # type: ignore[attr-defined]
