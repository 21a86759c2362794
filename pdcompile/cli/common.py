"""Options and loaders shared by several subcommands (model spec, cluster, output)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from pdcompile.cluster import PRESET_HELP, Cluster
from pdcompile.errors import PdcompileError

CLUSTER_HELP = (
    "cluster: a preset (" + ", ".join(PRESET_HELP) + "), a short form such as "
    "'4x4@1e10,1.25e9:v100' (levels innermost first, bandwidths in bytes/s or with units like "
    "10Gbps, device after ':'), or a .json/.yaml file"
)


def add_cluster_option(parser: argparse.ArgumentParser, default: str = "local-2") -> None:
    """--cluster with the presets listed in --help."""
    presets = "\n".join(f"  {name:<11} {text}" for name, text in PRESET_HELP.items())
    parser.add_argument("--cluster", default=default, metavar="CLUSTER",
                        help=f"{CLUSTER_HELP} (default: {default}). Presets:\n{presets}")


def load_cluster(text: str) -> Cluster:
    """A cluster from a file path or a string."""
    if text.endswith((".json", ".yaml", ".yml")) or Path(text).is_file():
        return Cluster.load(text)
    return Cluster.parse(text)


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...]]:
    """Call `path/to/file.py:factory` (or `package.module:factory`); returns (model, inputs)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise PdcompileError(f"model {spec!r} must be written as path/to/file.py:factory "
                             "(e.g. examples/vgg16.py:factory)")
    if path.endswith(".py"):
        file = Path(path)
        if not file.is_file():
            raise PdcompileError(f"model file {path!r} does not exist")
        module_name = f"pdcompile_user_{file.stem}"
        spec_obj = importlib.util.spec_from_file_location(module_name, file)
        if spec_obj is None or spec_obj.loader is None:
            raise PdcompileError(f"cannot import {path!r} as a Python file")
        module = importlib.util.module_from_spec(spec_obj)
        sys.modules[module_name] = module
        spec_obj.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise PdcompileError(f"{path} has no callable {name!r}; define "
                             f"'def {name}(): return model, example_inputs'")
    result = factory()
    if not isinstance(result, tuple) or len(result) < 2:
        raise PdcompileError(f"{spec}() must return (model, example_inputs), got "
                             f"{type(result).__name__}")
    model, inputs = result[0], result[1]
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return model, inputs
