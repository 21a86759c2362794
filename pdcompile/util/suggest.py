"""'Did you mean ...?' for a mistyped name: the closest of the names that exist."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The choice most like `word` (case ignored), if one is close enough."""
    options = {c.lower(): c for c in choices if c}
    found = difflib.get_close_matches(word.lower(), list(options), n=1, cutoff=cutoff)
    return options[found[0]] if found else None


def did_you_mean(word: str, choices: Iterable[str], *, cutoff: float = 0.6) -> str:
    """" (did you mean 'x'?)" for the closest choice, or "" when none is close."""
    found = closest(word, choices, cutoff=cutoff)
    return f" (did you mean {found!r}?)" if found is not None and found != word else ""


__all__ = ["closest", "did_you_mean"]
