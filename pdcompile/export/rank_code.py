"""An export's rank files checked against the code generated from its schedule.txt.

Why: the manifest says only that a file is the one it lists; a manifest written again over an
edited folder (someone else's export, loaded or verified with trust) lists whatever is there.
A rank file swapped with another's, or cut short at a line, then ran another order than its
peers and deadlocked at the first step, naming no file. The loader and `pdcompile verify`
both compare each rank file with what codegen makes of schedule.txt (the loader with the
schedule its plan makes, checked equal to schedule.txt first).
"""

from __future__ import annotations

from pathlib import Path

from pdcompile.errors import DamagedFileError
from pdcompile.export.integrity import FIX
from pdcompile.passes.codegen import generate_rank
from pdcompile.schedule.ir import Schedule


def generated_sources(schedule: Schedule) -> dict[int, str]:
    """The rank code codegen makes of a lowered schedule, by rank."""
    return {rank: generate_rank(schedule, rank) for rank in schedule.ranks}


def check_rank_code(folder: Path, sources: dict[int, str], generated: dict[int, str]) -> None:
    """Each rank file's text (`sources`, by rank) is the code `generated` for that rank; one
    line naming the first file that is not."""
    for rank, text in sorted(sources.items()):
        if generated.get(rank) != text:
            what = ("a rank the schedule does not have" if rank not in generated else
                    "not the code generated from schedule.txt for that rank")
            raise DamagedFileError(f"{folder / f'rank_{rank}.py'} is {what} (altered, or "
                                   f"another export's); {FIX}")


__all__ = ["check_rank_code", "generated_sources"]
