"""The trust boundary of an export: which modules its import paths may name.

An export is code (its stage, graph and rank files run on load) and names code by import path
(the loss function, the optimizer class, recorded leaf modules, the output's container types).
Loading one imports those modules. Without `trust=True` (`--trust`), every module an export
names must be one the export's own code and the libraries it was written with need: torch,
pdcompile and a few standard modules, plus the user's modules the writer recorded in
pipeline.json ("modules"), and none of them may be a file inside the export folder itself (a
JSON import path naming a file shipped with the export would run it). Anything else is refused
in one line, before any of the folder's code runs.

`export_modules` is what the writer records; `check_imports` is what the loader checks.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pdcompile.errors import DamagedFileError, PipelineInputError
from pdcompile.export.integrity import MANIFEST_NAME
from pdcompile.export.signing import unsigned_reason
from pdcompile.runtime.tensor_tree import load_skeleton

# what an export's own code imports, whatever the model: torch, pdcompile's runtime, and the
# standard modules torch.fx's generated code and the container types name
BASE_PACKAGES = frozenset({"torch", "pdcompile", "builtins", "collections", "operator",
                           "_operator", "math", "functools", "typing"})
TRUST_HINT = ("pass trust=True to pdcompile.load (--trust to `pdcompile run`) only if you trust "
              "whoever wrote this folder: an export is code that runs when it is loaded")


def named_modules(folder: Path, meta: dict[str, Any], code: dict[str, str],
                  trees: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Every module the export names, with where it is named first: import paths in
    pipeline.json and in the recorded module files, container types of the output spec, and
    the import statements of the generated code (`code`: file name -> verified text).
    `trees`: the recorded module files' values as the loader read and will use them (by file
    name); without, their JSON is read from the folder (the writer's own files)."""
    found: dict[str, str] = {}
    for path in _paths_in(meta):
        found.setdefault(path, "pipeline.json")
    try:
        for name in _type_names(json.loads(meta.get("output_spec", "null"))):
            found.setdefault(name.rpartition(".")[0] or name, "pipeline.json (output_spec)")
    except ValueError:
        pass  # read_meta and load_spec name a malformed spec
    if trees is None:
        trees = {file.name: _tree_skeleton(file)
                 for file in folder.glob("*_modules.safetensors")}
    for name, tree in sorted(trees.items()):
        for path in _paths_in(tree):
            found.setdefault(path, name)
    for name, text in sorted(code.items()):
        for module, line in _code_imports(text):
            found.setdefault(module, f"{name}, line {line}")
        for module, line in _function_modules(text):
            found.setdefault(module, f"{name}, line {line} (an autograd Function's module)")
    return {module: where for module, where in found.items() if module}


def export_modules(folder: Path, meta: dict[str, Any], code: dict[str, str]) -> list[str]:
    """The user's modules an export names (all but torch, pdcompile and the standard ones):
    what the writer records in pipeline.json so that the loader accepts them."""
    return sorted(m for m in named_modules(folder, meta, code) if not _base(m))


def check_imports(folder: Path, meta: dict[str, Any], code: dict[str, str], *,
                  trust: bool, trees: Mapping[str, Any] | None = None,
                  manifest_data: bytes | None = None) -> None:
    """Refuse, in one line, an export that names a module outside its trust boundary (module
    docstring); nothing is imported here (only the top-level package is located). `trees`:
    as `named_modules`; `manifest_data`: the manifest's bytes the files were checked against
    (the signature is checked on those, not on the file read again)."""
    if trust:
        return
    unsigned = unsigned_reason(folder, MANIFEST_NAME, manifest_data)
    if unsigned is not None:
        raise PipelineInputError(f"{folder} is not an export this user wrote: {unsigned}; "
                                 f"{TRUST_HINT}")
    recorded = meta.get("modules", [])
    allowed = {str(m) for m in recorded} if isinstance(recorded, list) else set()
    copies = _user_copies(folder, meta)
    for module, where in named_modules(folder, meta, code).items():
        if not _base(module) and module not in allowed:
            raise PipelineInputError(
                f"{folder} names the module {module!r} ({where}), which is not torch, pdcompile "
                f"or a module the export recorded when it was written; {TRUST_HINT}")
        inside = _inside(module, folder)
        if inside is not None and inside != copies.get(module):
            raise PipelineInputError(
                f"{folder} names the module {module!r} ({where}), which would be imported from "
                f"{inside}, a file inside the export folder itself; {TRUST_HINT}")


