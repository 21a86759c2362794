"""Tests of pdcompile.cost: the CostGraph, the cost pass, the cost formulas, PipeDream profiles."""
