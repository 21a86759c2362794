"""A compile() option refused before anything is traced: a model whose forward fails the test
if it ever runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.errors import PipelineInputError


class Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("traced")


def assert_refused_before_tracing(message: str, **options: Any) -> None:
    """compile(**options) raises a PipelineInputError matching `message` without tracing."""
    with pytest.raises(PipelineInputError, match=message):
        pdcompile.compile(Untraceable(), example_inputs=(torch.randn(2),), stages=2, **options)
