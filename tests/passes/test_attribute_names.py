"""Attribute names torch.fx would paste into generated code unescaped are refused before any
code is written; every other name compiles, exports and loads to the same function."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pdcompile
from pdcompile.errors import PipelineInputError
from pdcompile.passes.attribute_names import writable


class Named(nn.Module):
    """Three layers whose names the test chooses; a buffer and a parameter beside the middle
    one, named after it."""

    def __init__(self, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for name in names:
            self.add_module(name, nn.Linear(4, 4))
        self.register_buffer(names[1] + "_b", torch.ones(4))
        self.register_parameter(names[1] + "_p", nn.Parameter(torch.zeros(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = (getattr(self, n) for n in self.names)
        x = torch.tanh(b(torch.tanh(a(x))) * getattr(self, self.names[1] + "_b")
                       + getattr(self, self.names[1] + "_p"))
        return c(x)


def _compile(model: nn.Module) -> pdcompile.Pipeline:
    return pdcompile.compile(model, example_inputs=(torch.randn(4, 4),),
                             loss_fn=nn.functional.mse_loss, stages=2, microbatches=2,
                             cost="analytic")


def _injection(marker: Path) -> str:
    """A name that, pasted between fx's quotes, reads as code creating `marker`."""
    return (f'q") if getattr(__import__("os"), "system")("touch {marker}") else '
            'getattr(next(getattr(self, "children")()), "forward')


@pytest.mark.parametrize("name", ["class", 'a"b', "a\\b", "a\nb", "a\rb", "a\u2028b", "\u00b5",
                                  "\ufb01x", "INJECT"])
def test_a_name_fx_cannot_write_is_refused_and_never_runs(tmp_path: Path, name: str) -> None:
    """Before, fx raised a SyntaxError about code the user never wrote, or ran the name; an
    identifier Python reads as another (the micro sign as Greek mu, the ligature as `fi`)
    failed with an AttributeError when the stage ran."""
    marker = tmp_path / "ran"
    name = _injection(marker) if name == "INJECT" else name
    with pytest.raises(PipelineInputError) as info:
        _compile(Named(("first", name, "last")))
    assert repr(name) in str(info.value) and "rename it" in str(info.value)
    assert not marker.exists()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=".\x00"),
                    min_size=1, max_size=10).filter(
    lambda n: n not in {"first", "last", "names"} and not hasattr(nn.Module, n)))
def test_a_name_fx_can_write_exports_and_loads_to_the_same_function(
        tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    torch.manual_seed(0)
    model = Named(("first", name, "last"))
    if not writable(name):
        with pytest.raises(PipelineInputError):
            _compile(model)
        return
    folder = tmp_path_factory.mktemp("named") / "out"
    _compile(model).export(str(folder))
    x = torch.randn(4, 4)
    assert torch.allclose(pdcompile.load(str(folder)).evaluate(x), model(x))
