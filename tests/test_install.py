"""The install is part of the test run: every library pdcompile needs imports, and a real-model
library (.[models]) is either absent (its tests skip, naming the extra) or imports. A library
that is present but broken (a dependency missing, a build for another torch) fails here, naming
it, instead of hiding as skips or as failures far from the cause (scripts/check_install.py is the
check scripts/install.sh ends with)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest

from tests.helpers.paths import ROOT


def _check_install() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_install",
                                                  ROOT / "scripts" / "check_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _check_install()


@pytest.mark.parametrize("library", list(CHECK.REQUIRED))
def test_a_required_library_imports(library: str) -> None:
    assert not CHECK.is_absent(library), f"{library} is not installed: bash scripts/install.sh"
    failure = CHECK.import_failure(library, CHECK.REQUIRED[library])
    assert failure is None, f"{library} does not import ({failure}): bash scripts/install.sh"


@pytest.mark.parametrize("library", list(CHECK.MODELS))
def test_a_real_model_library_is_absent_or_imports(library: str) -> None:
    if CHECK.is_absent(library):
        pytest.skip(f"{library} is not installed: pip install -e .[models]")
    failure = CHECK.import_failure(library, CHECK.MODELS[library])
    assert failure is None, (f"{library} is installed but does not import ({failure}): its "
                             "tests would fail; bash scripts/install.sh installs what it needs")


def test_the_check_tells_absent_from_broken() -> None:
    """A missing dependency of a present library is a failure, not an absence."""
    assert CHECK.is_absent("pdcompile_no_such_library")
    assert not CHECK.is_absent("json")
    assert CHECK.import_failure("json", "import json") is None
    broken = CHECK.import_failure("json", "import json, pdcompile_no_such_dependency")
    assert broken == "ModuleNotFoundError: No module named 'pdcompile_no_such_dependency'"
