"""Tests of pdcompile.backends: local, distributed (processes), simulated."""
