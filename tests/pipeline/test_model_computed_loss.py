"""A model that computes its own loss (a Hugging Face causal LM given labels=) trains as one
process does, with its labels as the target and `loss_fn=lambda output, target: output.loss`,
as the message for a minibatch without a target says."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import pdcompile
from pdcompile.errors import PipelineInputError


def _own_loss(output: Any, target: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output.loss


def test_a_model_that_computes_its_own_loss_trains_like_one_process() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64))
    ids = torch.randint(1, 64, (4, 8))
    batch = {"input_ids": ids, "labels": ids}
    pipe = pdcompile.compile(copy.deepcopy(model), example_inputs=batch, loss_fn=_own_loss,
                             stages=2, schedule="1f1b-flush", microbatches=2,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(PipelineInputError, match="output.loss"):
        pipe.step(batch)
    losses = [pipe.step(batch, target=ids) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        opt.zero_grad()
        total = 0.0
        for part in ids.chunk(2):
            loss = model(input_ids=part, labels=part, use_cache=False).loss / 2
            loss.backward()
            total += loss.item()
        opt.step()
        want.append(total)
    assert losses == pytest.approx(want, rel=1e-5)
