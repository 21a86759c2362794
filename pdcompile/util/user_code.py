"""Importing what a user names on the command line, `path/to/file.py:name` or
`package.module:name`, with one clear line (and a 'did you mean') when it cannot be done."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcompile.errors import PdcompileError
from pdcompile.util.module_file import exec_module_file
from pdcompile.util.suggest import closest, did_you_mean

USER_MODULE_PREFIX = "pdcompile_user_"
"""The name a user's .py file is imported under is this prefix and the file's stem; no other
process can import such a module by name (an export keeps a copy of the file instead)."""


def user_module_file(module_name: str) -> Path | None:
    """The file a module imported from a path (`import_user_module("net.py", ...)`) was run
    from; None for any other module."""
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if not module_name.startswith(USER_MODULE_PREFIX) or not file:
        return None
    return Path(file)


def split_spec(spec: str, *, what: str, name: str, example: str) -> tuple[str, str]:
    """("path or module", "name") of "path:name"; `what`, `name` and `example` word the
    error ("model", "factory", "pdcompile.models.vgg16:factory")."""
    path, sep, attribute = spec.rpartition(":")
    if not sep or not path or not attribute:
        raise PdcompileError(f"{what} {spec!r} must be written as path/to/file.py:{name} or "
                             f"package.module:{name} (e.g. {example})")
    return path, attribute


def import_user_module(path: str, *, what: str) -> types.ModuleType:
    """The module a spec names (a .py file or an importable module); `what` names it in errors
    ("model": "the model module ..."). Any failure, including one raised by the module's own
    code, is one PdcompileError line that says where."""
    if path.endswith(".py"):
        return _import_file(Path(path), what=what)
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (path == missing or path.startswith(missing + ".")):
            raise PdcompileError(f"the {what} module {path!r} does not exist: no module named "
                                 f"{missing!r}{_similar_module(missing)}") from None
        raise PdcompileError(f"importing the {what} module {path!r} failed: {err} "
                             f"({_where(err)}); "
                             "install what it imports") from None
    except Exception as err:
        raise PdcompileError(f"importing the {what} module {path!r} raised {_describe(err)}") \
            from None


def _import_file(file: Path, *, what: str) -> types.ModuleType:
    if not file.is_file():
        folder = file.parent if str(file.parent) else Path(".")
        names = [p.name for p in folder.glob("*.py")] if folder.is_dir() else []
        raise PdcompileError(f"{what} file {str(file)!r} does not exist"
                             f"{did_you_mean(file.name, names)}")
    try:
        module = exec_module_file(file, f"{USER_MODULE_PREFIX}{file.stem}")
    except SyntaxError as err:
        raise PdcompileError(f"{what} file {str(file)!r} has a syntax error at line {err.lineno}: "
                             f"{err.msg}") from None
    except Exception as err:
        raise PdcompileError(f"importing {what} file {str(file)!r} raised {_describe(err)}") \
            from None
    if module is None:
        raise PdcompileError(f"cannot import {str(file)!r} as a Python file")
    return module


def find_callable(module: types.ModuleType, name: str, *, spec: str, hint: str
                  ) -> Callable[..., Any]:
    """`module.name`, which must be callable; `hint` says what to define if it is missing."""
    found = getattr(module, name, None)
    if callable(found):
        return found  # type: ignore[no-any-return]
    choices = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
               and getattr(v, "__module__", module.__name__) == module.__name__]
    raise PdcompileError(f"{spec.rpartition(':')[0]} has no callable {name!r}"
                         f"{did_you_mean(name, choices)}; {hint}")


def call_user(function: Callable[..., Any], *, spec: str) -> Any:
    """`function()`, its failure as one line naming the spec and where it was raised."""
    try:
        return function()
    except PdcompileError:
        raise
    except Exception as err:
        raise PdcompileError(f"{spec}() raised {_describe(err)}") from None


def _describe(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text} ({_where(err)})" if text \
        else f"{type(err).__name__} ({_where(err)})"


def _where(err: BaseException) -> str:
    """"file.py, line N" of the innermost frame that is not importlib's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}, line {err.lineno}"
    if not frames:
        return "while importing"
    last = frames[-1]
    return f"{last.filename}, line {last.lineno}"


def _similar_module(name: str) -> str:
    """A 'did you mean' among the modules beside the missing one."""
    parent, _, leaf = name.rpartition(".")
    try:
        package = importlib.import_module(parent) if parent else None
    except Exception:  # the parent package itself is broken: no suggestion
        return ""
    where = getattr(package, "__path__", []) if package is not None else None
    found = closest(leaf, [m.name for m in pkgutil.iter_modules(where)])
    if found is None or found == leaf:
        return ""
    full = f"{parent}.{found}" if parent else found
    return f" (did you mean {full!r}?)"


__all__ = ["USER_MODULE_PREFIX", "call_user", "find_callable", "import_user_module", "split_spec",
           "user_module_file"]
