"""Training captures a model without its inference cache.

Hugging Face decoders (Llama, Mistral, Qwen2, OPT, GPT-Neo, Phi, Gemma, BART, ...) are built with
`config.use_cache = True`, so that generation reuses past keys and values: their forward then
returns a cache object (`transformers.DynamicCache`) beside the logits, even in training mode.
No stage could send such an object and torch.export refuses it as an output, so a model built
as its library's defaults have it failed to compile. Training never reads the cache; both front
ends capture the model with `use_cache` off (the model's own flag, put back afterwards), as
Hugging Face's own training loop does with gradient checkpointing. A `use_cache=` the caller
passes among the example inputs is left as given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn


@contextmanager
def without_inference_cache(model: nn.Module, kwargs: Mapping[str, Any]) -> Iterator[bool]:
    """Within: `model.config.use_cache` is False where it was True and the caller did not pass
    `use_cache`; yields whether it was switched off."""
    config = getattr(model, "config", None)
    switch = "use_cache" not in kwargs and getattr(config, "use_cache", None) is True
    if switch:
        config.use_cache = False  # type: ignore[union-attr]
    try:
        yield switch
    finally:
        if switch:
            config.use_cache = True  # type: ignore[union-attr]


__all__ = ["without_inference_cache"]