def _user_copies(folder: Path, meta: dict[str, Any]) -> dict[str, Path]:
    """The user's model files the writer copied into the export (export/user_modules.py), by
    module name: a module already imported from its copy (an earlier load in this process) is
    the recorded one, whose SHA-256 the loader checks, not a file smuggled into the folder."""
    entries = meta.get("user_modules")
    if not isinstance(entries, dict):
        return {}
    copies = {}
    for name, entry in entries.items():
        if isinstance(entry, dict) and isinstance(entry.get("file"), str):
            copies[str(name)] = (folder / entry["file"]).resolve()
    return copies


def _base(module: str) -> bool:
    return module.split(".")[0] in BASE_PACKAGES


def _inside(module: str, folder: Path) -> Path | None:
    """Where the top-level package of `module` would be imported from, if inside `folder`."""
    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    root = folder.resolve()
    for place in places:
        try:
            where = Path(place).resolve()
        except (OSError, TypeError):
            continue
        if where == root or root in where.parents:
            return where
    return None


def _paths_in(tree: Any) -> Iterator[str]:
    """The modules of the import paths ("module:Qual.name") under "function" and "class" keys
    of a JSON tree (callable references, module records, optimizer recipes)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in ("function", "class") and isinstance(value, str):
                yield value.partition(":")[0]
            else:
                yield from _paths_in(value)
    elif isinstance(tree, list | tuple):  # tuples: a tree as decoded (tensor_tree)
        for value in tree:
            yield from _paths_in(value)


def _type_names(tree: Any) -> Iterator[str]:
    if isinstance(tree, dict):
        if isinstance(tree.get("type"), str):
            yield tree["type"]
        for value in tree.values():
            yield from _type_names(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _type_names(value)


def _tree_skeleton(file: Path) -> Any:
    """The JSON part of a tensor-tree file the writer just wrote (runtime/tensor_tree's reader,
    its tensors' bytes not kept)."""
    try:
        return load_skeleton(file)
    except (OSError, DamagedFileError):  # a damaged file: the manifest or the loader names it
        return None


def parsed(text: str, *, tries: int = 3) -> ast.Module:
    """`ast.parse(text)`, parsed again where CPython 3.11 (before 3.11.8) raises a spurious
    SystemError "AST constructor recursion depth mismatch": its AST recursion guard is shared by
    the interpreter's threads, so another thread's parse can upset it (CPython gh-106905; seen
    once exporting in a long test run). The text itself is fine: a second parse succeeds."""
    for attempt in range(tries):
        try:
            return ast.parse(text)
        except SystemError as err:
            if "recursion depth mismatch" not in str(err) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _code_imports(text: str) -> Iterator[tuple[str, int]]:
    """The modules a Python text imports (`import a.b`, `from a.b import c`), with lines."""
    try:
        tree = parsed(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or ""), node.lineno


def _function_modules(text: str) -> Iterator[tuple[str, int]]:
    """The modules of the autograd Functions a Python text calls through
    `pdcompile::function_call` (runtime/function_call.py), which imports them when it runs:
    the first argument of every `....function_call.default("module:Name", ...)` call."""
    try:
        tree = parsed(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        outer = node.func.value
        if node.func.attr != "function_call" and not (
                isinstance(outer, ast.Attribute) and outer.attr == "function_call"):
            continue
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield first.value.partition(":")[0], node.lineno
        else:  # a name computed at run time: no module the export recorded
            yield "(an autograd Function named at run time)", node.lineno


__all__ = ["BASE_PACKAGES", "TRUST_HINT", "check_imports", "export_modules", "named_modules"]
