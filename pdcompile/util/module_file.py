"""A Python file executed as a module: the one place that does it, for a user's own file
(user_code) and an export's stage and graph files (export/read.py), each wording its own errors.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def exec_module_file(path: Path, name: str) -> types.ModuleType | None:
    """The module `name` made by running the file `path`, or None where `path` cannot be loaded
    as Python. It is in `sys.modules` while and after it runs (dataclasses, pickle and fx look
    classes up there); if its code raises, it is removed again and the error propagates."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module


def exec_module_source(source: str, path: Path, name: str) -> types.ModuleType:
    """The module `name` made by running `source` (the text of `path`, already read and checked
    by the caller: the file is not read again, and no bytecode cache is read or written). In
    `sys.modules` as `exec_module_file` leaves it; removed again if the code raises."""
    code = compile(source, str(path), "exec")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except Exception:
        del sys.modules[name]
        raise
    return module


__all__ = ["exec_module_file", "exec_module_source"]
