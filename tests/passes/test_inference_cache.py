"""Models built with an inference cache on (Hugging Face decoders' default `use_cache=True`)
compile and train as one process does; an output no stage can send is refused in words."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.errors import TraceError
from pdcompile.passes.frontend import capture
from pdcompile.passes.inference_cache import without_inference_cache
from tests.helpers.one_process import train_one_process


def _llama() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64)
    assert config.use_cache  # the library's default, as a user builds it
    return transformers.LlamaForCausalLM(config), torch.randint(1, 64, (4, 8)), \
        torch.randint(0, 64, (4, 8))


def _token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output["logits"] if isinstance(output, dict) else output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def test_a_decoder_built_with_its_cache_on_trains_like_one_process() -> None:
    model, ids, target = _llama()
    reference = copy.deepcopy(model)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(ids,), loss_fn=_token_loss,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), stages=2,
                             schedule="1f1b-flush", microbatches=2)
    assert len(pipe.stage_modules) == 2
    assert model.config.use_cache  # the user's model is as it was
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids).logits, reference(ids).logits)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        loss = pipe.step(ids, target=target)
        opt.zero_grad()
        want = 0.0
        for part, part_target in zip(ids.chunk(2), target.chunk(2), strict=True):
            part_loss = _token_loss(reference(part, use_cache=False), part_target) / 2
            part_loss.backward()
            want += part_loss.item()
        opt.step()
        assert loss == pytest.approx(want, rel=1e-5)
    state = pipe.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")


def test_use_cache_given_by_the_caller_is_left_as_given() -> None:
    model, _, _ = _llama()
    with without_inference_cache(model, {"use_cache": True}) as switched:
        assert not switched and model.config.use_cache
    with without_inference_cache(model, {}) as switched:
        assert switched and not model.config.use_cache
    assert model.config.use_cache
    with pytest.raises(RuntimeError), without_inference_cache(model, {}):
        raise RuntimeError("capture failed")
    assert model.config.use_cache  # put back when capture fails too


class _Handle:
    """Neither a tensor nor a container of tensors."""


class _ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Handle]:
        return self.layer(x), _Handle()


def test_an_output_no_stage_can_send_is_refused_naming_its_type() -> None:
    with pytest.raises(TraceError, match=r"holds a .*_Handle.*return only tensors"):
        capture(_ReturnsAnObject(), (torch.randn(2, 4),), frontend="export")


def test_an_encoder_decoder_whose_halves_hold_their_own_configs_trains() -> None:
    """T5's decoder stack holds a copy of the model's config with `use_cache` on: switching the
    model's alone left T5 returning an EncoderDecoderCache, refused by both front ends."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    assert model.decoder.config is not model.config and model.decoder.config.use_cache
    before = {key: c.use_cache for key, c in configs.items()}
    ids, mask = torch.randint(1, 50, (4, 7)), torch.ones(4, 7, dtype=torch.long)
    decoder_ids, target = torch.randint(1, 50, (4, 5)), torch.randint(0, 50, (4, 5))
    reference = copy.deepcopy(model)
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=(ids, mask, decoder_ids),
                             loss_fn=_token_loss, stages=3, schedule="1f1b-flush",
                             microbatches=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert {key: c.use_cache for key, c in configs.items()} == before  # as it was
    losses = [pipe.step(ids, mask, decoder_ids, target=target) for _ in range(2)]
    want, _ = train_one_process(reference, torch.optim.SGD(reference.parameters(), lr=0.1),
                                (ids, mask, decoder_ids), target, _token_loss, micro=2, steps=2)
    assert losses == pytest.approx(want, rel=1e-5)
    state = pipe.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m, n=name: f"{n}: {m}")
