"""pdcompile: a compiler for pipeline-parallel DNN training in the style of PipeDream.

Public surface: `Cluster`, `Plan`, `Stage`, `plan`, `compile`, `load`, `profiles`, `costgraph`.
Heavy parts (torch) are imported on first use so that planning from a profile stays light.
"""

from __future__ import annotations

from typing import Any

from pdcompile import profiles
from pdcompile.cost import costgraph
from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import Cluster, Level
from pdcompile.machine.device import Device
from pdcompile.plan import Plan, Stage

__all__ = [
    "Cluster", "Device", "Level", "Plan", "Stage", "PdcompileError",
    "plan", "refine_plan", "compile", "load", "costgraph", "profiles",
]
__version__ = "0.1.0"


def plan(*args: Any, **kwargs: Any) -> Plan:
    """`pdcompile.planner.plan` (defined here because the submodule `pdcompile.plan`, imported
    above, would otherwise shadow the lazy entry point)."""
    from pdcompile.planner import plan as _plan

    return _plan(*args, **kwargs)


def __getattr__(name: str) -> Any:
    """Lazy entry points: `refine_plan` (simulation-scored local search), `compile` and `load`
    (torch side)."""
    if name == "refine_plan":
        from pdcompile.planner import refine_plan

        return refine_plan
    if name in ("compile", "load"):
        from pdcompile import api

        return getattr(api, name)
    raise AttributeError(f"module 'pdcompile' has no attribute {name!r}")
