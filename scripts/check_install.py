"""Imports every library pdcompile and its tests use, as they use them; exits 1 naming each one
that is installed but does not import (scripts/install.sh ends with it, tests/test_install.py
runs the same check inside the test run).

A library that is absent is only reported (its tests skip, naming the extra to install); one that
is present but fails to import (a dependency missing, a build for another torch) is an error:
its tests would fail, and the fix is the install, not a skip.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

REQUIRED = {
    "torch": "import torch, torch.distributed",
    "networkx": "import networkx",
    "ortools": "from ortools.sat.python import cp_model",
    "safetensors": "import safetensors.torch",
    "matplotlib": "import matplotlib",
    "yaml": "import yaml",
    "hypothesis": "import hypothesis",
    "pytest": "import pytest",
    "xdist": "import xdist",
}
"""What `pip install -e .[test]` brings: library -> the import statement the code runs."""

MODELS = {
    "torchvision": "import torchvision.models",
    "timm": "import timm",
    "transformers": "from transformers import BertForSequenceClassification, GPT2LMHeadModel",
}
"""The `.[models]` extra (the README's "Real models"): library -> what real_models imports."""


def is_absent(library: str) -> bool:
    """Whether `library` is not installed at all (not: installed and broken)."""
    return importlib.util.find_spec(library) is None


def import_failure(library: str, statement: str) -> str | None:
    """None when `statement` runs; otherwise one line saying why `library` does not import."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision 0.16.2 warns that image.so is unloaded
            exec(statement, {})  # noqa: S102 (a constant of this file)
    except Exception as err:  # any failure is what we report
        first = str(err).strip().splitlines()
        return f"{type(err).__name__}: {first[0] if first else ''}"
    return None


def problems(*, models: bool) -> list[str]:
    """One line per library that fails: a required one absent or broken, or (with `models`) a
    real-model library present but broken or absent."""
    found = []
    for table, needed in ((REQUIRED, True), (MODELS, models)):
        for library, statement in table.items():
            if is_absent(library):
                if needed:
                    found.append(f"{library} is not installed")
                continue
            failure = import_failure(library, statement)
            if failure:
                found.append(f"{library} is installed but `{statement}` fails ({failure})")
    return found


def main() -> int:
    found = problems(models="--no-models" not in sys.argv[1:])
    for line in found:
        print(f"check_install: {line}", file=sys.stderr)
    if found:
        print("check_install: FAILED; run `bash scripts/install.sh` again or install what is "
              "named above", file=sys.stderr)
        return 1
    versions = []
    for library in (*REQUIRED, *MODELS):
        module = sys.modules.get(library)
        versions.append(f"{library} {getattr(module, '__version__', '?')}")
    print(f"check_install: every library imports ({', '.join(versions)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
