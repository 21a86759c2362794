"""Assemble benchmarks/RESULTS.md from the per-workstream tables in benchmarks/results/.

Each benchmark writes its own Markdown file (planner.md, runtime.md, simulator.md, ...) with the
machine and the command it came from; RESULTS.md is their concatenation in reading order, so that
the README can link one page and no figure is typed twice.

    python benchmarks/assemble_results.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("cost", "planner", "paper", "local", "runtime", "runtime-v", "simulator", "refine", "demo")
HEADER = """# Measured results

Every figure below was measured by a script in `benchmarks/` (named in each section) on the
machine the section names; sections are copied from `benchmarks/results/*.md` by
`python benchmarks/assemble_results.py`. Targets the issues set are quoted next to the figures,
met or not.
"""


def assemble(results: Path = HERE / "results") -> str:
    """RESULTS.md's text: the header, then each results file (known ones first)."""
    files = sorted(results.glob("*.md"))
    ranked = sorted(files, key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else len(ORDER),
                                          p.stem))
    parts = [HEADER]
    for path in ranked:
        text = path.read_text().strip()
        # demote the file's headings by one level so that RESULTS.md has a single title
        lines = [("#" + line) if line.startswith("#") else line for line in text.splitlines()]
        parts.append(f"<!-- from benchmarks/results/{path.name} -->\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main() -> int:
    """Write benchmarks/RESULTS.md."""
    out = HERE / "RESULTS.md"
    out.write_text(assemble())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
