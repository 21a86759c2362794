"""Where the tests find the repository and ../shared, wherever in tests/ a test file sits."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository: README.md, pdcompile/, docs/, examples/."""

SHARED = ROOT.parent / "shared"
"""../shared beside the repository (the PipeDream profiles)."""

PROFILES = SHARED / "profiles" / "pipedream"
