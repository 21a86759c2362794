"""Traceable forwards of torch.nn's layer stacks, so that a pipeline can cut between their layers.

`nn.TransformerEncoder`, `nn.TransformerDecoder` and `nn.Transformer` hold their layers in a
ModuleList, but their own forwards inspect tensors (nested-tensor fast path, `is_nested`, mask
dtypes, a check that a mask is causal) in ways torch.fx cannot trace, so fx keeps each stack
whole. The forwards here do what those forwards do on ordinary (not nested) tensors: call the
layers in order with the same arguments, then the final norm. Each layer stays one node (its
own forward is not traceable either), so the cut can fall between any two layers.

A mask given with `is_causal=None` is passed on with `is_causal=False`: torch would compare the
mask with a causal one to pick a faster kernel, which is data-dependent; the mask is applied
either way. The nested-tensor fast path (evaluation only) is not taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _causal(is_causal: bool | None) -> bool:
    return is_causal is True


def encoder_forward(stack: nn.TransformerEncoder, src: torch.Tensor,
                    mask: torch.Tensor | None = None,
                    src_key_padding_mask: torch.Tensor | None = None,
                    is_causal: bool | None = None) -> Any:
    """`nn.TransformerEncoder.forward` as a plain loop over its layers."""
    output = src
    for layer in stack.layers:
        output = layer(output, src_mask=mask, is_causal=_causal(is_causal),
                       src_key_padding_mask=src_key_padding_mask)
    if stack.norm is not None:
        output = stack.norm(output)
    return output


def decoder_forward(stack: nn.TransformerDecoder, tgt: torch.Tensor, memory: torch.Tensor,
                    tgt_mask: torch.Tensor | None = None,
                    memory_mask: torch.Tensor | None = None,
                    tgt_key_padding_mask: torch.Tensor | None = None,
                    memory_key_padding_mask: torch.Tensor | None = None,
                    tgt_is_causal: bool | None = None, memory_is_causal: bool = False) -> Any:
    """`nn.TransformerDecoder.forward` as a plain loop over its layers."""
    output = tgt
    for layer in stack.layers:
        output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                       tgt_key_padding_mask=tgt_key_padding_mask,
                       memory_key_padding_mask=memory_key_padding_mask,
                       tgt_is_causal=_causal(tgt_is_causal), memory_is_causal=memory_is_causal)
    if stack.norm is not None:
        output = stack.norm(output)
    return output


def transformer_forward(model: nn.Transformer, src: torch.Tensor, tgt: torch.Tensor,
                        src_mask: torch.Tensor | None = None,
                        tgt_mask: torch.Tensor | None = None,
                        memory_mask: torch.Tensor | None = None,
                        src_key_padding_mask: torch.Tensor | None = None,
                        tgt_key_padding_mask: torch.Tensor | None = None,
                        memory_key_padding_mask: torch.Tensor | None = None,
                        src_is_causal: bool | None = None, tgt_is_causal: bool | None = None,
                        memory_is_causal: bool = False) -> Any:
    """`nn.Transformer.forward` without its shape checks (they compare traced sizes)."""
    memory = model.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                           is_causal=src_is_causal)
    return model.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                         tgt_key_padding_mask=tgt_key_padding_mask,
                         memory_key_padding_mask=memory_key_padding_mask,
                         tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


def traceable_forward(module: nn.Module) -> Callable[..., Any] | None:
    """The forward to trace in place of `module.forward`, or None to use its own.

    Only the exact torch.nn types are replaced: a subclass may have changed the forward.
    """
    table: dict[type[nn.Module], Callable[..., Any]] = {
        nn.TransformerEncoder: encoder_forward,
        nn.TransformerDecoder: decoder_forward,
        nn.Transformer: transformer_forward,
    }
    found = table.get(type(module))
    if found is None:
        return None

    def forward(*args: Any, **kwargs: Any) -> Any:
        return found(module, *args, **kwargs)

    return forward


__all__ = ["decoder_forward", "encoder_forward", "traceable_forward", "transformer_forward"]
