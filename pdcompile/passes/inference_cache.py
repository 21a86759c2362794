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
    """Within: `use_cache` is False on every config the model's layers hold where it was True
    and the caller did not pass `use_cache`; yields whether any was switched off. Encoder-
    decoders keep a config of their own per half (T5's decoder stack holds a copy of the
    model's, with `use_cache` on): switching the model's alone left T5 returning its cache."""
    configs = [] if "use_cache" in kwargs else _cache_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield bool(configs)
    finally:
        for config in configs:
            config.use_cache = True


def _cache_configs(model: nn.Module) -> list[Any]:
    """The distinct config objects of the model and its layers with `use_cache` on."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            found.setdefault(id(config), config)
    return list(found.values())


__all__ = ["without_inference_cache"]
