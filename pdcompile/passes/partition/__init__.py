"""The partitioner: antichain states, the cost model, PipeDream's DP and the CP-SAT model.

Use `pdcompile.plan` (pdcompile/planner.py); the modules here are its parts.
"""
