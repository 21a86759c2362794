"""Where the tests find the repository and the shipped PipeDream profiles, wherever in tests/ a
test file sits."""

from __future__ import annotations

from pathlib import Path

from pdcompile.profiles import SHIPPED

ROOT = Path(__file__).resolve().parents[2]
"""The repository: README.md, pdcompile/, docs/, examples/."""

PROFILES = SHIPPED
"""PipeDream's profiles as the package ships them (pdcompile/data/pipedream)."""
