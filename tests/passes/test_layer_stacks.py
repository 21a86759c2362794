"""torch.nn's layer stacks are traced through: a pipeline can cut between their layers."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import TraceError
from pdcompile.models.real_models import EncoderLM
from pdcompile.passes.trace import trace


def _modules(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


def test_encoder_is_traced_into_its_layers() -> None:
    model = EncoderLM(layers=3)
    gm = trace(model)
    assert _modules(gm) == ["embed", "encoder.layers.0", "encoder.layers.1", "encoder.layers.2",
                            "head"]
    ids = torch.randint(0, 100, (2, 7))
    torch.testing.assert_close(gm(ids), model(ids))


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core = nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=2,
                                   dim_feedforward=32, dropout=0.0, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, tgt_mask: torch.Tensor
                ) -> torch.Tensor:
        return self.core(src, tgt, tgt_mask=tgt_mask)


def test_transformer_and_decoder_with_masks() -> None:
    model = Seq2Seq().eval()
    gm = trace(model)
    assert _modules(gm) == ["core.encoder.layers.0", "core.encoder.layers.1",
                            "core.encoder.norm", "core.decoder.layers.0",
                            "core.decoder.layers.1", "core.decoder.norm"]
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    with torch.no_grad():
        torch.testing.assert_close(gm(src, tgt, mask), model(src, tgt, mask))


def test_subclass_keeps_its_own_forward() -> None:
    """Only torch.nn's own classes get the plain loop: a subclass's forward is traced as
    written (here it calls torch's untraceable one), and can be made a leaf."""
    class Mine(nn.TransformerEncoder):
        def forward(self, src: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return super().forward(src) * 2

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.enc = Mine(layer, 2, enable_nested_tensor=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.enc(x)

    with pytest.raises(TraceError, match=r"module 'enc' \(Mine\).*leaf_modules=\['enc'\]"):
        trace(Holder())
    assert _modules(trace(Holder(), leaf_modules=["enc"])) == ["enc"]


@pytest.mark.slow
def test_pipeline_cuts_between_encoder_layers_and_trains_as_one_process() -> None:
    torch.manual_seed(0)
    model = EncoderLM(layers=4)
    ids = torch.randint(0, 100, (4, 8))
    target = torch.roll(ids, -1, dims=1)
    reference = copy.deepcopy(model)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    pipe = pdcompile.compile(model, example_inputs=(ids,), loss_fn=_lm_loss, optimizer=sgd,
                             schedule="1f1b-flush", microbatches=2, stages=2)
    owners = [{name.split(".")[2] for names in program.param_names.values() for name in names
               if name.startswith("encoder.layers.")} for program in pipe.stage_programs]
    assert owners[0] and owners[1] and not owners[0] & owners[1]  # whole layers on each side
    losses = [pipe.step(ids, target=target) for _ in range(2)]
    opt = sgd(reference.parameters())
    for step in range(2):
        opt.zero_grad()
        total = 0.0
        for x, y in zip(ids.chunk(2), target.chunk(2), strict=True):
            loss = _lm_loss(reference(x), y)
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        assert losses[step] == pytest.approx(total, abs=1e-6)
    state = pipe.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
