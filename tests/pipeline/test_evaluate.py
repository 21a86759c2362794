"""`Pipeline.evaluate`: validation as `model.eval()` computes it, on the pipeline's weights,
changing nothing. Before it existed the only forward was `pipe(x)`, which runs the graphs in the
mode they were captured in: dropout drew, BatchNorm normalised by the minibatch and moved the
statistics of one replica only."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.passes.trace import trace
from pdcompile.passes.training_flags import training_mode_calls


class Modal(nn.Module):
    """Every way a model depends on its mode: BatchNorm and Dropout modules, and (`functional`)
    dropout called with `self.training` and attention dropout chosen by it."""

    def __init__(self, *, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.mid = nn.Linear(16, 16)
        self.norm2 = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.inp(x))))
        if self.functional:
            h = F.dropout(h, 0.2, self.training)
            q = h.view(h.shape[0], 2, 2, 4)
            h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1 if self.training else 0.0
                                               ).reshape(h.shape[0], 16)
        return self.out(torch.tanh(self.norm2(self.mid(h))))


def _trained(model: nn.Module, *, replicas: list[int] | None = None, **options: Any
             ) -> tuple[pdcompile.Pipeline, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    placement: dict[str, Any] = {"plan": replicas} if replicas else {"stages": 2}
    pipe = pdcompile.compile(model, example_inputs=(x,), loss_fn=F.mse_loss,
                             schedule="1f1b-flush", microbatches=2, **placement, **options)
    for _ in range(3):
        pipe.step(x, target=y)
    return pipe, x


def _reference(model: nn.Module, pipe: pdcompile.Pipeline, x: torch.Tensor) -> torch.Tensor:
    """What a user would compute: the weights loaded into the model, `eval()`, forward."""
    reference = copy.deepcopy(model)
    reference.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        return reference.eval()(x)


def _snapshot(pipe: pdcompile.Pipeline) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in pipe.state_dict().items()}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("replicas", [None, [2, 1]])
def test_evaluate_is_the_models_eval_forward_and_changes_nothing(
        frontend: str, replicas: list[int] | None) -> None:
    model = Modal(functional=True)
    pipe, x = _trained(copy.deepcopy(model), replicas=replicas, frontend=frontend)
    before, rng = _snapshot(pipe), torch.get_rng_state()
    modes = [m.training for m in pipe.model.modules()]  # type: ignore[union-attr]

    out = pipe.evaluate(x)

    assert torch.equal(out, _reference(model, pipe, x))
    assert not out.requires_grad
    assert torch.equal(pipe.evaluate(x), out)  # no dropout drawn, no statistics moved
    after = pipe.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in pipe.model.modules()] == modes  # type: ignore[union-attr]
    # in training mode the same weights give another output: evaluation mode is not a detail
    assert not torch.allclose(pipe(x), out)


def test_evaluate_keeps_each_modules_own_mode() -> None:
    """A frozen BatchNorm held in eval mode inside a training model stays so afterwards."""
    model = Modal(functional=False)
    model.norm.eval()
    pipe, x = _trained(model)
    pipe.evaluate(x)
    assert model.training and not model.norm.training and model.norm2.training


def test_evaluate_takes_inputs_by_name_and_checks_them() -> None:
    class ByName(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
            self.drop = nn.Dropout(0.5)

        def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.b(self.drop(torch.tanh(self.a(tokens))) * scale)

    model = ByName()
    inputs = {"tokens": torch.randn(8, 4), "scale": torch.rand(8, 1)}
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=inputs, stages=2,
                             loss_fn=F.mse_loss, schedule="1f1b-flush", microbatches=2)
    pipe.step(inputs, target=torch.randn(8, 2))
    reference = copy.deepcopy(model)
    reference.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        assert torch.equal(pipe.evaluate(inputs), reference.eval()(**inputs))
    with pytest.raises(PipelineInputError, match="tokens, scale"):
        pipe.evaluate({"tokens": inputs["tokens"]})


def test_a_loaded_pipeline_evaluates_with_its_stage_modules(tmp_path: Path) -> None:
    model = Modal(functional=False)
    pipe, x = _trained(copy.deepcopy(model))
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    assert loaded.model is None
    before = _snapshot(loaded)

    out = loaded.evaluate(x)

    torch.testing.assert_close(out, _reference(model, pipe, x), rtol=0, atol=1e-6)
    for name, value in before.items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert all(m.training for m in loaded.stage_modules)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_graph_that_fixed_training_mode_is_refused_naming_it(tmp_path: Path,
                                                               frontend: str) -> None:
    pipe, x = _trained(Modal(functional=True), frontend=frontend)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"))
    with pytest.raises(PipelineInputError, match=r"fixed training mode.*dropout.*"
                                                 r"load_state_dict\(pipe.state_dict\(\)\)"):
        loaded.evaluate(x)


def test_a_given_graph_module_is_evaluated_by_its_stages() -> None:
    model = Modal(functional=False)
    pipe, x = _trained(trace(copy.deepcopy(model)))
    assert pipe.model is None
    torch.testing.assert_close(pipe.evaluate(x), _reference(model, pipe, x), rtol=0, atol=1e-6)


def test_training_mode_calls_follow_the_mode_at_capture() -> None:
    model = Modal(functional=True)
    assert {c.split(" ")[0] for c in training_mode_calls(trace(model))} == {
        "dropout", "scaled_dot_product_attention"}
    assert training_mode_calls(trace(model.eval())) == []
    assert training_mode_calls(trace(Modal(functional=False))) == []  # modules only


def test_a_model_with_tied_weights_evaluates() -> None:
    """Tied across the first and the last stage (an embedding and its output layer): the state
    names the weight twice, which functional_call refused ("got multiple values for keys ...
    which are tied")."""
    from tests.helpers.transparency import ce, tied_bn, tied_plan

    torch.manual_seed(0)
    model, (ids,), target, _ = tied_bn()
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(ids,), loss_fn=ce,
                             plan=tied_plan(model), schedule="1f1b-flush", microbatches=2)
    pipe.step(ids, target=target)
    assert torch.equal(pipe.evaluate(ids), _reference(model, pipe, ids))


