"""Tests of pdcompile.runtime: stashing, checkpoints, buffers, the B/W split, model errors."""
