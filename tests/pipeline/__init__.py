"""Tests of the compiled Pipeline as a whole: training equals gradient accumulation."""
