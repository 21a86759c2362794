"""A stashed weight version put in a module's parameter slots computes what
`torch.func.functional_call` computes, and the live parameters come back, even on an error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrizations

from pdcompile.runtime.stash import WeightVersions
from pdcompile.runtime.weight_swap import ParameterSlots


class _Tied(nn.Module):
    """Two Linear layers sharing one weight (registered under two names), a parametrized one
    (its weight read through `parametrizations.weight.original`) and a parameter of the root."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.c = parametrizations.weight_norm(nn.Linear(4, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x)))) * self.scale


def _version(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A weight version as WeightVersions makes one (tied names share a tensor), moved away
    from the live values so that using the wrong one shows."""
    params = dict(model.named_parameters(remove_duplicate=False))
    snapshot = WeightVersions(params, copy=True).snapshot()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in {id(t): t for t in snapshot.values()}.values():
            tensor.add_(torch.randn(tensor.shape, generator=gen))
    return snapshot


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5))
def test_a_swapped_version_computes_what_functional_call_computes(seed: int, rows: int) -> None:
    torch.manual_seed(seed)
    model = _Tied()
    version = _version(model, seed)
    live = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(rows, 4)
    expected = torch.func.functional_call(model, version, (x,))
    expected.sum().backward()
    want = {name: t.grad.clone() for name, t in version.items()}  # type: ignore[union-attr]
    for t in version.values():
        t.grad = None

    got = ParameterSlots(model, list(version)).call(version, [x])
    got.sum().backward()

    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name, tensor in version.items():  # gradients land in the version's leaves, tied once
        torch.testing.assert_close(tensor.grad, want[name], rtol=0, atol=0)
    for name, p in model.named_parameters():  # the live parameters are back, untouched
        assert isinstance(p, nn.Parameter), name
        assert p.grad is None, name
        torch.testing.assert_close(p.detach(), live[name], rtol=0, atol=0)
    assert model.b.weight is model.a.weight


def test_the_live_parameters_come_back_when_the_forward_raises() -> None:
    model = _Tied()
    before = dict(model.named_parameters(remove_duplicate=False))
    version = _version(model, 0)
    with pytest.raises(RuntimeError):
        ParameterSlots(model, list(version)).call(version, [torch.randn(2, 5)])  # wrong width
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)


def test_a_name_that_is_not_a_parameter_is_refused() -> None:
    with pytest.raises(KeyError, match="'a.nothing' is not a parameter of the stage module"):
        ParameterSlots(_Tied(), ["a.nothing"])
