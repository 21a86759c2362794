"""Tests of pdcompile.schedule: the IR, generators, lowering, validation."""
