"""`pdcompile inspect`: table, JSON, SVG, coarsening, and the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdcompile.cli import inspect_cmd, main
from pdcompile.cost import costgraph
from pdcompile.profiles import load_pipedream

MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.mean() > 0:
            return self.lin(x)
        return x


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()

    def forward(self, x):
        return self.inner(x)


def factory():
    return Net(), (torch.randn(4, 8),)


def untraceable():
    return Wrapper(), (torch.randn(4, 8),)
'''


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    file = tmp_path / "net.py"
    file.write_text(MODEL_FILE)
    return file


def test_table_for_a_model_file(model_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", f"{model_file}:factory", "--warmup", "0", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert "4 nodes" in lines[0] and "measured" in lines[0] and "batch size 4" in lines[0]
    header = lines[1].split()
    assert header == ["node", "what", "output", "fwd", "bwd", "act", "params", "keep"]
    rows = {line.split()[0]: line for line in lines[3:-2]}
    assert set(rows) == {"x", "a", "relu", "b"}
    assert "float32[4, 16]" in rows["a"] and "Linear(in_features=8" in rows["a"]
    assert lines[-1].startswith("total (4)")
    # parameter bytes of both layers in the totals: (8*16+16 + 16*4+4) * 4 = 848 B
    assert "848 B" in lines[-1]


def test_json_of_a_model_analytic(model_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", f"{model_file}:factory", "--cost", "analytic", "--cluster",
                 "h100-node", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["source"] == "analytic on h100"
    graph = costgraph.from_dict(data)
    assert list(graph.nodes) == ["x", "a", "relu", "b"]
    assert data["totals"]["params"] == 848
    assert graph.nodes["a"]["fwd"] > 0


def test_profile_totals_and_coarsening(profiles_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    profile = profiles_dir / "vgg16" / "graph.txt"
    saved = tmp_path / "coarse.json"
    code = main(["inspect", "--profile", str(profile), "--coarsen", "10", "--save", str(saved)])
    out = capsys.readouterr().out
    assert code == 0 and "10 blocks" in out.splitlines()[0] and "imported" in out
    coarse = costgraph.load(saved)
    assert coarse.number_of_nodes() == 10
    want = costgraph.totals(load_pipedream(profile))
    assert costgraph.totals(coarse)["fwd"] == pytest.approx(want["fwd"])
    code = main(["inspect", "--profile", str(profile), "--top", "3"])
    out = capsys.readouterr().out
    assert "showing the 3 most expensive" in out


def test_svg(model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> None:
    """--svg runs graphviz's `dot -Tsvg FILE.dot -o FILE.svg`; a stand-in `dot` on PATH (the
    real one when installed) checks the call and the DOT source it is given."""
    if shutil.which("dot") is None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        fake = bin_dir / "dot"
        fake.write_text("#!/bin/sh\n# dot -Tsvg IN -o OUT: wrap the DOT source in an svg\n"
                        '[ "$1" = "-Tsvg" ] && [ "$3" = "-o" ] || exit 3\n'
                        '{ echo "<svg>"; cat "$2"; echo "</svg>"; } > "$4"\n')
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '')}")
    svg = tmp_path / "net.svg"
    code = main(["inspect", f"{model_file}:factory", "--cost", "analytic", "--svg", str(svg)])
    assert code == 0 and f"wrote {svg}" in capsys.readouterr().out
    text = svg.read_text()
    assert "<svg" in text and "Linear(in_features=8" in text
    assert 'n1 -> n2' in svg.with_suffix(".dot").read_text()


def test_missing_dot_gives_a_hint(model_file: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(inspect_cmd.shutil, "which", lambda _: None)
    svg = tmp_path / "net.svg"
    code = main(["inspect", f"{model_file}:factory", "--cost", "analytic", "--svg", str(svg)])
    err = capsys.readouterr().err
    assert code == 1
    assert "apt-get install graphviz" in err and str(svg.with_suffix(".dot")) in err
    assert svg.with_suffix(".dot").is_file() and not svg.exists()


def test_dot_labels_are_escaped() -> None:
    graph = costgraph.new_cost_graph('say "hi"')
    costgraph.add_block(graph, "a", fwd=1e-3, bwd=0, act=4, params=0, label='x "quoted" \\ y')
    text = inspect_cmd.to_dot(graph)
    assert 'x \\"quoted\\" \\\\ y' in text and text.startswith('digraph "say \\"hi\\""')


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["inspect"], "give exactly one of MODEL"),
        (["inspect", "nowhere.py:factory"], "does not exist"),
        (["inspect", "justaname"], "path/to/file.py:factory"),
        (["inspect", "--profile", "/nonexistent/graph.txt"], "cannot read profile"),
        (["inspect", "--profile", "x.txt", "--costgraph", "y.json"], "exactly one"),
    ],
)
def test_user_errors_are_one_line(argv: list[str], expect: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert expect in err and len(err.splitlines()) == 1
    assert err.startswith("pdcompile inspect: error:")


def test_untraceable_model_names_module_and_fix(model_file: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", f"{model_file}:untraceable"]) == 1
    err = capsys.readouterr().err
    assert "'inner' (Branchy)" in err and "x.mean() > 0" in err and "--leaf" not in err
    assert "leaf_modules=['inner']" in err
    code = main(["inspect", f"{model_file}:untraceable", "--leaf", "inner", "--cost",
                 "analytic"])
    assert code == 0


@pytest.mark.slow
def test_console_script_runs_a_bundled_model() -> None:
    done = subprocess.run([sys.executable, "-m", "pdcompile", "inspect",
                           "pdcompile.models.alexnet:factory", "--cost", "analytic", "--top",
                           "2"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "analytic on v100" in done.stdout and "total (" in done.stdout


def test_json_of_a_model_measured_with_cold_caches(model_file: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", f"{model_file}:factory", "--caches", "cold", "--repeats", "2",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["source"] == "measured (wall clock, cold caches)"
    graph = costgraph.from_dict(data)
    assert graph.nodes["a"]["fwd"] > 0
