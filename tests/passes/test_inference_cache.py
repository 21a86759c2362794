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
