"""Tests of pdcompile.models: the bundled models and the real-model families."""
