"""`RankFn`: the type of a rank's generated loop, `run_rank(rt)`.

Codegen (passes/codegen.py) writes and loads these loops, the Pipeline keeps them per run shape
and the backends run them; the type lives with the runtime they call, the layer all of those
may import.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

# a rank's generated loop: `run_rank(rt)`, a generator that yields whenever the rank waits
RankFn = Callable[[Any], Generator[Any, None, None]]

__all__ = ["RankFn"]
