"""Stage code that calls a model's own autograd Function through `pdcompile::function_call`
imports the Function's module when it runs: the trust check counts that module as one the
export names (export/trust.py), and a Function named at run time as one it never recorded."""

from __future__ import annotations

from pathlib import Path

from pdcompile.export.trust import named_modules


def test_the_module_of_a_called_function_is_named(tmp_path: Path) -> None:
    code = {"stage_0.py": (
        "def forward(self, x):\n"
        "    a = torch.ops.pdcompile.function_call.default('evil.place:Grl', [x])\n"
        "    b = torch.ops.pdcompile.function_call(name, [x])\n"
        "    return a\n")}
    found = named_modules(tmp_path, {}, code, trees={})
    assert "evil.place" in found and "line 2" in found["evil.place"]
    assert any("named at run time" in module for module in found)
