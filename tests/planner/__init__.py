"""Tests of pdcompile.planner: plan(), the DP, the ILP, the cost model, refinement."""
