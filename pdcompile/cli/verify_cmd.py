"""`pdcompile verify DIR`: check an export or a checkpoint folder without running any of it.

    pdcompile verify vgg/                # an export: every file against MANIFEST.json
    pdcompile verify ckpt/               # a checkpoint folder: every rank's steps

An export: every file's size and SHA-256 against its manifest, the safetensors headers, the
syntax of its Python files (compiled, not run), and the modules it would import on load (those
of torch, of pdcompile and the ones recorded at export; others are refused unless --trust). A
checkpoint folder (`--checkpoint-dir` of `pdcompile run`): each rank's checkpoints against
their manifests, and the step a resume would start from. Nothing is imported from the folder and no
code of it runs. Exit status: 0 everything verifies, 1 something does not (one line naming the
file, or one line per damaged checkpoint and a summary).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from pdcompile.errors import PdcompileError
from pdcompile.units import format_bytes

_RANK_DIR = re.compile(r"^rank_(\d+)$")


def register(subparsers: Any) -> None:
    """Add the `verify` parser."""
    parser = subparsers.add_parser(
        "verify", help="check an export or checkpoint folder against its manifests (runs "
                       "nothing)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", metavar="DIR",
                        help="an export folder or a checkpoint folder (--checkpoint-dir)")
    parser.add_argument("--trust", action="store_true",
                        help="accept an export that names modules other than torch, pdcompile "
                             "and those it recorded (only for folders you trust)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Verify the folder; print what was checked."""
    folder = Path(args.folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise PdcompileError(f"{str(folder)!r} {what}; name an export folder or a checkpoint "
                             "folder")
    ranks = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _RANK_DIR.match(p.name))
                   and p.is_dir())
    if ranks and not (folder / "pipeline.json").exists():
        return _verify_checkpoints(folder, ranks)
    return _verify_export(folder, trust=args.trust)


def _verify_export(folder: Path, *, trust: bool) -> int:
    from pdcompile.export.checked import checked_export
    from pdcompile.export.trust import check_imports, named_modules

    checked = checked_export(folder)  # every file read once against the manifest, parsed
    meta, code, manifest = checked.meta, checked.code, checked.manifest
    check_imports(folder, meta, code, trust=trust, trees=checked.trees,
                  manifest_data=manifest.data)
    modules = sorted({m.split(".")[0] for m in named_modules(folder, meta, code,
                                                             trees=checked.trees)})
    print(f"{folder}: export verified: {len(manifest.files)} files, "
          f"{format_bytes(manifest.total_bytes)}, each matching its size and SHA-256 in "
          f"{manifest.path.name}; {len(code)} Python files (code that runs on load); modules "
          f"it names: {', '.join(modules)}")
    return 0


def _verify_checkpoints(folder: Path, ranks: list[int]) -> int:
    from pdcompile.runtime.checkpoint import Checkpointer

    common: set[int] | None = None
    damaged = 0
    for rank in ranks:
        ckpt = Checkpointer(folder, rank=rank, every=1)
        good, bad = ckpt.verified_steps()
        damaged += len(bad)
        for note in bad:
            print(f"{folder}: rank {rank} step {note.step}: {note.reason}", file=sys.stderr)
        steps = ", ".join(map(str, good)) or "none"
        print(f"{folder}: rank {rank}: checkpoints that verify at steps {steps}")
        common = set(good) if common is None else common & set(good)
    resume = max(common) if common else None
    where = (f"a resume starts from step {resume}" if resume is not None
             else "no step verifies on every rank, so a resume would start from the beginning")
    if damaged:
        print(f"pdcompile verify: error: {damaged} checkpoint file{'s' * (damaged != 1)} of "
              f"{folder} do{'es' * (damaged == 1)} not match {'their' if damaged != 1 else 'its'}"
              f" manifest; {where}", file=sys.stderr)
        return 1
    print(f"{folder}: {len(ranks)} rank{'s' * (len(ranks) != 1)} verified; {where}")
    return 0
