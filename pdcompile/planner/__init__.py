"""The planner: `plan` and `price_plan` (search.py) and `refine_plan` (refine.py), with their
parts: antichain states, PipeDream's dynamic program and the search around it (antichain, dp,
dp_search), the cost model (costmodel), the exact CP-SAT model (ilp), in-flight counts and
recomputation (in_flight), interleaved placement (interleave) and a plan's simulation
(simulation).
"""

from pdcompile.planner.refine import refine_plan
from pdcompile.planner.search import (
    AUTO_SCHEDULES,
    MOST_MIXED_WORKERS,
    MOST_WORKERS,
    PLANNERS,
    check_plannable,
    plan,
    price_plan,
)

__all__ = ["AUTO_SCHEDULES", "MOST_MIXED_WORKERS", "MOST_WORKERS", "PLANNERS", "check_plannable",
           "plan", "price_plan", "refine_plan"]
