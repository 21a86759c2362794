"""A pipeline loaded from an export exports again: export -> load -> export -> load gives the
losses and weights of the first loaded pipeline, for recurrent layers (nn.LSTM, nn.GRU,
nn.RNN) under both front ends, and inside a module given as `leaf_modules=`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import PdcompileError
from tests.helpers.random_models import squared_error
from tests.helpers.transparency import momentum


class _Recurrent(nn.Module):
    """A recurrent layer (two layers, both directions) and a Linear head."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cell(4, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _load(folder: Path) -> pdcompile.Pipeline:
    return pdcompile.load(str(folder), loss_fn=squared_error, optimizer=momentum, trust=True)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
@pytest.mark.parametrize("stepped", [False, True], ids=["at-once", "after-a-step"])
def test_a_loaded_recurrent_pipeline_exports_again_and_trains_the_same(
        tmp_path: Path, frontend: str, cell: type[nn.RNNBase], stepped: bool) -> None:
    """The loaded RNN's parameters are assigned anew, which leaves its weak references to its
    weights dead until its next forward: export at once then refused the layer ('..._flat_
    weight_refs[0] is a ReferenceType, which cannot be stored without pickle')."""
    torch.manual_seed(0)
    inputs, target = torch.randn(8, 3, 4), torch.randn(8, 3, 4)
    pipe = pdcompile.compile(_Recurrent(cell), example_inputs=(inputs,), loss_fn=squared_error,
                             optimizer=momentum, frontend=frontend, plan=[1, 1],
                             schedule="1f1b-flush", microbatches=2)
    pipe.export(str(tmp_path / "first"))
    first = _load(tmp_path / "first")
    if stepped:
        pipe.step(inputs, target=target)
        first.step(inputs, target=target)
    first.export(str(tmp_path / "second"))
    second = _load(tmp_path / "second")
    want = [first.step(inputs, target=target) for _ in range(2)]
    got = [second.step(inputs, target=target) for _ in range(2)]
    assert got == want
    expected = first.state_dict()
    found = second.state_dict()
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_a_recurrent_layer_inside_a_leaf_module_exports_and_trains_the_same(
        tmp_path: Path, cell: type[nn.RNNBase]) -> None:
    """An RNN inside a module given as `leaf_modules=` is written as a record (module_record),
    its lists of its own weights and weak references to them as their names: before, export
    refused it ('..._flat_weight_refs[0] is a ReferenceType, which cannot be stored without
    pickle'). Loaded, and loaded again after a second export, it trains as the original does,
    losses and weights equal to the bit."""
    torch.manual_seed(0)
    inputs, target = torch.randn(8, 3, 4), torch.randn(8, 3, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _Recurrent(cell))
    pipe = pdcompile.compile(model, example_inputs=(inputs,), loss_fn=squared_error,
                             optimizer=momentum, leaf_modules=[_Recurrent], plan=[2, 1],
                             schedule="1f1b-flush", microbatches=2)
    assert any(isinstance(m, _Recurrent) for m in pipe.stage_modules[1].modules())
    pipe.export(str(tmp_path / "first"))
    first = _load(tmp_path / "first")
    first.export(str(tmp_path / "second"))
    second = _load(tmp_path / "second")
    want = [pipe.step(inputs, target=target) for _ in range(3)]
    assert [first.step(inputs, target=target) for _ in range(3)] == want
    assert [second.step(inputs, target=target) for _ in range(3)] == want
    expected = pipe.state_dict()
    for loaded in (first, second):
        found = loaded.state_dict()
        assert found.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(found[name], value, rtol=0, atol=0, msg=name)


def _own_entries(tree: Any) -> list[dict[str, Any]]:
    """Every list of a module's own weights a module records file holds (module_record)."""
    if isinstance(tree, dict):
        found = [tree["own"]] if isinstance(tree.get("own"), dict) else []
        return found + [e for v in tree.values() for e in _own_entries(v)]
    if isinstance(tree, list):
        return [e for v in tree for e in _own_entries(v)]
    return []


def test_a_recorded_weight_list_naming_no_weight_is_refused_in_one_line(
        tmp_path: Path) -> None:
    """A record's list of the RNN's weights edited to name its `forward` (the manifest written
    again, loaded with trust=True): refused in one line naming the file, nothing but the
    module's own parameters and buffers put in the list."""
    from pdcompile.export.integrity import seal_export
    from pdcompile.runtime.tensor_tree import load_tree, save_tree

    torch.manual_seed(0)
    inputs = torch.randn(8, 3, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _Recurrent(nn.LSTM))
    pipe = pdcompile.compile(model, example_inputs=(inputs,), loss_fn=squared_error,
                             optimizer=momentum, leaf_modules=[_Recurrent], plan=[2, 1],
                             schedule="1f1b-flush", microbatches=2)
    folder = tmp_path / "out"
    pipe.export(str(folder))
    path = folder / "stage_1_modules.safetensors"
    tree = load_tree(path)
    entries = _own_entries(tree)
    assert len(entries) == 2  # the LSTM's _flat_weights and _flat_weight_refs
    entries[0]["items"][0][0] = "forward"
    save_tree(path, tree)
    seal_export(folder)
    (folder / "MANIFEST.sig").unlink()
    with pytest.raises(PdcompileError) as info:
        pdcompile.load(str(folder), trust=True)
    message = str(info.value)
    assert str(path) in message and "'forward'" in message and "\n" not in message, message