class AuxHead(nn.Module):
    """A main and an auxiliary head, the auxiliary one returned only in training mode (as
    torchvision's GoogLeNet and Inception do: `if self.training and self.aux_logits:`)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.body(x))
        if self.training:
            return self.head(h), self.aux(h)
        return self.head(h)


def _aux_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    main, aux = output
    return F.mse_loss(main, target) + 0.3 * F.mse_loss(aux, target)


def test_a_loaded_graph_with_training_branches_refuses_to_evaluate(tmp_path: Path) -> None:
    """The loaded graph holds the training branch (fx took it at capture): its evaluate returned
    the training outputs `(main, aux)` where `model.eval()` returns `main`; now it is refused
    naming the branch, while the compiled pipeline evaluates on the model's own forward."""
    torch.manual_seed(0)
    model = AuxHead()
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2,
                             loss_fn=_aux_loss, schedule="1f1b-flush", microbatches=2)
    pipe.step(x, target=y)
    torch.testing.assert_close(pipe.evaluate(x), _reference(model, pipe, x), rtol=0, atol=0)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"), loss_fn=_aux_loss)
    with pytest.raises(PipelineInputError, match=r"training-mode branches.*aux.*"
                                                 r"load_state_dict\(pipe.state_dict\(\)\)") as err:
        loaded.evaluate(x)
    assert "\n" not in str(err.value)
    assert loaded.step(x, target=y) == pipe.step(x, target=y)  # it still trains


def test_a_loaded_export_graph_with_training_branches_refuses_to_evaluate(tmp_path: Path
                                                                          ) -> None:
    """torch.export fixes a branch on `self.training` in its graph as fx does: with
    frontend='export' nothing was recorded, and the loaded pipeline's evaluate silently returned
    the training outputs `(main, aux)`; now it is refused naming the branch."""
    torch.manual_seed(0)
    model = AuxHead()
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(x,), stages=2,
                             loss_fn=_aux_loss, schedule="1f1b-flush", microbatches=2,
                             frontend="export")
    pipe.step(x, target=y)
    pipe.export(str(tmp_path / "pipe"))
    loaded = pdcompile.load(str(tmp_path / "pipe"), loss_fn=_aux_loss)
    with pytest.raises(PipelineInputError, match=r"training-mode branches.*linear.*"
                                                 r"load_state_dict\(pipe.state_dict\(\)\)"):
        loaded.evaluate(x)
    assert loaded.step(x, target=y) == pipe.step(x, target=y)


def test_an_export_graph_records_no_branch_for_batch_norm_state() -> None:
    """BatchNorm's `num_batches_tracked += 1` is in torch.export's training graph only: a state
    update (evaluation undoes it), not a branch; its batch norm is refused as fixed training
    mode (the test above it)."""
    from pdcompile.meta import get_training_branches
    from pdcompile.passes.frontend import capture

    captured = capture(Modal(functional=False), (torch.randn(4, 8),), frontend="export")
    assert get_training_branches(captured.graph) == ()
    assert training_mode_calls(captured.graph)
