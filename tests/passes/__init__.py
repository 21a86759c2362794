"""Tests of pdcompile.passes: front ends, trace, shapes, split, crossing, fuse, codegen."""
